"""Benchmark scores from answer records, the way each benchmark defines its headline number.

- VideoMME: micro accuracy over all questions; breakdowns by duration, domain, sub-category
  and task type.
- MLVU: M-avg, the unweighted mean of the seven per-task accuracies.
- OVOBench real-time: the unweighted mean of the six subtask accuracies.
- Synthetic (`statekv.synthetic`): micro accuracy over all questions; breakdown by question family.

Every score carries question counts and how many answers the parser could not read. Accuracies
are percentages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from statekv.eval.questions import MLVU_TASKS, OVOBENCH_REALTIME_TASKS
from statekv.eval.records import AnswerRecord

HEADLINE_METRIC = {
    "videomme": "micro accuracy",
    "mlvu": "M-avg (mean of the 7 task accuracies)",
    "ovobench": "mean of the 6 real-time subtask accuracies",
    "synthetic": "micro accuracy",
}
BREAKDOWNS = {
    "videomme": ("duration", "domain", "sub_category", "task_type"),
    "mlvu": ("task_type",),
    "ovobench": ("task_type",),
    "synthetic": ("task_type",),
}
EXPECTED_GROUPS = {"mlvu": MLVU_TASKS, "ovobench": OVOBENCH_REALTIME_TASKS}


@dataclass(frozen=True)
class Tally:
    questions: int
    correct: int
    unparsable: int

    @property
    def accuracy(self) -> float:
        return 100.0 * self.correct / self.questions if self.questions else float("nan")

    def to_json(self) -> dict:
        return {**asdict(self), "accuracy": self.accuracy}


@dataclass(frozen=True)
class BenchmarkScore:
    """``headline`` is the number the paper reports (see ``metric``); ``overall`` the micro tally.

    ``groups[breakdown][value]`` tallies each category (e.g. ``groups["duration"]["long"]``).
    ``missing_tasks`` lists MLVU/OVOBench tasks with no answers; the headline then averages
    only the tasks present. ``expected``/``missing`` count questions of the benchmark not (yet)
    answered, when the full question list was given.
    """

    benchmark: str
    parser: str
    metric: str
    headline: float
    overall: Tally
    groups: dict[str, dict[str, Tally]]
    missing_tasks: tuple[str, ...] = ()
    expected: int | None = None
    missing: int | None = None

    def to_json(self) -> dict:
        return {
            "benchmark": self.benchmark,
            "parser": self.parser,
            "metric": self.metric,
            "headline": self.headline,
            "overall": self.overall.to_json(),
            "groups": {
                name: {key: tally.to_json() for key, tally in group.items()} for name, group in self.groups.items()
            },
            "missing_tasks": list(self.missing_tasks),
            "expected": self.expected,
            "missing": self.missing,
        }


def score(records: Iterable[AnswerRecord], expected_qids: Sequence[str] | None = None) -> BenchmarkScore:
    """Score one benchmark's records (all read with the same parser)."""
    records = list(records)
    if not records:
        raise ValueError("no answer records to score")
    benchmark = single_value(records, "benchmark")
    if benchmark not in BREAKDOWNS:
        raise ValueError(f"unknown benchmark {benchmark!r} in answer records")
    parser = single_value(records, "parser")
    if len({record.qid for record in records}) != len(records):
        raise ValueError("records repeat a question id; deduplicate with latest_per_question first")
    overall = _tally(records)
    groups = {name: _tally_by(records, name) for name in BREAKDOWNS[benchmark]}
    missing_tasks: tuple[str, ...] = ()
    if benchmark in ("videomme", "synthetic"):
        headline = overall.accuracy
    else:
        tasks = groups["task_type"]
        missing_tasks = tuple(task for task in EXPECTED_GROUPS[benchmark] if task not in tasks)
        headline = sum(tally.accuracy for tally in tasks.values()) / len(tasks)
    expected = missing = None
    if expected_qids is not None:
        expected_set = set(expected_qids)
        expected, missing = len(expected_set), len(expected_set - {record.qid for record in records})
    return BenchmarkScore(
        benchmark=benchmark,
        parser=parser,
        metric=HEADLINE_METRIC[benchmark],
        headline=headline,
        overall=overall,
        groups=groups,
        missing_tasks=missing_tasks,
        expected=expected,
        missing=missing,
    )


def _tally(records: Sequence[AnswerRecord]) -> Tally:
    return Tally(
        questions=len(records),
        correct=sum(record.correct for record in records),
        unparsable=sum(record.parsed is None for record in records),
    )


def _tally_by(records: Sequence[AnswerRecord], attribute: str) -> dict[str, Tally]:
    buckets: dict[str, list[AnswerRecord]] = defaultdict(list)
    for record in records:
        buckets[getattr(record, attribute)].append(record)
    return {key: _tally(buckets[key]) for key in sorted(buckets)}


def single_value(records: Sequence[AnswerRecord], attribute: str):
    """The value of ``attribute`` shared by all records (an error if they differ)."""
    values = {getattr(record, attribute) for record in records}
    if len(values) != 1:
        raise ValueError(f"records mix several {attribute} values: {', '.join(sorted(map(str, values)))}")
    return values.pop()
