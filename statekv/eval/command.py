"""``statekv eval``: run VideoMME, MLVU, OVO-Bench, StreamingBench or the synthetic set for one model and method,
streaming or offline; merge runs into a table.

    statekv eval videomme --model OpenGVLab/InternVL3-1B-hf --method statekv --budget 4096 \\
        --data-root data --out runs/videomme/internvl3-1b-statekv
    statekv eval ovobench --mode streaming --model Qwen/Qwen3-VL-8B-Instruct --method simplestream ...
    statekv eval synthetic --model builtin --method full --data-root data/synthetic --out runs/synthetic/full
    torchrun --nproc-per-node 8 -m statekv.eval.command videomme ...     # data parallel, one GPU per rank
    statekv eval table runs/*/*                                          # the paper's Table 1 from many runs
"""

from __future__ import annotations

import argparse
import logging
import sys

from statekv.settings.values import PATH

FAILED_RECORDS = 1  # exit status of a run that finished with questions left unanswered (unreadable videos)
PARSERS = ("lmms-eval-0.7", "paper")  # parser and protocol generations (statekv.eval.parsing / prompts)
BENCHMARK_HELP = {
    "videomme": "VideoMME without subtitles (2,700 questions, 900 videos)",
    "mlvu": "MLVU dev, the seven multiple-choice tasks",
    "ovobench": "OVO-Bench: backward tracing, real-time visual perception, forward active responding",
    "streamingbench": "StreamingBench: real-time visual understanding and the contextual tasks (no audio)",
    "synthetic": "a synthetic long-video set written by `statekv synthetic make` (--data-root: its folder)",
}
GROUP_NAMES = {"ovobench": "backward, realtime, forward", "streamingbench": "realtime, contextual"}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand to the ``statekv`` parser."""
    parser = subparsers.add_parser(
        "eval", help="evaluate on VideoMME / MLVU / OVO-Bench / StreamingBench / the synthetic set, or merge runs "
                     "into a table",
        description="Evaluate a video VLM under any method (full attention, recency, ReKV, StateKV, SimpleStream) "
                    "with the benchmarks' protocols, streaming or offline, resumably and data-parallel; or merge run "
                    "directories into a table.",
    )
    benchmarks = parser.add_subparsers(dest="eval_command", required=True, metavar="BENCHMARK|table")
    for benchmark, help_text in BENCHMARK_HELP.items():
        _add_benchmark_parser(benchmarks, benchmark, help_text)
    table = benchmarks.add_parser("table", help="merge run directories into the paper's table (markdown)",
                                  description="Print the paper's Table 1 layout (model x method rows, benchmark "
                                              "columns) from run directories.")
    table.add_argument("runs", nargs="+", type=PATH, metavar="OUT_DIR", help="run directories (their --out)")
    table.add_argument("--parser", choices=PARSERS,
                       help="show scores under this parser generation (default: the one each run used)")
    table.add_argument("--output", type=PATH, help="also write the table to this file")
    table.set_defaults(run=run_table)


def _add_benchmark_parser(benchmarks: argparse._SubParsersAction, benchmark: str, help_text: str) -> None:
    from statekv.console import add_sampling_arguments
    from statekv.settings.options import ModelOptions
    from statekv.settings.values import POSITIVE_INT

    parser = benchmarks.add_parser(benchmark, help=help_text, description=f"Evaluate on {help_text}.")
    parser.add_argument("--data-root", required=True, type=PATH, help="folder holding the benchmark's layout")
    parser.add_argument("--out", type=PATH, help="run directory (rerun the command to resume); required but with "
                                                 "--check")
    parser.add_argument("--check", action="store_true",
                        help="check the data and stop: read every annotation row and every video's header (no "
                             "frames, no model) and print per group the questions, the videos found, missing and "
                             "undecodable, and the frames a run would encode; exit 0 when every row parses, 2 "
                             "naming the first bad row")
    parser.add_argument("--limit", type=POSITIVE_INT, metavar="N",
                        help="only the first N questions, each with all its polls (a resume scores the first N of "
                             "this run)")
    parser.add_argument("--overwrite", action="store_true",
                        help="answer every question again, replacing the answers --out holds (a resume with "
                             "other settings, data, answer key or weights is refused without it)")
    parser.add_argument("--parser", choices=PARSERS, default=PARSERS[0],
                        help="answer parser generation (default lmms-eval-0.7; results.json holds both)")
    parser.add_argument("--protocol", choices=PARSERS, default=PARSERS[0],
                        help="prompts and generation settings (paper: VideoMME without the 0.7 post-prompt and "
                             "up to 1024 new tokens; MLVU and OVOBench are the same under both)")
    default = "streaming" if benchmark in ("ovobench", "streamingbench") else "offline"
    parser.add_argument("--mode", choices=("streaming", "offline"), default=None,
                        help=f"streaming: one live stream per video, each question asked at its time having seen "
                             f"only the frames up to then, the video's questions in time order on the same stream; "
                             f"offline: each question answered from an encoding made for it (VideoMME, MLVU: of "
                             f"the whole video{'; OVO-Bench: the released clips' if benchmark == 'ovobench' else ''}"
                             f") (default: {default})")
    if benchmark in GROUP_NAMES:
        parser.add_argument("--groups", type=_groups, metavar="G,G",
                            help=f"only these groups ({GROUP_NAMES[benchmark]}; default: all)")
    if benchmark == "ovobench":
        parser.add_argument("--videos", choices=("stream", "clips"), default=None,
                            help="the same as --mode: stream = streaming (one live stream per source video, each "
                                 "question asked when it reaches ceil(realtime)), clips = offline (the released "
                                 "per-question clips, as lmms-eval)")
    elif benchmark not in ("synthetic", "streamingbench"):
        parser.add_argument("--from-hub", action="store_true",
                            help="read the annotations with the datasets library (videos still from --data-root)")
    model = ModelOptions.add_arguments(parser, reserve=False, model_required=False,
                                       device_help="default: cuda:LOCAL_RANK when CUDA is available, else cpu; "
                                                   "--model is required but with --check")
    model.add_argument("--name", help="the model's name in tables (default: from --model, e.g. InternVL3-1B)")
    add_sampling_arguments(parser, every_frame="the set's videos are the model's own test videos"
                           if benchmark == "synthetic" else None)
    parser.add_argument("--max-new-tokens", type=POSITIVE_INT, metavar="K",
                        help="override the protocol's answer length (smoke tests only: it changes the protocol)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or progress log lines")
    parser.set_defaults(run=run_benchmark, benchmark=benchmark)


def run_benchmark(args: argparse.Namespace) -> int:
    from statekv.console import quiet_libraries
    from statekv.errors import ConfigurationError
    from statekv.settings.options import ModelOptions
    from statekv.eval.distributed import RankContext
    from statekv.eval.runner import EvalConfig, run_evaluation

    context = RankContext.from_env()
    _configure_logging(context.rank if context.distributed else None)
    if args.check:
        from statekv.eval.check import check_command

        return check_command(args)
    missing = [flag for flag, value in (("--model", args.model), ("--out", args.out)) if value is None]
    if missing:
        raise ConfigurationError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (all but "
                                 "--data-root may be left out with --check)")
    quiet_libraries()
    options = ModelOptions.from_args(args, all_used=True)
    config = EvalConfig(
        benchmark=args.benchmark, options=options, data_root=args.data_root, out=args.out,
        name=args.name, parser=args.parser, protocol=args.protocol, limit=args.limit, max_fps=args.max_fps,
        max_frames=args.max_frames, ovobench_videos=getattr(args, "videos", None), mode=args.mode,
        groups=getattr(args, "groups", None),
        from_hub=getattr(args, "from_hub", False), max_new_tokens=args.max_new_tokens, progress=not args.no_progress,
        overwrite=args.overwrite,
    )
    uncapped = uncapped_warning(args.max_frames, config)
    if uncapped and context.rank == 0:
        print(f"statekv eval: warning: {uncapped}", file=sys.stderr, flush=True)
    summary = run_evaluation(config, context=context)
    if summary is None:  # not rank 0
        return 0
    score = summary["score"]
    answered = score["overall"]["questions"]
    given = answered if score.get("expected") is None else score["expected"] - score["missing"]
    answers = " answers" if given != answered else ""  # a forward question asked at each of its polls
    line = f"{summary['model']} {summary['method_label']} on {config.benchmark}: {score['headline']:.2f} " \
           f"({score['metric']}, parser {score['parser']}; {answered} question{'s' * (answered != 1)} answered" + \
           (f" ({given} answers: a forward question is answered at each of its polls)" if answers else "")
    if score.get("missing"):
        line += f", {score['missing']} of {score['expected']}{answers} missing"
    print(line + f", {score['overall']['unparsable']} unparsable{answers})")
    if score.get("group_scores"):
        groups = ", ".join(f"{group} {value:.2f}" for group, value in score["group_scores"].items())
        official = f"; the release's own scoring: {score['official']:.2f}" if score.get("official") is not None else ""
        print(f"groups: {groups}{official}")
    families = (score.get("groups") or {}).get("task_type") if config.benchmark == "synthetic" else None
    line = _families_line(families) if families and not score.get("group_scores") else None
    if line:
        print(line)
    print(f"wrote {config.out / 'results.json'} and {config.out / 'table.md'}", flush=True)
    errors = summary.get("errors") or []
    if errors:  # the scores above are partial: say so, and end non-zero so no script takes them as complete
        unanswered = len({qid for entry in errors for qid in entry["qids"]})
        print(f"statekv eval: {unanswered} question(s) unanswered: {len(errors)} video(s) could not be read "
              f"(errors logged in {config.out}/errors.rank*.jsonl); rerun the same command to retry them",
              file=sys.stderr, flush=True)
        return FAILED_RECORDS
    return 0


def uncapped_warning(max_frames: int | None, config) -> str | None:
    """What to warn of a ``--max-frames`` the run ignores (a run that reads each question's frames up to its time:
    a stream, or StreamingBench's offline mode, a stream made for each question); None where it caps, or where it is
    the benchmark's default (the paper's cap, typed for every benchmark alike, is no surprise)."""
    from statekv.eval.runner import default_max_frames

    if max_frames in (None, default_max_frames(config.benchmark)):
        return None
    if config.mode == "streaming":
        return f"--max-frames {max_frames} does not cap a stream, which reads each question's frames up to its time"
    if config.benchmark == "streamingbench":
        return (f"--max-frames {max_frames} does not cap StreamingBench's offline mode, which reads each question's "
                "frames up to its time")
    return None


def _families_line(families: dict[str, dict]) -> str | None:
    """A synthetic run's accuracy per question family, and over those answered from one or two frames (the target
    families of docs/accuracy.md) when it asked several of them; None when it asked no known family."""
    from statekv.synthetic.tasks import FAMILIES, FEW_FRAME_FAMILIES

    shown = ", ".join(f"{name} {families[name]['accuracy']:.2f}" for name in FAMILIES if name in families)
    few = [name for name in FEW_FRAME_FAMILIES if name in families]
    if len(few) < 2:
        return f"families: {shown}" if shown else None
    correct, asked = (sum(families[name][field] for name in few) for field in ("correct", "questions"))
    together = ", ".join(few[:-1]) + f" and {few[-1]}"
    return f"families: {shown}; {together} together: {100 * correct / asked:.2f} ({correct} of {asked})"


def _groups(text: str) -> tuple[str, ...]:
    groups = tuple(part.strip() for part in text.split(",") if part.strip())
    if not groups:
        raise argparse.ArgumentTypeError(f"expected group names separated by commas, got {text!r}")
    return groups


def run_table(args: argparse.Namespace) -> int:
    from statekv.errors import MissingFileError, OutputError
    from statekv.eval.records import completed_qids, run_records
    from statekv.flushing import write_whole
    from statekv.eval.report import SUMMARY_FILE, build_summary, paper_table, read_summary
    from statekv.eval.runner import read_expected_qids
    from statekv.settings.values import check_output_file

    if args.output:
        check_output_file(args.output, "--output")
        _check_outside_runs(args.output, args.runs)
    scored = {}
    for run_dir in args.runs:
        if not run_dir.is_dir():
            raise MissingFileError(f"no run directory {run_dir}")
        # still running, or killed: score what is there now, here (a finished run's summary names its settings,
        # "run"); nothing is written in the run's folder, which may be read-only or another process's
        if not (run_dir / SUMMARY_FILE).is_file() or "run" not in read_summary(run_dir):
            if not completed_qids(run_dir):
                raise MissingFileError(f"{run_dir} holds no answers yet")
            expected = read_expected_qids(run_dir)
            asked = None if expected is None else set(expected)
            # a resume with a smaller --limit leaves answers the run no longer asks: scored as its finish scores
            records = [record for record in run_records(run_dir) if asked is None or record.qid in asked]
            if not records:
                raise MissingFileError(f"{run_dir} holds no answers to the questions it asks yet")
            scored[run_dir] = build_summary(records, expected)
    table = paper_table(args.runs, parser=args.parser, scored=scored)
    print(table, end="")
    if args.output:
        try:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            write_whole(args.output, table.encode())
        except OSError as error:
            raise OutputError(f"cannot write --output {args.output}: {error.strerror or error}") from None
    return 0


def _check_outside_runs(output, runs) -> None:
    """Refuse a table ``output`` written into one of the ``runs``' folders, where it would replace the run's own
    files (its answers, its ``run.json``) or be replaced by them."""
    from statekv.errors import OutputError

    folder = output.resolve().parent
    for run_dir in runs:
        if run_dir.resolve() == folder:
            raise OutputError(f"--output {output} is in the run folder {run_dir}, which holds the run's own files; "
                              "write the table elsewhere")


def _configure_logging(rank: int | None) -> None:
    """INFO lines on stderr, each naming its rank in a run of several processes."""
    prefix = "" if rank is None else f"[rank {rank}] "
    logging.basicConfig(level=logging.INFO, format=f"{prefix}%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """A parser with only ``eval`` (what ``python -m statekv.eval.command`` runs)."""
    parser = argparse.ArgumentParser(prog="statekv")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m statekv.eval.command BENCHMARK ...``: the same as ``statekv eval BENCHMARK ...``, for
    launchers that start a module (``torchrun -m``, ``accelerate launch -m``)."""
    from statekv.console import run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(["eval", *argv])
    return run_command("eval", lambda: args.run(args))


if __name__ == "__main__":
    sys.exit(main())
