"""A run's ``results.json`` summary and the paper's accuracy table built from several runs."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from statekv.errors import DataError
from statekv.flushing import write_whole
from statekv.eval.parsing import PARSERS
from statekv.settings.methods import MethodSettings, method as method_spec, method_names
from statekv.eval.records import AnswerRecord, merge_rank_files
from statekv.eval.run_settings import with_defaults
from statekv.eval.scoring import score, single_value

SUMMARY_FILE = "results.json"
TABLE_COLUMNS = (("videomme", "VideoMME"), ("mlvu", "MLVU"), ("ovobench", "OVOBench RT"))
# shown only when a run of that benchmark (OVO-Bench: with more groups than real-time) is in the table
EXTRA_COLUMNS = (("ovobench-all", "OVO-Bench"), ("streamingbench", "StreamingBench"), ("synthetic", "Synthetic"))
# a run's settings (its run.json) that make two rows of one model and method: where runs of one model and method
# differ in some of these, each row's label names its values of them
ROW_SETTINGS = ("retrieve", "retrieval", "sinks", "positions", "bounded_layout", "question_span", "kv_cache_dtype",
                "max_cache_bytes", "cache_limit", "steer", "attention", "dtype", "layout", "max_fps")
_METHOD_KINDS = {"full": 0, "fullattention": 0, "fullsa": 0, "recency": 1, "rekv": 1, "statekv": 2,
                 "simplestream": 3}
_OTHER_METHOD = 4
_ALIASES = {"fullattention": "full", "fullsa": "full"}  # the policy class's name, the paper's


def method_label(method: str, size: int | None) -> str:
    """A method's name in tables ("Full SA", "Recency R=16", "StateKV B=4096"), from the method registry; a
    method not registered here shows as "name (size)"."""
    method = _ALIASES.get(method.lower().replace("_", "").replace(" ", ""), method)
    if method not in method_names():
        return method if size is None else f"{method} ({size})"
    spec = method_spec(method)
    if size is None or spec.size is None:
        return spec.display
    return spec.label(replace(MethodSettings(), **{spec.size: size}))


def _method_kind(method: str) -> int:
    return _METHOD_KINDS.get(method.lower().replace("_", "").replace(" ", ""), _OTHER_METHOD)


def build_summary(records: Sequence[AnswerRecord], expected_qids: Sequence[str] | None = None) -> dict[str, Any]:
    """Summary of one run: its settings, its score under the parser it used (``score``) and
    under every parser generation (``scores``), and mean timings per phase."""
    if not records:
        raise ValueError("no answer records to summarize")
    settings = {
        name: single_value(records, name) for name in ("benchmark", "model", "method", "budget", "protocol", "parser")
    }
    # OVOBench scores are the same under both generations (one substring rule); kept for uniformity
    scores = {parser: score([record.rescored(parser) for record in records], expected_qids) for parser in PARSERS}
    timings: dict[str, list[float]] = {}
    for record in records:
        for phase, seconds in record.timings.items():
            timings.setdefault(phase, []).append(seconds)
    return {
        **settings,
        "method_label": method_label(settings["method"], settings["budget"]),
        "score": scores[settings["parser"]].to_json(),
        "scores": {parser: result.to_json() for parser, result in scores.items()},
        "mean_seconds": {phase: sum(values) / len(values) for phase, values in sorted(timings.items())},
    }


def write_summary(
    run_dir: Path | str,
    records: Sequence[AnswerRecord] | None = None,
    expected_qids: Sequence[str] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``<run_dir>/results.json`` (from the merged rank files unless records are given).

    ``extra`` adds top-level entries (e.g. the run's settings) next to the scores."""
    run_dir = Path(run_dir)
    summary = build_summary(merge_rank_files(run_dir) if records is None else records, expected_qids)
    summary.update(extra or {})
    write_whole(run_dir / SUMMARY_FILE, (json.dumps(summary, indent=2, allow_nan=True) + "\n").encode())
    return summary


