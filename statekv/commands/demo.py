"""``statekv demo``: questions about a video answered under full attention, recency and StateKV, offline.

Without ``--model`` and ``--video`` it uses the built-in model (a small InternVL3 trained here on synthetic
long videos, see docs/accuracy.md) and a held-out synthetic video written once to the cache folder: each
method encodes the video and answers its six questions, and every question, its options, each method's
answer and the truth (with the seconds of the video that show it) are printed, so the answers can be checked
against the video. With ``--model`` or ``--video`` it answers ``--question`` about that video instead.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from ..console import add_output_arguments, interactive, print_json, quiet_libraries
from ..errors import ConfigurationError, OutputError
from ..user_cache import cache_dir  # where the demo keeps its video
from ..values import POSITIVE_FLOAT, POSITIVE_INT

DEMO_SET = "demo-synthetic-v2"
DEMO_SEED = 0  # an evaluation seed: the demo video was never trained on
BUILTIN_BUDGET, BUILTIN_WINDOW = 64, 16  # compute-matched: 16 frames of 4 tokens carry 64 tokens
OTHER_BUDGET, OTHER_WINDOW = 256, 4
DEFAULT_QUESTION = "What happens in this video?"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="answer questions about a video under all three methods (offline built-in model by default)",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--model", default=None, metavar="M",
                        help="a checkpoint folder or hub id instead of the built-in model")
    parser.add_argument("--video", default=None, help="a video instead of the built-in synthetic one")
    parser.add_argument("--question", default=None,
                        help=f"the question to answer about --video (default: {DEFAULT_QUESTION!r}); without "
                             "--video the demo asks the built-in video's own questions")
    parser.add_argument("--budget", type=POSITIVE_INT, default=None, metavar="B",
                        help=f"StateKV budget in tokens (default: {BUILTIN_BUDGET} for the built-in model, "
                             f"else {OTHER_BUDGET})")
    parser.add_argument("--frames", type=POSITIVE_INT, default=None, metavar="R",
                        help=f"recency window in frames (default: {BUILTIN_WINDOW} for the built-in model, "
                             f"else {OTHER_WINDOW})")
    parser.add_argument("--max-fps", type=POSITIVE_FLOAT, default=1.0, metavar="F", help="(default: 1)")
    parser.add_argument("--max-frames", type=POSITIVE_INT, default=512, metavar="N", help="(default: 512)")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    parser.add_argument("--device", default=None, help="default: cuda if available")
    parser.add_argument("--trust-remote-code", action="store_true")
    add_output_arguments(parser)
    parser.set_defaults(run=run, max_new_tokens=16)


def run(args: argparse.Namespace) -> int:
    import statekv
    from statekv.builtin import BUILTIN_NAME

    statekv.ModelOptions(dtype=args.dtype, device=args.device)  # checked before anything is written or loaded
    if args.question is not None and args.video is None:
        raise ConfigurationError("--question asks about --video; without --video the demo asks the built-in video's "
                                 "own questions: give --video too, or leave --question out")
    if args.question is not None and not args.question.strip():
        raise ConfigurationError("--question is empty")
    if args.video is not None:
        from statekv.video import open_video

        open_video(args.video)  # before the model loads
    quiet_libraries()
    model = args.model or BUILTIN_NAME
    builtin = model == BUILTIN_NAME
    budget = args.budget or (BUILTIN_BUDGET if builtin else OTHER_BUDGET)
    window = args.frames or (BUILTIN_WINDOW if builtin else OTHER_WINDOW)
    synthetic = args.video is None
    video, questions = demo_set() if synthetic else (args.video, [{"question": args.question or DEFAULT_QUESTION}])
    loaded = statekv.VideoQA.from_pretrained(model, method="full", dtype=args.dtype, device=args.device,
                                             trust_remote_code=args.trust_remote_code)
    settings = {"full": "exact", "recency": f"R={window}", "statekv": f"B={budget}"}
    rows = []
    for method, setting in settings.items():
        qa = loaded.with_options(method=method, budget=budget, frames=window)
        with qa.encode(video, max_fps=args.max_fps, max_frames=args.max_frames, progress=interactive()) as encoded:
            for question in questions:
                question.setdefault("answers", {})[method] = encoded.ask(
                    _prompt(question), max_new_tokens=args.max_new_tokens)
            stats = encoded.stats
        rows.append(_row(method, setting, stats, questions))
    if args.json:
        print_json({"model": model, "video": str(video), "builtin": builtin, "rows": rows, "questions": questions})
        return 0
    _print_table(model, str(video), rows, questions, synthetic)
    return 0


def demo_set() -> tuple[Path, list[dict]]:
    """The demo video (video 0 of the held-out set made with `DEMO_SEED`) and its questions (rows of the
    question file), written to the cache folder on first use."""
    from statekv.eval.annotations import read_table
    from statekv.eval.loaders import load_synthetic
    from statekv.synthetic.benchmark import QUESTIONS_FILE, make_benchmark

    folder = _cached(DEMO_SET, lambda path: make_benchmark(path, videos=1, seed=DEMO_SEED))
    load_synthetic(folder)  # every row checked (a damaged cached set is one line, not a wrong table)
    rows = read_table(folder / QUESTIONS_FILE)
    return folder / rows[0]["video"], rows


def _prompt(question: dict) -> str:
    if "options" not in question:
        return question["question"]
    from statekv.synthetic.prompts import question_prompt

    return question_prompt(question["question"], question["options"])


def _row(method: str, setting: str, stats, questions: list[dict]) -> dict:
    from statekv.eval.parsing import ranked_letter

    quarter = max(1, len(stats.frame_seconds) // 4)
    row = {"method": method, "setting": setting, "frames": stats.frames, "tokens": stats.tokens,
           "carried": stats.carried_tokens,
           # medians, so the first frame's one-time warm-up does not dominate the first quarter
           "ms_per_frame_first_quarter": 1e3 * statistics.median(stats.frame_seconds[:quarter]),
           "ms_per_frame_last_quarter": 1e3 * statistics.median(stats.frame_seconds[-quarter:])}
    if "answer" in questions[0]:
        row["correct"] = sum(ranked_letter(q["answers"][method]) == q["answer"] for q in questions)
    return row


def _print_table(model: str, video: str, rows: list[dict], questions: list[dict], synthetic: bool) -> None:
    name = "the built-in InternVL3 (trained on synthetic videos; see docs/accuracy.md)" if model == "builtin" else model
    print(f"model: {name}\nvideo: {video}" + (" (one picture per second, never seen in training)" if synthetic else ""))
    print()
    header = (f"{'method':<8} {'setting':<8} {'frames':>6} {'tokens':>7} {'carried':>8} {'ms/frame, 1st 1/4':>18} "
              f"{'ms/frame, last 1/4':>19}" + ("  correct" if synthetic else ""))
    print(header)
    print("-" * len(header))
    for r in rows:
        line = (f"{r['method']:<8} {r['setting']:<8} {r['frames']:>6} {r['tokens']:>7} {r['carried']:>8} "
                f"{r['ms_per_frame_first_quarter']:>18.1f} {r['ms_per_frame_last_quarter']:>19.1f}")
        print(line + (f"  {r['correct']}/{len(questions)}" if synthetic else ""))
    print("(median wall time per frame over the first and the last quarter of the video)\n")
    methods = [r["method"] for r in rows]
    for q in questions:
        print(q["question"])
        for letter, option in zip("ABCD", q.get("options", ()), strict=False):
            print(f"  {letter}. {option}")
        if synthetic:
            seconds = ", ".join(f"{frame}s" for frame in q["evidence_frames"])
            print(f"  truth: {q['answer']} (seen at {seconds})")
        print("  " + "   ".join(f"{method}: {q['answers'][method]!r}" for method in methods) + "\n")


def _cached(name: str, build) -> Path:
    """``cache_dir() / name``, built once; a half-built item never appears under its name."""
    target = cache_dir() / name
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=target.parent).close()
    except OSError as error:
        raise OutputError(f"cannot write statekv's cache in {target.parent} ({error.strerror or error}); set "
                          "STATEKV_CACHE to a writable folder") from None
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / name
        build(built)
        try:
            built.rename(target)
        except OSError:  # another process got there first
            if not target.exists():
                raise
    return target
