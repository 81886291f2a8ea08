"""``statekv demo``: full attention, recency and StateKV side by side, offline, in about a minute.

Without ``--video`` it runs on held-out synthetic videos (never trained on; written once to statekv's cache
folder, ``$STATEKV_CACHE`` or ``~/.cache/statekv``)
with the built-in model (a small InternVL3 trained here, see docs/accuracy.md) unless ``--model`` names
another: each method encodes every video and answers its six questions, and the demo prints the accuracy of
each method (overall with a 95% interval, and per question family where the methods differ), a few questions
with their truth and each method's answer, and, for one stream made of several of the videos back to back,
what a new frame attends to (the carried state, in tokens and bytes) and what it costs (milliseconds per frame)
as the stream grows; a plot of both is written. With ``--video`` it answers ``--question`` about that video
under each method instead.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from ..console import ProgressLine, add_output_arguments, omp_threads, print_json, quiet_libraries, warn_free_form
from ..errors import ConfigurationError, FrameDecodeError, OutputError, VideoError
from ..locks import FileLock
from ..plotting import check_plot_file, pyplot
from ..user_cache import cache_dir  # where the demo keeps its videos and its plot
from ..settings.options import BUILTIN_BUDGET, is_builtin_kind
from ..settings.values import PATH, POSITIVE_FLOAT, POSITIVE_INT, printable
from ..synthetic.prompts import question_prompt
from ..synthetic.tasks import COLOUR_OPTIONS

DEMO_SET = "demo-synthetic-v3"
DEMO_SEED = 0  # an evaluation seed: the demo's videos were never trained on (the first of docs/accuracy.md's)
DEMO_VIDEOS = 12
VIDEO_MAX_FPS, VIDEO_MAX_FRAMES = 1.0, 512  # how --video is sampled
GROWTH_VIDEOS = 4  # videos fed back to back into the stream whose per-frame cost is shown
OTHER_BUDGET, OTHER_WINDOW = 256, 4
BUILTIN_WINDOW = 16  # frames: the built-in model's 4-token frames, as many as its budget holds (BUILTIN_BUDGET)
METHOD_NAMES = {"full": "full attention", "recency": "recency", "statekv": "StateKV"}
DEFAULT_QUESTION = "What happens in this video?"
# the built-in model answers the synthetic videos' multiple-choice questions only
BUILTIN_QUESTION = question_prompt("Which colour was shown first?", COLOUR_OPTIONS)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="full attention, recency and StateKV side by side on held-out videos (offline built-in model)",
        description=__doc__.split("\n\n")[1].replace("``", ""),  # the docstring's reST marks, not --help's
    )
    parser.add_argument("--model", default=None, metavar="M",
                        help="a checkpoint folder or hub id instead of the built-in model")
    parser.add_argument("--videos", type=POSITIVE_INT, default=None, metavar="N",
                        help=f"held-out synthetic videos to answer about (default: {DEMO_VIDEOS})")
    parser.add_argument("--video", default=None, help="a video of your own instead of the synthetic ones")
    parser.add_argument("--question", default=None,
                        help=f"the question to answer about --video (default: {DEFAULT_QUESTION!r}; for the built-in "
                             "model a multiple-choice one); without --video the demo asks the held-out videos' own "
                             "questions")
    parser.add_argument("--budget", type=POSITIVE_INT, default=None, metavar="B",
                        help=f"StateKV budget in tokens (default: {BUILTIN_BUDGET} for the built-in model, "
                             f"else {OTHER_BUDGET})")
    parser.add_argument("--frames", type=POSITIVE_INT, default=None, metavar="R",
                        help=f"recency window in frames (default: {BUILTIN_WINDOW} for the built-in model, "
                             f"else {OTHER_WINDOW})")
    parser.add_argument("--plot", default=None, metavar="PNG", type=PATH,
                        help="where to write the plot (default: demo.png in statekv's cache folder)")
    parser.add_argument("--no-plot", dest="draw", action="store_false", help="write no plot")
    parser.add_argument("--max-fps", type=POSITIVE_FLOAT, default=None, metavar="F",
                        help=f"with --video (default: {VIDEO_MAX_FPS:g})")
    parser.add_argument("--max-frames", type=POSITIVE_INT, default=None, metavar="N",
                        help=f"with --video (default: {VIDEO_MAX_FRAMES})")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    parser.add_argument("--device", default=None, help="default: cuda if available")
    parser.add_argument("--trust-remote-code", action="store_true")
    add_output_arguments(parser, max_new_tokens=16)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import statekv
    from statekv.settings.options import BUILTIN_NAME, is_builtin

    statekv.ModelOptions(dtype=args.dtype, device=args.device)  # checked before anything is written or loaded
    if args.question is not None and args.video is None:
        raise ConfigurationError("--question asks about --video; without --video the demo asks the held-out videos' "
                                 "own questions: give --video too, or leave --question out")
    if args.question is not None and not args.question.strip():
        raise ConfigurationError("--question is empty")
    if args.video is None:
        given = [flag for flag, value in (("--max-fps", args.max_fps), ("--max-frames", args.max_frames))
                 if value is not None]
        if given:
            raise ConfigurationError(f"{' and '.join(given)} sample --video; the held-out videos are streamed whole: "
                                     "give --video too, or leave them out")
    elif args.videos is not None:
        raise ConfigurationError("--videos counts the held-out videos, which --video replaces: leave --videos out with "
                                 "--video")
    if args.video is not None and args.plot is not None:
        raise ConfigurationError("--plot draws the held-out videos' comparison, which --video does not run: leave "
                                 "--plot out with --video")
    if args.draw and args.video is None:  # before a minute of answers, not after
        try:
            if args.plot:
                check_plot_file(args.plot, "--plot")
            else:  # the default goes in statekv's cache folder, whose own check names it
                pyplot()
        except ConfigurationError as error:  # matplotlib missing
            raise ConfigurationError(f"{error}, or run the demo with --no-plot") from None
    if args.video is not None:
        from statekv.video import open_video

        open_video(args.video)  # before the model loads
    quiet_libraries()
    model = args.model or BUILTIN_NAME
    builtin = is_builtin(model)
    small = is_builtin_kind(model)  # the built-in model or weights trained by `statekv train-builtin`
    budget = args.budget or (BUILTIN_BUDGET if small else OTHER_BUDGET)
    window = args.frames or (BUILTIN_WINDOW if small else OTHER_WINDOW)
    plot_path = Path(args.plot) if args.plot else cache_dir() / "demo.png"
    videos = None if args.video else demo_set(args.videos or DEMO_VIDEOS)
    import torch

    callers_threads = torch.get_num_threads()
    if small and (args.device or "cpu").startswith("cpu") and omp_threads() is None:  # torch ignores an empty one
        # its matrices are too small to gain from more threads, and on a shared CPU one thread keeps the
        # per-frame times steady (threads that wait for each other can make a step 100 times slower)
        torch.set_num_threads(1)
    try:
        progress(f"loading {'the built-in model' if builtin else model}")
        loaded = statekv.VideoQA.from_pretrained(model, method="full", dtype=args.dtype, device=args.device,
                                                 trust_remote_code=args.trust_remote_code)
        methods = {"full": ("full attention", {}), "recency": (f"recency R={window}", {"frames": window}),
                   "statekv": (f"StateKV B={budget}", {"budget": budget})}
        if videos is None:
            return _own_video(args, loaded, methods, model)
        # the small model's streams together take little memory; a real checkpoint's detailed caches, one at a time
        together = len(videos) if small else 1
        return _held_out(args, loaded, methods, model, builtin, videos, plot_path, together)
    finally:  # a caller that ran it in its own process keeps its threads
        torch.set_num_threads(callers_threads)


def _held_out(args, loaded, methods: dict, model: str, builtin: bool, videos: list, plot_path: Path,
              together: int) -> int:
    from statekv.synthetic.tasks import FAMILIES

    from .demo_runs import grow, plot, score

    scored, growths = [], []
    asked = sum(len(rows) for _, rows in videos)
    grown = min(GROWTH_VIDEOS, len(videos))
    for index, (method, (label, sizes)) in enumerate(methods.items(), 1):
        stream = f"then {grown} of them back to back as one stream" if grown > 1 else "then it as one stream"
        progress(f"{label} ({index}/{len(methods)}): answering {_count(asked, 'question')} about "
                 f"{_count(len(videos), 'video')}, {stream}")
        qa = loaded.with_options(method=method, **sizes)
        scored.append(score(qa, method, label, videos, max_new_tokens=args.max_new_tokens, together=together))
        growths.append(grow(qa, method, label, [video for video, _ in videos[:GROWTH_VIDEOS]]))
    families = [name for name in FAMILIES if any(run.family(name)[1] for run in scored)]
    drawn = None
    if args.draw:
        drawn = plot(growths, scored, families, plot_path)  # a plot that cannot be written: one line
    questions = [row for _, rows in videos for row in rows]
    if args.json:
        print_json(_document(model, builtin, videos, questions, scored, growths, families, drawn))
        return 0
    _print_held_out(model, builtin, videos, questions, scored, growths, families, drawn)
    return 0


def demo_set(count: int) -> list[tuple[Path, list[dict]]]:
    """The first ``count`` videos of the held-out set made with `DEMO_SEED`, each with its questions (rows of the
    question file), written to the cache folder on first use (a larger ``count`` writes a larger set)."""
    from statekv.eval.annotations import read_table
    from statekv.eval.loaders import load_synthetic
    from statekv.synthetic.benchmark import QUESTIONS_FILE, make_benchmark

    name = f"{DEMO_SET}-{count}"

    def build(path: Path) -> None:
        progress(f"writing {_count(count, 'held-out synthetic video')} to {cache_dir() / name} (first run only)")
        line = ProgressLine("statekv demo: ")  # thousands of videos take minutes
        make_benchmark(path, videos=count, seed=DEMO_SEED, progress=lambda done, total: line(done, total, "written"))

    folder = _cached(name, build)
    load_synthetic(folder)  # every row checked (a damaged cached set is one line, not a wrong table)
    rows = read_table(folder / QUESTIONS_FILE)
    videos: dict[str, list[dict]] = {}
    for row in rows:
        videos.setdefault(row["video"], []).append(row)
    return [(folder / video, questions) for video, questions in videos.items()]


def _own_video(args, loaded, methods: dict, model: str) -> int:
    question = args.question or (BUILTIN_QUESTION if is_builtin_kind(model) else DEFAULT_QUESTION)
    warn_free_form("demo", model, [question])
    rows, answers = [], {}
    for index, (method, (label, sizes)) in enumerate(methods.items(), 1):
        progress(f"{label} ({index}/{len(methods)}): encoding {printable(args.video)} and answering")
        qa = loaded.with_options(method=method, **sizes)
        try:
            encoding = qa.encode(args.video, max_fps=args.max_fps or VIDEO_MAX_FPS,
                                 max_frames=args.max_frames or VIDEO_MAX_FRAMES)
        except FrameDecodeError as error:  # its message names the Python API's way on; the demo compares whole videos
            if error.encoded is not None:
                error.encoded.close()
            raise VideoError(f"{error.reason}; the demo compares the methods over the whole video: give one that "
                             "reads to its end, or ask from the frames before it with statekv answer") from None
        with encoding as encoded:
            answers[method] = encoded.ask(question, max_new_tokens=args.max_new_tokens)
            stats = encoded.stats
        quarter = max(1, len(stats.frame_seconds) // 4)
        rows.append({"method": method, "setting": label, "frames": stats.frames, "tokens": stats.tokens,
                     "carried": stats.carried_tokens,
                     # medians, so the first frame's one-time warm-up does not dominate the first quarter
                     "ms_per_frame_first_quarter": 1e3 * statistics.median(stats.frame_seconds[:quarter]),
                     "ms_per_frame_last_quarter": 1e3 * statistics.median(stats.frame_seconds[-quarter:]),
                     "answer": answers[method]})
    if args.json:
        print_json({"model": model, "video": str(args.video), "question": question, "rows": rows})
        return 0
    print(f"model: {printable(model)}\nvideo: {printable(args.video)}\nquestion: {question}\n")
    header = f"{'method':<20} {'frames':>6} {'tokens':>7} {'carried':>8} {'ms/frame, 1st 1/4':>18} {'last 1/4':>9}  answer"
    print(header + "\n" + "-" * len(header))
    for row in rows:
        print(f"{row['setting']:<20} {row['frames']:>6} {row['tokens']:>7} {row['carried']:>8} "
              f"{row['ms_per_frame_first_quarter']:>18.1f} {row['ms_per_frame_last_quarter']:>9.1f}  {row['answer']!r}")
    return 0


def progress(message: str) -> None:
    """One line on stderr of what the demo does next, so its minute of work is not a silent one (stdout keeps only
    the results)."""
    print(f"statekv demo: {message}", file=sys.stderr, flush=True)


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}" + ("" if number == 1 else "s")


def _windows(growth, videos: int) -> list[tuple[int, int]]:
    frames = len(growth.tokens)
    size = max(1, frames // videos)
    return [(start, min(frames, start + size)) for start in range(0, frames, size)]


def _print_held_out(model, builtin, videos, questions, scored, growths, families, drawn) -> None:
    from .demo_runs import wilson

    name = ("the built-in InternVL3 (1.3 M parameters, trained here on synthetic videos; see docs/accuracy.md)"
            if builtin else model)
    print(f"model: {name}")
    print(f"videos: {len(videos)} held-out synthetic videos (96 s each, one picture per second, never trained on), "
          f"{len(questions)} questions; the last 16 s of each show nothing a question asks about\n")
    width = 22
    print(("accuracy".ljust(24) + "".join(run.label.ljust(width) for run in scored)).rstrip())
    overall = ""
    for run in scored:
        low, high = wilson(run.correct, len(run.answers))
        overall += f"{100 * run.correct / len(run.answers):.0f}% [{100 * low:.0f}, {100 * high:.0f}]".ljust(width)
    print((f"all {len(questions)} questions".ljust(24) + overall).rstrip())
    same = []
    for family in families:
        counts = [run.family(family) for run in scored]
        if len({correct for correct, _ in counts}) == 1:
            same.append(f"{family} {counts[0][0]}/{counts[0][1]}")
            continue
        print((f"  {family}".ljust(24) + "".join(f"{c}/{n}".ljust(width) for c, n in counts)).rstrip())
    if same:
        print(f"  (the same under every method: {', '.join(same)})")
    print("(95% Wilson intervals; chance is 25%, 50% on order, which names two of its options)\n")

    growth = growths[0]
    print(f"one stream of {len(growth.tokens)} frames ({min(GROWTH_VIDEOS, len(videos))} of the videos back to "
          "back), frame after frame:")
    names = ["full" if g.method == "full" else g.label.split(" ")[0] for g in growths]
    print(f"{'':<10}{'tokens':>7}   {'carried state: tokens | KiB':^{15 * len(growths)}}   "
          f"{'ms per frame':^{9 * len(growths)}}".rstrip())
    header = (f"{'frames':<10}{'seen':>7}   " + "".join(f"{name:>15}" for name in names) + "   "
              + "".join(f"{name:>9}" for name in names))
    print(header + "\n" + "-" * len(header))
    for start, end in _windows(growth, min(GROWTH_VIDEOS, len(videos))):
        cells = [g.window(start, end) for g in growths]
        carried = "".join(f"{c['carried']:>8} |{c['carried_kib']:>5.0f}" for c in cells)
        times = "".join(f"{c['ms_per_frame']:>9.1f}" for c in cells)
        print(f"{f'{start + 1}-{end}':<10}{cells[0]['tokens']:>7}   {carried}   {times}")
    print("carried state: what a new frame attends to at the end of each stretch (tokens per layer and KV head;\n"
          "KiB of keys and values over all layers); ms per frame: the median wall time. Every method also keeps\n"
          "every frame in its detailed cache, which questions are answered from.\n")

    _print_examples(questions, scored)
    if drawn is not None:
        print(f"plot: {drawn}")


def _print_examples(questions, scored, count: int = 2) -> None:
    """A few questions where StateKV and recency answered differently, with the truth, to check by eye."""
    by_method = {run.method: {answer["qid"]: answer for answer in run.answers} for run in scored}
    shown = 0
    for row in questions:
        answers = {method: by_method[method][row["qid"]] for method in by_method}
        if shown == count or answers["statekv"]["correct"] == answers["recency"]["correct"]:
            continue
        if shown == 0:
            print("where StateKV and recency answered differently, for instance:")
        print(f"  {row['video_id']}: {row['question']}  " + " / ".join(
            f"{letter}. {option}" for letter, option in zip("ABCD", row["options"], strict=False)))
        seconds = ", ".join(f"{frame}s" for frame in row["evidence_frames"])
        print(f"    truth: {row['answer']} (seen at {seconds});  " + "   ".join(
            f"{METHOD_NAMES[method]}: {answer['answer']!r}" for method, answer in answers.items()))
        shown += 1
    if shown:
        print()


def _document(model, builtin, videos, questions, scored, growths, families, drawn) -> dict:
    from .demo_runs import wilson

    rows = []
    for run in scored:
        low, high = wilson(run.correct, len(run.answers))
        rows.append({"method": run.method, "setting": run.label, "correct": run.correct, "questions": len(run.answers),
                     "interval": [low, high], "seconds": run.seconds,
                     "families": {name: dict(zip(("correct", "questions"), run.family(name))) for name in families},
                     "answers": run.answers})
    stream = [{"method": g.method, "setting": g.label, "tokens": g.tokens, "carried": g.carried,
               "frame_ms": g.frame_ms, "token_bytes": g.token_bytes} for g in growths]
    return {"model": model, "builtin": builtin, "videos": [str(video) for video, _ in videos], "rows": rows,
            "questions": questions, "stream": stream, "plot": None if drawn is None else str(drawn)}


def _cached(name: str, build) -> Path:
    """``cache_dir() / name``, built once; a half-built item never appears under its name: it is built as
    ``name.partial`` beside it, which a build that was stopped leaves for the next to go on with, under the lock of
    ``name.lock`` (a second demo starting meanwhile is refused in one line)."""
    target = cache_dir() / name
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=target.parent).close()
    except OSError as error:
        raise OutputError(f"cannot write statekv's cache in {target.parent} ({error.strerror or error}); set "
                          "STATEKV_CACHE to a writable folder") from None
    lock = FileLock.acquire(target.parent / f"{name}.lock", what=f"statekv's cache {target}", error=OutputError,
                            advice="another statekv demo is writing it: wait for it to end, then run this again",
                            remove=True)
    try:
        if not target.exists():  # else the demo that held the lock finished it
            built = target.parent / f"{name}.partial"
            build(built)
            built.rename(target)
    finally:
        lock.release()
    return target
