"""``statekv analyze``: measure the attention structure StateKV relies on, on any supported video VLM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from statekv.console import ProgressLine, quiet_libraries
from statekv.errors import OutputError
from statekv.settings.values import (PATH, PATH_TEXT, POSITIVE_FLOAT, POSITIVE_INT, check_device, check_output_dir,
                                     check_output_file)
from statekv.stopping import note_kept, stop_point


DEFAULT_BUDGETS = [1, 4, 16, 64, 256, 1024, 4096, 16384]
DEFAULT_WINDOWS = [1, 4, 16, 64]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``analyze`` subcommand to the ``statekv`` parser."""
    parser = subparsers.add_parser(
        "analyze", help="attention-structure analysis of a model on videos (paper appendix A), with plots",
        description="Stream videos frame by frame under exact full attention and measure, per layer: the "
                    "concentration of historical attention C(B), the oracle state's recall, retention and churn, "
                    "recency vs attention-based selection, where historical mass lands by frame distance, and the "
                    "error StateKV and recency actually incur against full attention. Writes analysis.json, "
                    "analysis.md (side by side with the paper) and analysis_*.png into --out.",
    )
    parser.add_argument("videos", nargs="+", metavar="VIDEO", help="video files or folders of frames")
    parser.add_argument("--model", required=True, type=PATH_TEXT,
                        help="checkpoint folder or hub id of a supported video VLM")
    parser.add_argument("--out", required=True, type=PATH, help="output folder")
    parser.add_argument("--frames", type=POSITIVE_INT, default=128, help="frames sampled per video (default 128, the paper's)")
    parser.add_argument("--max-fps", type=POSITIVE_FLOAT, default=1.0, help="at most this many frames per second (default 1)")
    parser.add_argument("--budgets", nargs="+", type=POSITIVE_INT, default=DEFAULT_BUDGETS, metavar="B",
                        help=f"token budgets (default {' '.join(map(str, DEFAULT_BUDGETS))})")
    parser.add_argument("--recency", nargs="+", type=POSITIVE_INT, default=DEFAULT_WINDOWS, metavar="R",
                        help="recency windows in streaming steps: frames, or 2-frame temporal patches for Qwen3-VL "
                             f"(default {' '.join(map(str, DEFAULT_WINDOWS))})")
    parser.add_argument("--max-distance", type=POSITIVE_INT, default=128,
                        help="frame distances shown apart in the distance heatmap; farther ones share a column "
                             "(at most --frames: no two frames sampled are farther apart)")
    parser.add_argument("--per-head", action="store_true", help="also report every statistic per KV head")
    parser.add_argument("--error-budgets", nargs="*", type=POSITIVE_INT, metavar="B",
                        help="StateKV budgets for the approximation error (default: --budgets; none: skip)")
    parser.add_argument("--error-recency", nargs="*", type=POSITIVE_INT, metavar="R",
                        help="recency windows for the approximation error (default: --recency; none: skip)")
    parser.add_argument("--no-errors", action="store_true", help="skip the approximation-error runs")
    parser.add_argument("--label", default="", help="title of the report (default: the model's folder name)")
    parser.add_argument("--note", default="", help="a line quoted at the top of the markdown summary")
    parser.add_argument("--layout", help="the family's prompt layout (default: the paper's)")
    parser.add_argument("--dtype", default="auto", help="model dtype: auto (the checkpoint's), bfloat16, float32...")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--attention", default="auto", choices=("auto", "eager", "chunked", "triton"),
                        help="scoring backend of the full-attention run (default auto)")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow checkpoints with their own code")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from statekv.builtin import resolve_model
    from statekv.core import Recency, StateKV
    from statekv.models import load_adapter
    from statekv.api.videoqa import resolve_dtype
    from statekv.video import open_video

    from . import plots, report
    from .accumulator import AnalysisSettings, AttentionStatistics, positive_integers
    from .runner import ApproximationErrors, measure_attention, stream_tokens
    from .video import video_steps

    check_output_dir(args.out, "--out")  # before the model loads, not after the whole analysis
    for name in ("analysis.json", "analysis.md", *(f"analysis_{figure}.png" for figure in plots.FIGURES)):
        check_output_file(args.out / name, "--out")  # a folder of that name in it, say
    if args.device is not None:
        check_device(args.device, "--device")
    resolve_dtype(args.dtype)

    settings = AnalysisSettings(budgets=tuple(args.budgets), windows=tuple(args.recency),
                                max_distance=min(args.max_distance, args.frames),  # none are farther apart
                                per_head=args.per_head)
    policies = []
    if not args.no_errors:
        error_budgets = positive_integers("error budgets", args.budgets if args.error_budgets is None
                                          else args.error_budgets)
        error_windows = positive_integers("error recency windows", args.recency if args.error_recency is None
                                          else args.error_recency)
        policies = [StateKV(budget=b) for b in error_budgets] + [Recency(frames=r) for r in error_windows]
    for video in args.videos:
        open_video(video)  # a missing or unreadable video fails here, before the model loads

    quiet_libraries()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    checkpoint, layout = resolve_model(args.model, args.layout)
    adapter = load_adapter(checkpoint, layout=layout, dtype=resolve_dtype(args.dtype), device=device,
                           trust_remote_code=args.trust_remote_code)
    statistics = AttentionStatistics(adapter.model.config.get_text_config().num_hidden_layers, settings)
    errors = ApproximationErrors(adapter.model, policies, attention=args.attention) if policies else None
    tokens, label = [], args.label or Path(str(args.model).rstrip("/")).name
    finished = None  # what the videos measured whole so far come to: a stop keeps it
    try:
        for index, video in enumerate(args.videos, 1):
            steps = video_steps(adapter, video, max_frames=args.frames, max_fps=args.max_fps)
            tokens.append(stream_tokens(steps))
            where = f"[{index}/{len(args.videos)}] {video}: "
            _progress(f"{where}{len(steps)} steps, {tokens[-1]} tokens; full attention")
            line = ProgressLine(f"{where}full attention, ")
            measure_attention(adapter.model, steps, statistics, attention=args.attention,
                              on_step=lambda done, planned: line(done, planned, "steps"))
            if errors is not None:
                _progress(f"{where}{len(policies)} approximation runs")
                line = ProgressLine(f"{where}approximation runs (full attention, then each), ")
                errors.measure(steps, on_step=lambda done, planned: line(done, planned, "steps"))
            del steps
            if index < len(args.videos):
                finished = (statistics.result(), errors.result() if errors else None, index)
                stop_point()  # a Ctrl-C a library swallowed while the video was measured
    except (KeyboardInterrupt, Exception) as stop:  # an error midway (a video found unreadable) stops it as Ctrl-C
        if finished is not None:
            measured, approximated, count = finished
            note = f"stopped after {count} of {len(args.videos)} videos" + (f"; {args.note}" if args.note else "")
            document = report.build_report(measured, approximated, model=str(args.model),
                                           videos=[str(v) for v in args.videos[:count]], tokens=tokens[:count],
                                           label=label, note=note)
            written = [report.write_json(document, args.out / "analysis.json"),
                       report.write_text(report.markdown_summary(document, figures=[]), args.out / "analysis.md")]
            _remove_figures(args.out)
            what = "stop" if isinstance(stop, KeyboardInterrupt) else "error below"
            _progress(f"statekv analyze: the {count} video(s) measured whole before the {what} are in "
                      f"{written[0]} and {written[1]} (no figures)")
        elif isinstance(stop, KeyboardInterrupt):
            earlier = (" (the analysis in it is an earlier run's)" if (args.out / "analysis.json").exists()
                       else "")
            note_kept(stop, f"no video was measured whole, so nothing was written to {args.out}{earlier}")
        raise

    document = report.build_report(statistics.result(), errors.result() if errors else None, model=str(args.model),
                                   videos=[str(v) for v in args.videos], tokens=tokens, label=label, note=args.note)
    document["figures"] = plots.figure_names(document)
    summary = report.markdown_summary(document, figures=document["figures"])
    # the measurements first, each file whole: figures that cannot be written (a full disk) lose none of them
    json_path = report.write_json(document, args.out / "analysis.json")
    markdown_path = report.write_text(summary, args.out / "analysis.md")
    _remove_figures(args.out)  # all: a figure this run fails to write is not left as an earlier run's
    try:
        figures = plots.plot_all(document, args.out)
    except OutputError as error:
        raise OutputError(f"{error}; {json_path.name} and {markdown_path.name} hold the analysis") from None
    except KeyboardInterrupt as stop:  # the report then names no figure, as none may have been drawn whole
        _remove_figures(args.out)
        document["figures"] = []
        report.write_json(document, json_path)
        report.write_text(report.markdown_summary(document, figures=[]), markdown_path)
        note_kept(stop, f"{json_path} and {markdown_path} hold the analysis of every video (no figures)")
        raise
    print(summary)
    for path in (json_path, markdown_path, *figures):
        print(f"wrote {path}")
    return 0


def _remove_figures(out: Path) -> None:
    """Remove an earlier run's figures: they would not be this report's."""
    from .plots import FIGURES

    for figure in FIGURES:
        (out / f"analysis_{figure}.png").unlink(missing_ok=True)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
