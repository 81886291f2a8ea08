"""Benchmark scores from answer records, the way each benchmark defines its headline number.

- VideoMME: micro accuracy over all questions; breakdowns by duration, domain, sub-category
  and task type.
- MLVU: M-avg, the unweighted mean of the seven per-task accuracies.
- OVO-Bench: the mean of its groups' scores (backward, real-time, forward; those answered), a group's score
  being the unweighted mean of its tasks' accuracies and a forward question's score the mean of its polls
  (real-time alone: the mean of the six subtasks, the paper's Table 1 column). ``official`` is the score the
  release's own code gives (`statekv.eval.ovobench.official_score`).
- StreamingBench: micro accuracy over the questions of the groups taken (real-time, contextual), each group's
  too.
- Synthetic (`statekv.synthetic`): micro accuracy over all questions; breakdown by question family. A streaming
  set (``--streaming``) is scored as OVO-Bench is.

A question polled several times (a forward question) counts once, as the mean of its polls. Every score
carries question counts and how many answers the parser could not read. Accuracies are percentages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from statekv.eval import ovobench, streamingbench
from statekv.eval.questions import MLVU_TASKS
from statekv.eval.records import AnswerRecord
from statekv.synthetic.streaming import GROUPS as SYNTHETIC_STREAMING_GROUPS

HEADLINE_METRIC = {
    "videomme": "micro accuracy",
    "mlvu": "M-avg (mean of the 7 task accuracies)",
    "ovobench": "mean of the groups' scores (each the mean of its tasks' accuracies)",
    "streamingbench": "micro accuracy",
    "synthetic": "micro accuracy",
}
GROUPED_METRIC = "mean of the groups' scores (each the mean of its tasks' accuracies)"
BREAKDOWNS = {
    "videomme": ("duration", "domain", "sub_category", "task_type"),
    "mlvu": ("task_type",),
    "ovobench": ("group", "task_type"),
    "streamingbench": ("group", "task_type"),
    "synthetic": ("task_type",),
}


@dataclass(frozen=True)
class Tally:
    """``questions`` counted once each (a polled question too), ``correct`` their summed scores (a polled
    question scores the share of its polls answered right), ``unparsable`` the answers nothing could be read
    from."""

    questions: int
    correct: float
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
    ``missing_tasks`` lists MLVU/OVO-Bench/StreamingBench tasks (of the groups answered) with no answers; the
    headline then averages only the tasks present. ``expected``/``missing`` count questions of the benchmark
    not (yet) answered, when the full question list was given. ``group_scores``: each group's score, as the
    headline combines them (OVO-Bench, StreamingBench, a streaming synthetic set). ``official``: the headline as
    the benchmark's released code computes it, where it differs (OVO-Bench).
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
    group_scores: dict[str, float] | None = None
    official: float | None = None

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
            "group_scores": self.group_scores,
            "official": self.official,
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
    records = [_with_group(record) for record in records]
    grouped = any(record.group for record in records)
    overall = _tally(records)
    breakdowns = BREAKDOWNS[benchmark] + (("group",) if grouped and "group" not in BREAKDOWNS[benchmark] else ())
    groups = {name: _tally_by(records, name) for name in breakdowns}
    missing_tasks: tuple[str, ...] = ()
    metric, group_scores, official = HEADLINE_METRIC[benchmark], None, None
    tasks = groups["task_type"]
    if benchmark == "streamingbench":
        headline = overall.accuracy
        group_scores = {group: tally.accuracy for group, tally in groups["group"].items()}
        missing_tasks = _missing(tasks, [t for g in group_scores for t in streamingbench.GROUPS[g]])
    elif benchmark == "ovobench" or (benchmark == "synthetic" and grouped):
        group_scores = _group_means(records, tasks)
        headline = sum(group_scores.values()) / len(group_scores)
        metric = GROUPED_METRIC
        if benchmark == "ovobench":
            missing_tasks = _missing(tasks, [t for g in group_scores for t in ovobench.GROUPS[g]])
            official = ovobench.official_score(_poll_scores(records))
    elif benchmark in ("videomme", "synthetic"):
        headline = overall.accuracy
    else:
        missing_tasks = _missing(tasks, MLVU_TASKS)
        headline = sum(tally.accuracy for tally in tasks.values()) / len(tasks)
    expected = missing = None
    if expected_qids is not None:
        expected_set = set(expected_qids)
        expected, missing = len(expected_set), len(expected_set - {record.qid for record in records})
    return BenchmarkScore(
        benchmark=benchmark,
        parser=parser,
        metric=metric,
        headline=headline,
        overall=overall,
        groups=groups,
        missing_tasks=missing_tasks,
        expected=expected,
        missing=missing,
        group_scores=group_scores,
        official=official,
    )


def _with_group(record: AnswerRecord) -> AnswerRecord:
    """The record with its group: records written before groups were recorded name none (OVO-Bench's is its
    task's; a streaming synthetic task's, its task's)."""
    if record.group:
        return record
    known = {"ovobench": ovobench.GROUP_OF, "synthetic": SYNTHETIC_STREAMING_GROUPS}.get(record.benchmark, {})
    group = known.get(record.task_type, "")
    return replace(record, group=group) if group else record


def _missing(tasks: dict[str, Tally], expected: Sequence[str]) -> tuple[str, ...]:
    return tuple(task for task in expected if task not in tasks)


def _group_means(records: Sequence[AnswerRecord], tasks: dict[str, Tally]) -> dict[str, float]:
    """Each group's score: the unweighted mean of its tasks' accuracies."""
    group_of = {record.task_type: record.group for record in records}
    by_group: dict[str, list[float]] = defaultdict(list)
    for task, tally in tasks.items():
        by_group[group_of[task]].append(tally.accuracy)
    return {group: sum(values) / len(values) for group, values in sorted(by_group.items())}


def _poll_scores(records: Sequence[AnswerRecord]) -> dict[tuple[str, str], list[float]]:
    scores: dict[tuple[str, str], list[float]] = defaultdict(list)
    for record in records:
        scores[record.group, record.task_type].append(float(record.correct))
    return scores


def _tally(records: Sequence[AnswerRecord]) -> Tally:
    polls: dict[str, list[bool]] = defaultdict(list)
    for record in records:
        polls[record.item_id].append(record.correct)
    if all(len(answers) == 1 for answers in polls.values()):
        correct: float = sum(answers[0] for answers in polls.values())
    else:
        correct = sum(sum(answers) / len(answers) for answers in polls.values())
    return Tally(questions=len(polls), correct=correct, unparsable=sum(record.parsed is None for record in records))


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
