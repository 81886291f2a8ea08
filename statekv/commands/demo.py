"""``statekv demo``: a video through a VLM under full attention, recency and StateKV, offline by default.

Without ``--model`` it builds, on first use, a tiny random InternVL checkpoint (real architecture, random
weights) and renders a synthetic video, both kept in the cache folder; it then encodes the video under the
three methods and prints frames, tokens, carried size and per-frame time. Random weights make the answers
meaningless: the demo shows the mechanics and the cost. With ``--model`` (and ``--video``) the same command
is a real run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from ..user_cache import cache_dir  # where the demo keeps its checkpoint and video
from ..console import add_output_arguments, interactive, print_json, quiet_libraries
from ..values import POSITIVE_FLOAT, POSITIVE_INT


DEMO_CHECKPOINT = "demo-internvl-v1"
DEMO_VIDEO = "demo-video-v1.mp4"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="encode a video under all three methods (offline tiny model by default)",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--model", default=None, metavar="M",
                        help="a real checkpoint instead of the built-in tiny random one")
    parser.add_argument("--video", default=None, help="a video instead of the built-in synthetic one")
    parser.add_argument("--question", default="What happens in this video?", help="the question to answer")
    parser.add_argument("--budget", type=POSITIVE_INT, default=256, metavar="B",
                        help="StateKV budget in tokens (default: 256)")
    parser.add_argument("--frames", type=POSITIVE_INT, default=4, metavar="R",
                        help="recency window in frames (default: 4)")
    parser.add_argument("--max-fps", type=POSITIVE_FLOAT, default=1.0, metavar="F", help="(default: 1)")
    parser.add_argument("--max-frames", type=POSITIVE_INT, default=64, metavar="N", help="(default: 64)")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    parser.add_argument("--device", default=None, help="default: cuda if available")
    parser.add_argument("--trust-remote-code", action="store_true")
    add_output_arguments(parser)
    parser.set_defaults(run=run, max_new_tokens=16)


def run(args: argparse.Namespace) -> int:
    import statekv

    statekv.ModelOptions(dtype=args.dtype, device=args.device)  # checked before the built-in model is made
    quiet_libraries()
    model = args.model or str(demo_checkpoint())
    video = args.video or str(demo_video())
    loaded = statekv.VideoQA.from_pretrained(model, method="full", dtype=args.dtype, device=args.device,
                                             trust_remote_code=args.trust_remote_code)
    settings = {"full": "exact", "recency": f"R={args.frames}", "statekv": f"B={args.budget}"}
    rows = []
    for method, setting in settings.items():
        qa = loaded.with_options(method=method, budget=args.budget, frames=args.frames)
        with qa.encode(video, max_fps=args.max_fps, max_frames=args.max_frames, progress=interactive()) as encoded:
            answer = encoded.ask(args.question, max_new_tokens=args.max_new_tokens)
            stats = encoded.stats
        quarter = max(1, len(stats.frame_seconds) // 4)
        rows.append({"method": method, "setting": setting, "frames": stats.frames, "tokens": stats.tokens,
                     "carried": stats.carried_tokens,
                     # medians, so the first frame's one-time warm-up does not dominate the first quarter
                     "ms_per_frame_first_quarter": 1e3 * statistics.median(stats.frame_seconds[:quarter]),
                     "ms_per_frame_last_quarter": 1e3 * statistics.median(stats.frame_seconds[-quarter:]),
                     "answer": answer})
    if args.json:
        print_json({"model": model, "video": video, "random_weights": args.model is None, "rows": rows})
        return 0
    _print_table(model if args.model else "a tiny random InternVL (built-in)", video, rows)
    if args.model is None:
        print("\nThe built-in model has random weights, so its answers are meaningless; the table shows the "
              "mechanics and the cost. Run with --model OpenGVLab/InternVL3-1B-hf --video your.mp4 for real answers.")
    return 0


def _print_table(model: str, video: str, rows: list[dict]) -> None:
    print(f"model: {model}\nvideo: {video}\n")
    header = (f"{'method':<8} {'setting':<8} {'frames':>6} {'tokens':>7} {'carried':>8} {'ms/frame, 1st 1/4':>18} "
              f"{'ms/frame, last 1/4':>19}  answer")
    print(header)
    print("-" * len(header))
    for r in rows:
        answer = r["answer"] if len(r["answer"]) <= 32 else r["answer"][:31] + "…"
        print(f"{r['method']:<8} {r['setting']:<8} {r['frames']:>6} {r['tokens']:>7} {r['carried']:>8} "
              f"{r['ms_per_frame_first_quarter']:>18.1f} {r['ms_per_frame_last_quarter']:>19.1f}  {answer!r}")
    print("(median wall time per frame over the first and the last quarter of the video)")


def demo_checkpoint() -> Path:
    """The built-in tiny InternVL checkpoint (64 visual tokens per frame), created on first use."""
    from ..tiny import make_tiny_checkpoint

    return _cached(DEMO_CHECKPOINT, lambda path: make_tiny_checkpoint(
        "internvl", path, vision_config={"image_size": 224},
        text_config={"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2}))


def demo_video() -> Path:
    """The built-in synthetic video: 64 s at 4 fps (64 frames at the default 1 fps)."""
    from ..tiny import write_test_video

    return _cached(DEMO_VIDEO, lambda path: write_test_video(path, frames=256, fps=4, size=(224, 224)))


def _cached(name: str, build) -> Path:
    """``cache_dir() / name``, built once; a half-built item never appears under its name."""
    target = cache_dir() / name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / name
        build(built)
        try:
            built.rename(target)
        except OSError:  # another process got there first
            if not target.exists():
                raise
    return target
