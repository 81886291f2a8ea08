"""``statekv answer``: encode a video once and answer every question given."""

from __future__ import annotations

import argparse
import sys

from ..console import (add_output_arguments, add_sampling_arguments, interactive, one_line, print_json,
                       json_sizes, quiet_libraries, warn_free_form)
from ..settings.options import ModelOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "answer", help="answer questions about a video (encoded once)",
        description="Encode VIDEO once with the chosen method, then answer each QUESTION from that encoding. If "
                    "--max-cache-bytes stops the encoding (--cache-limit refuse), the questions are answered from the "
                    "frames that fit, with one warning line on stderr (exit status 0; with --json, \"stopped\" says "
                    "where).",
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

    if not all(question.strip() for question in args.questions):
        raise InputError("a question is empty")
    options = ModelOptions.from_args(args, all_used=True)  # bad settings fail before the video opens or the model loads
    open_video(args.video)
    warn_free_form("answer", args.model, args.questions)
    quiet_libraries()
    qa = VideoQA.from_options(options)
    stopped = None
    try:
        video = qa.encode(args.video, max_fps=args.max_fps, max_frames=args.max_frames, progress=interactive())
    except (CacheLimitError, FrameDecodeError) as error:  # refused at the cap, or a frame that cannot be read:
        if error.encoded is None or not error.encoded.frames:  # answer from the frames before it, saying so
            raise
        video = error.encoded  # (a decode error's message goes on to name the Python API's way on: its reason)
        stopped = one_line(error.reason if isinstance(error, FrameDecodeError) else error)
        print(f"statekv answer: warning: {stopped}; answering from what was encoded", file=sys.stderr, flush=True)
    try:
        answers = [video.ask(question, max_new_tokens=args.max_new_tokens) for question in args.questions]
    except QuestionTooLong as error:
        raise InputError(f"the question ({error.prompt} tokens) and answer ({error.answer}) do not fit in the "
                         f"{error.room} tokens kept after the video: raise --reserve-tokens or lower "
                         "--max-new-tokens") from None
    stats = video.stats
    if args.json:
        print_json({"video": args.video, "model": args.model, "method": args.method, **json_sizes(options),
                    "label": options.label, "stats": stats.to_dict(),
                    "stopped": stopped,
                    "answers": [{"question": q, "answer": a} for q, a in zip(args.questions, answers)]})
        return 0
    print(f"{args.video}: {stats.frames} frames{' (stopped: see the warning)' if stopped else ''}, "
          f"{stats.tokens} tokens, {options.label}, carried "
          f"{stats.carried_tokens} tokens, {1e3 * stats.mean_frame_seconds:.1f} ms per frame")
    if args.stats:
        print(stats.summary())
    for question, answer in zip(args.questions, answers):
        print(f"\nQ: {question}\nA: {answer}")
    return 0