def read_summary(run_dir: Path | str) -> dict[str, Any]:
    """A run's ``results.json``, checked field by field (what the table reads); a one-line `DataError` naming the
    file and the field otherwise."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no run summary at {path} (run write_summary first)")
    try:
        summary = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, or an integer too long to convert
        raise DataError(f"{path}: damaged results file ({str(error)[:80]}); delete it and run `statekv eval "
                        "table` again to score the answers") from None
    _check_summary(path, summary)
    return summary


def _check_summary(path: Path, summary: Any) -> None:
    def field(container: Any, name: str, kinds: tuple[type, ...], where: str) -> Any:
        value = container.get(name) if isinstance(container, dict) else None
        if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
            raise DataError(f"{path}: damaged results file (field {where}{name!r} is {str(value)[:40]!r})")
        return value

    for name in ("benchmark", "model", "method", "method_label"):
        field(summary, name, (str,), "")
    if summary.get("budget") is not None:
        field(summary, "budget", (int,), "")
    results = [("score", field(summary, "score", (dict,), ""))]
    results += list(field(summary, "scores", (dict,), "").items())
    for name, result in results:
        where = f"{name}." if name == "score" else f"scores.{name}."
        field(result, "headline", (int, float), where)
        field(field(result, "overall", (dict,), where), "unparsable", (int,), where + "overall.")
        for optional in ("missing", "expected"):
            if isinstance(result, dict) and result.get(optional) is not None:
                field(result, optional, (int,), where)


def _recorded(run: Path | str) -> dict[str, Any]:
    """A run's ``run.json`` ({} when it has none, or it cannot be read)."""
    try:
        recorded = json.loads((Path(run) / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def _recorded_settings(run: Path | str) -> dict[str, Any] | None:
    """The settings a run's ``run.json`` records, those it predates taken as their defaults (None when it has none,
    or cannot be read)."""
    settings = _recorded(run).get("settings")
    return with_defaults(settings) if isinstance(settings, dict) else None


def _content(run: Path | str, name: str) -> str | None:
    """A fingerprint a run's ``run.json`` records of what it read (``weights``, ``data``), if any."""
    content = _recorded(run).get("content")
    value = content.get(name) if isinstance(content, dict) else None
    return value if isinstance(value, str) else None


def _model_names(runs: list[tuple[Path | str, dict[str, Any]]]) -> list[str]:
    """Each run's model in the table: its name, with its weights' fingerprint where runs of other weights share
    the name (every `statekv train-builtin` folder's model is named "model")."""
    weights = [_content(run, "weights") for run, _ in runs]
    names = []
    for (_, summary), own in zip(runs, weights):
        kin = {theirs for (_, other), theirs in zip(runs, weights)
               if other["model"] == summary["model"] and theirs is not None}  # a run killed early may record none
        names.append(summary["model"] if len(kin) < 2 else f"{summary['model']} [weights {(own or 'unknown')[:12]}]")
    return names


def _unlike_data(runs: list[tuple[Path | str, dict[str, Any]]]) -> list[str]:
    """Notes for the benchmarks whose runs in the table read different question sets (their ``data``
    fingerprints differ: another seed, a --limit, the streaming set), so their rows are not comparable."""
    sets: dict[str, dict[str, list[str]]] = {}
    for run, summary in runs:
        data = _content(run, "data")
        limit = _recorded(run).get("limit")
        key = f"{data}, limit {limit}" if data is not None else None
        if key is not None:
            sets.setdefault(summary["benchmark"], {}).setdefault(key, []).append(str(run))
    return [f"note: the {benchmark} runs read {len(found)} different question sets ("
            + "; ".join(", ".join(folders) for folders in found.values()) + "): their rows are not comparable"
            for benchmark, found in sets.items() if len(found) > 1]


def _how_they_differ(first: Path | str, second: Path | str) -> str:
    """The settings two runs' ``run.json`` record differently, as "" or "(they differ in mode: offline, streaming)"."""
    a, b = _recorded_settings(first), _recorded_settings(second)
    if a is None or b is None:
        return ""
    differ = [f"{name}: {a.get(name)}, {b.get(name)}" for name in sorted(set(a) | set(b)) if a.get(name) != b.get(name)]
    return f" (they differ in {'; '.join(differ[:3])})" if differ else ""


def _row_labels(runs: list[tuple[Path | str, dict[str, Any]]]) -> list[str]:
    """Each run's method label in the table, ``runs`` being ``(run folder, summary)``: the summary's, with the
    `ROW_SETTINGS` in which the runs of its model and method differ (a run whose ``run.json`` records no settings
    is told apart from them as such)."""
    settings = [_recorded_settings(run) for run, _ in runs]
    labels = []
    for (_, summary), own in zip(runs, settings):
        kin = [other for (_, theirs), other in zip(runs, settings) if other is not None
               and (theirs["model"], theirs["method_label"]) == (summary["model"], summary["method_label"])]
        varying = [name for name in ROW_SETTINGS if len({json.dumps(other.get(name)) for other in kin}) > 1]
        if not varying:
            labels.append(summary["method_label"])
        elif own is None:
            labels.append(f"{summary['method_label']} (settings not recorded)")
        else:
            shown = ", ".join(f"{name} {'default' if own.get(name) is None else own.get(name)}" for name in varying)
            labels.append(f"{summary['method_label']} ({shown})")
    return labels


def paper_table(run_dirs: Iterable[Path | str], parser: str | None = None,
                scored: dict[Path | str, dict[str, Any]] | None = None) -> str:
    """Markdown table like the paper's Table 1: one row per (model, method), and per value of any `ROW_SETTINGS`
    in which runs of one model and method differ (a layout against another, say), one column per benchmark,
    headline accuracies with two decimals (OVOBench RT: the real-time group's score; OVO-Bench, when a run has
    other groups: its overall score).

    ``parser`` picks which parser generation's score to show (default: the one each run used). ``scored``: the
    summaries of runs scored by the caller (`build_summary`), read in place of their ``results.json``.
    A cell notes unparsable answers ("(3 unparsed)") and incomplete runs ("(partial 10/2700)").
    """
    cells: dict[tuple[str, str], dict[str, str]] = {}
    sources: dict[tuple[str, str, str], Path | str] = {}
    row_order: dict[tuple[str, str], tuple] = {}
    models: list[str] = []
    named: dict[Path, Path | str] = {}
    runs = []
    for run_dir in run_dirs:
        real = Path(run_dir).resolve()
        if real in named:
            raise DataError(f"the run {run_dir} is named twice (also as {named[real]}); name each run once")
        named[real] = run_dir
        runs.append((run_dir, (scored or {}).get(run_dir) or read_summary(run_dir)))
    for (run_dir, summary), label, model in zip(runs, _row_labels(runs), _model_names(runs)):
        benchmark = summary["benchmark"]
        chosen = summary["scores"].get(parser) if parser else summary["score"]
        if chosen is None:
            raise DataError(f"{run_dir}: no score for parser {parser!r}")
        row = (model, label)
        key = (model, row[1], benchmark)
        if key in sources:
            raise DataError(f"two runs give {model} / {row[1]} on {benchmark}: {sources[key]} and {run_dir}"
                            f"{_how_they_differ(sources[key], run_dir)}; the table takes one of each")
        sources[key] = run_dir
        if model not in models:
            models.append(model)
        row_order[row] = (models.index(model), _method_kind(summary["method"]), summary["budget"] or 0, row[1])
        if benchmark == "ovobench":
            group_scores = chosen.get("group_scores") or {"realtime": chosen["headline"]}  # written before groups
            if "realtime" in group_scores:
                cells.setdefault(row, {})["ovobench"] = _cell(chosen, group_scores["realtime"], group="realtime")
            if set(group_scores) - {"realtime"}:
                cells.setdefault(row, {})["ovobench-all"] = _cell(chosen)
        else:
            cells.setdefault(row, {})[benchmark] = _cell(chosen)
    present = {column for row in cells.values() for column in row}
    columns = TABLE_COLUMNS + tuple(column for column in EXTRA_COLUMNS if column[0] in present)
    header = "| Model | Method | " + " | ".join(title for _, title in columns) + " |"
    lines = [header, "|" + "---|" * (2 + len(columns))]
    for row in sorted(cells, key=row_order.__getitem__):
        values = [cells[row].get(benchmark, "–") for benchmark, _ in columns]
        lines.append(f"| {row[0]} | {row[1]} | " + " | ".join(values) + " |")
    notes = _unlike_data(runs)
    return "\n".join(lines) + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")


def _cell(result: dict[str, Any], headline: float | None = None, group: str | None = None) -> str:
    """A score with its unparsed answers (of ``group`` when the cell is one group's) and, when the run is
    partial, how many of its questions it answered (the whole run's: results do not split them by group)."""
    headline = result["headline"] if headline is None else headline
    text = "nan" if math.isnan(headline) else f"{headline:.2f}"
    tally = (result.get("groups") or {}).get("group", {}).get(group) if group else None
    unparsable = (tally or result["overall"])["unparsable"]
    if unparsable:
        text += f" ({unparsable} unparsed)"
    if result.get("missing"):
        run = " of the run" if group else ""
        text += f" (partial{run} {result['expected'] - result['missing']}/{result['expected']})"
    return text
