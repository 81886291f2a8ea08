"""``statekv answer``: encode a video once and answer every question given."""

from __future__ import annotations

import argparse
import os
import sys

from ..console import (add_output_arguments, add_sampling_arguments, interactive, one_line, print_json,
                       json_sizes, quiet_libraries, warn_free_form)
from ..settings.options import ModelOptions
from ..settings.values import printable


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "answer", help="answer questions about a video (encoded once)",
        description="Encode VIDEO once with the chosen method, then answer each QUESTION from that encoding. If "
                    "--max-cache-bytes stops the encoding (--cache-limit refuse), the questions are answered from the "
                    "frames that fit, with one warning line on stderr (exit status 0; with --json, \"stopped\" says "
                    "where). A frame that cannot be decoded in the middle of VIDEO stops the encoding too: the "
                    "questions are answered from the frames before it, then one error line says why (exit status 2).",
    )
    parser.add_argument("video", metavar="VIDEO", help="video file or folder of frames")
    parser.add_argument("questions", metavar="QUESTION", nargs="+", help="one or more questions")
    ModelOptions.add_arguments(parser)
    add_sampling_arguments(parser)
    add_output_arguments(parser)
    parser.add_argument("--stats", action="store_true",
                        help="also print the encoding's statistics: frames per second, decode / vision / "
                             "language-model time per frame, memory")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..api.videoqa import VideoQA
    from ..errors import CacheLimitError, FrameDecodeError, InputError, QuestionTooLong
    from ..video import open_video
    from ..video.sources import cut_short

    if not all(question.strip() for question in args.questions):
        raise InputError("a question is empty")
    for question in args.questions:
        if "\n" not in question and os.path.exists(question):  # (False for a name too long to be a file's)
            raise InputError(f"QUESTION {question!r} names a file or folder, not a question: statekv answer takes one "
                             "VIDEO; answer each video with its own command")
    options = ModelOptions.from_args(args, all_used=True)  # bad settings fail before the video opens or the model loads
    source = open_video(args.video)
    warn_free_form("answer", args.model, args.questions)
    quiet_libraries()
    qa = VideoQA.from_options(options)
    refuse_what_cannot_fit(qa, source, args)
    stopped = undecodable = None
    try:
        video = qa.encode(args.video, max_fps=args.max_fps, max_frames=args.max_frames, progress=interactive())
    except CacheLimitError as error:  # refused at the cap: answered from the frames that fit, as asked
        if error.encoded is None or not error.encoded.frames:
            raise
        video, stopped = error.encoded, one_line(error)
        print(f"statekv answer: warning: {stopped}; answering from what was encoded", file=sys.stderr, flush=True)
    except FrameDecodeError as error:  # a broken video: answered from the frames before it, then a failure
        if error.encoded is None or not error.encoded.frames:
            raise
        video = error.encoded  # (its message goes on to name the Python API's way on: its reason is the CLI's)
        stopped = undecodable = one_line(error.reason)
    ends = source.num_frames / source.fps  # its last frame's end (a frame of a slow time-lapse spans seconds)
    short = None if stopped is not None else cut_short(source, ends, args.max_fps)
    if short is not None:  # (where its content ends, when the file says: its frames may claim more)
        print(f"statekv answer: warning: the video's frames end at {short:g} s, before the {source.duration:g} s its "
              "header gives (a file cut short, or still being written); answering from them", file=sys.stderr,
              flush=True)
    try:
        answers = [video.ask(question, max_new_tokens=args.max_new_tokens) for question in args.questions]
    except QuestionTooLong as error:
        raise InputError(too_long(error.prompt, error.answer, error.room)) from None
    stats = video.stats
    if args.json:
        print_json({"video": args.video, "model": args.model, "method": args.method, **json_sizes(options),
                    "label": options.label, "stats": stats.to_dict(),
                    "stopped": stopped,
                    "answers": [{"question": q, "answer": a} for q, a in zip(args.questions, answers)]})
        return undecodable_end(undecodable, stats.frames)
    why = "" if stopped is None else " (stopped: see the error line)" if undecodable else " (stopped: see the warning)"
    print(f"{printable(args.video)}: {stats.frames} frames{why}, "
          f"{stats.tokens} tokens, {options.label}, carried "
          f"{stats.carried_tokens} tokens, {1e3 * stats.mean_frame_seconds:.1f} ms per frame")
    if args.stats:
        print(stats.summary())
    for question, answer in zip(args.questions, answers):
        print(f"\nQ: {question}\nA: {answer}")
    return undecodable_end(undecodable, stats.frames)


def undecodable_end(reason: str | None, frames: int) -> int:
    """The exit status after the answers: 2, with one error line, when a frame could not be decoded."""
    if reason is None:
        return 0
    sys.stdout.flush()
    print(f"statekv answer: error: {reason}; the answers are from the {frames} frame{'s' if frames != 1 else ''} "
          "before it", file=sys.stderr, flush=True)
    return 2


def too_long(prompt: int, answer: int, room: int, *, at_most: bool = False) -> str:
    kept = f"{room} tokens at most left" if at_most else f"{room} tokens kept"
    return (f"the question ({prompt} tokens) and answer ({answer}) do not fit in the {kept} after the video: raise "
            "--reserve-tokens or lower --max-new-tokens")


def refuse_what_cannot_fit(qa, video, args: argparse.Namespace) -> None:
    """Refuse (one line) a question that with its answer cannot fit after the video before the video is encoded,
    not after: under stream positions the room after the video is at most the horizon less the fewest tokens the
    video can stream (`min_video_tokens`: the reserve and what the horizon's bound on the video leaves unused),
    under bounded positions at most the model's positions. The engine checks the room the video left exactly."""
    from ..core.positions.placing import choose_positions
    from ..core.positions.rope import rope_capacity, trained_range
    from ..errors import InputError
    from ..models import LayoutState

    if qa.recent_window is not None:  # simplestream: each question makes its own room
        return
    frames = len(video.sample_indices(max_fps=args.max_fps, max_frames=args.max_frames))
    config = qa.adapter.model.config.get_text_config()
    size = (video.height, video.width)
    horizon = qa.horizon_for(frames, size)
    stream = choose_positions(qa.engine.positions, config, horizon) == "stream"
    capacity = rope_capacity(config)
    if stream and capacity is not None and horizon > capacity:  # the video itself cannot fit: the engine says so
        return
    room = horizon - qa.adapter.min_video_tokens(frames, frame_size=size) if stream else trained_range(config)
    for question in args.questions:
        prompt = int(qa.adapter.question_ids(question, LayoutState()).shape[1])
        if prompt + args.max_new_tokens > room:
            raise InputError(too_long(prompt, args.max_new_tokens, room, at_most=True) if stream else
                             f"the question ({prompt} tokens) and answer ({args.max_new_tokens}) do not fit in the "
                             f"model's {room} positions: lower --max-new-tokens")
