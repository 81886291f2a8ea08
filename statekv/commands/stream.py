"""``statekv stream``: replay a video file as a live stream and ask questions when it reaches given times."""

from __future__ import annotations

import argparse
import math

from ..console import add_output_arguments, print_json, quiet_libraries
from ..options import ModelOptions
from ..values import POSITIVE_FLOAT, POSITIVE_INT


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
    parser.add_argument("--save", metavar="PATH", default=None,
                        help="save the stream at the end (resume with statekv.Stream.load)")
    add_output_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..pipeline import VideoQA
    from ..video import FrameDecodeError, open_video

    options = ModelOptions.from_args(args)
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
            if not args.json:
                print(f"[{time:7.2f} s, {stream.frames} frames] Q: {question}\n{'':>21}A: {answer}", flush=True)

    try:
        for frame in video.sample_at_rate(args.max_fps):
            if stream.frames:  # a question before the first frame waits for it
                ask_due(frame.timestamp - 1e-9)
            if stream.frames + len(stream.pending) >= horizon:
                break
            stream.push(frame)
    except FrameDecodeError as error:
        if args.save:  # keep what was streamed before the broken frame
            stream.save(args.save)
            error.args = (f"{error}; the {stream.frames} frames before it were saved to {args.save}",)
        raise
    stream.flush()
    ask_due(math.inf)  # questions at or after the end see the whole video
    if args.save:
        stream.save(args.save)
    if args.json:
        print_json({"video": args.video, "model": args.model, "method": args.method, "budget": args.budget,
                    "frames_window": args.frames, "stats": stream.stats.to_dict(), "answers": results,
                    "saved": args.save})
    else:
        print(f"\n{stream.frames} frames, {stream.tokens} tokens, {options.label}, carried "
              f"{stream.stats.carried_tokens} tokens, {1e3 * stream.stats.mean_frame_seconds:.1f} ms per frame"
              + (f"; saved to {args.save}" if args.save else ""))
    return 0
