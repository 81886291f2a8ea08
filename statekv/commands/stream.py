"""``statekv stream``: replay a video file as a live stream and ask questions when it reaches given times."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from ..console import add_output_arguments, one_line, quiet_libraries
from ..errors import OutputError, StateKVError
from ..options import ModelOptions
from ..user_cache import cache_dir
from ..values import POSITIVE_FLOAT, POSITIVE_INT, check_output_file


def timed_question(text: str) -> tuple[float, str]:
    """``"12.5:What is on the table?"`` -> ``(12.5, "What is on the table?")``."""
    seconds, separator, question = text.partition(":")
    try:
        time = float(seconds)
    except ValueError:
        time = math.nan
    if not separator or not math.isfinite(time) or time < 0 or not question.strip():
        raise argparse.ArgumentTypeError(f"expected SECONDS:QUESTION (e.g. 12.5:\"What is on the table?\"), "
                                         f"got {text!r}")
    return time, question.strip()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stream", help="replay a video as a live stream, asking questions at given times",
        description="Push the frames of VIDEO one by one as a live source would (at most --max-fps per second) "
                    "and ask each --ask question as soon as the stream reaches its time, from the frames seen "
                    "so far. Later frames keep streaming after each question.",
    )
    parser.add_argument("video", metavar="VIDEO", help="video file or folder of frames")
    parser.add_argument("--ask", type=timed_question, action="append", required=True, metavar="SECONDS:QUESTION",
                        help="ask QUESTION when the stream reaches SECONDS (repeatable)")
    ModelOptions.add_arguments(parser)
    parser.add_argument("--max-fps", type=POSITIVE_FLOAT, default=1.0, metavar="F",
                        help="frames kept per second of stream (default: 1)")
    parser.add_argument("--max-frames", type=POSITIVE_INT, default=None, metavar="N",
                        help="declare the stream for at most N frames (default: the video's length at --max-fps)")
    parser.add_argument("--save", metavar="FILE", default=None,
                        help="save the stream at the end, or when it stops early (resume with statekv.Stream.load); "
                             "checked before the model loads")
    add_output_arguments(parser, json_help="print one JSON object per line: each answer as it is made, then a "
                                           "summary (stats, every answer, where the stream was saved)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..pipeline import VideoQA
    from ..video import open_video

    options = ModelOptions.from_args(args)
    save = check_output_file(args.save, "--save") if args.save else None  # before hours of encoding, not after
    video = open_video(args.video)  # check the file before loading the model
    horizon = args.max_frames or math.floor(video.duration * args.max_fps) + 1
    quiet_libraries()
    qa = VideoQA.from_options(options)
    # a live stream encodes each frame as it comes unless --vision-batch asks it to wait for a batch
    stream = qa.stream(horizon_frames=horizon, max_fps=args.max_fps, name=video.name,
                       vision_batch=args.vision_batch or 1)
    questions = sorted(args.ask, key=lambda item: item[0])
    results = []

    def ask_due(now: float) -> None:
        while questions and questions[0][0] <= now:
            time, question = questions.pop(0)
            answer = stream.ask(question, max_new_tokens=args.max_new_tokens)
            results.append({"time": time, "frames": stream.frames, "tokens": stream.tokens,
                            "question": question, "answer": answer})
            if args.json:  # one line per answer, as it is made: nothing is lost if the run stops later
                print(json.dumps({"event": "answer", **results[-1]}), flush=True)
            else:
                print(f"[{time:7.2f} s, {stream.frames} frames] Q: {question}\n{'':>21}A: {answer}", flush=True)

    try:
        for frame in video.sample_at_rate(args.max_fps):
            if stream.frames:  # a question before the first frame waits for it
                ask_due(frame.timestamp - 1e-9)
            if stream.frames + len(stream.pending) >= horizon:
                break
            stream.push(frame)
        stream.flush()
        ask_due(math.inf)  # questions at or after the end see the whole video
    except (Exception, KeyboardInterrupt) as error:
        if save is not None:  # keep what was streamed before the failure
            try:
                where, problem = save_or_rescue(stream, save)
                kept = f"the {stream.frames} frames streamed before it were saved to {where}" + (
                    f" (not to {save}: {problem})" if problem else "")
            except OutputError as save_error:
                kept = f"and the {stream.frames} frames streamed before it were lost: {one_line(save_error)}"
            if isinstance(error, StateKVError):
                error.args = (f"{one_line(error)}; {kept}",)
            else:
                print(f"statekv stream: {kept}", file=sys.stderr, flush=True)
        raise
    where, problem = save_or_rescue(stream, save) if save is not None else (None, None)
    stats = stream.stats
    if args.json:
        print(json.dumps({"event": "summary", "video": args.video, "model": args.model, "method": args.method,
                          "budget": args.budget, "frames_window": args.frames, "label": options.label,
                          "stats": stats.to_dict(), "answers": results, "saved": where and str(where),
                          "save_error": problem}), flush=True)
    else:
        print(f"\n{stream.frames} frames, {stream.tokens} tokens, {options.label}, carried "
              f"{stats.carried_tokens} tokens, {1e3 * stats.mean_frame_seconds:.1f} ms per frame"
              + (f"; saved to {where}" if where else ""), flush=True)
    if problem:
        raise OutputError(f"could not save the stream to {save} ({problem}); it was saved to {where} instead")
    return 0


def save_or_rescue(stream, target: Path) -> tuple[Path, str | None]:
    """Save ``stream`` to ``target`` or, if that fails, to a rescue file; returns where it went and, when it is
    not ``target``, why. Raises `OutputError` (naming every place tried) only when nothing could be written."""
    try:
        return stream.save(target), None
    except OutputError as error:
        problem = one_line(error).removeprefix(f"cannot save the stream to {target}: ")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = f"{target.stem}-{stamp}-{os.getpid()}{target.suffix or '.safetensors'}"
    tried = []
    for folder in (cache_dir() / "rescued", Path(tempfile.gettempdir())):
        try:
            return stream.save(folder / name), problem
        except OutputError as error:
            tried.append(one_line(error))
    raise OutputError(f"could not save the stream to {target} ({problem}), nor to a rescue file ({'; '.join(tried)})")
