"""Per-question answer records: append-only JSON Lines that survive a crash at any moment.

A run directory holds one evaluation (one benchmark, model, method and budget)::

    <run_dir>/answers.rank000.jsonl   appended by rank 0, one line per answered question
    <run_dir>/answers.rank001.jsonl   ...
    <run_dir>/answers.jsonl           merge of the rank files (``merge_rank_files``)
    <run_dir>/results.json            summary (``statekv.eval.report.write_summary``)

Each line is written whole, flushed and fsynced before ``write`` returns. A line counts only
once its newline is on disk: an unterminated last line (the process was killed mid-write) is
ignored when reading and cut off before appending, so a resumed run re-answers that question.
So are last lines holding a NUL byte, which no record holds: a power loss keeps a write not yet
on the device in any order between its pages, so it can leave the end of the file zero-filled,
its newline kept or not (`durable_end`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statekv.errors import DataError
from statekv.flushing import durable_end, flush_folder, write_whole
from statekv.eval.parsing import DEFAULT_PARSER, check_parser, judge
from statekv.eval.prompts import DEFAULT_PROTOCOL, check_protocol
from statekv.eval.questions import Question

logger = logging.getLogger(__name__)

MERGED_FILE = "answers.jsonl"
RANK_FILE_GLOB = "answers.rank*.jsonl"


class ResultsFileError(DataError):
    """A results file has a corrupt line before its end (not a crash artefact)."""


def rank_file(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / f"answers.rank{rank:03d}.jsonl"


@dataclass(frozen=True)
class AnswerRecord:
    """One answered question: what was asked, what came back, how it was read and scored.

    ``prediction`` is the raw generated text; ``parsed`` the letter the ``parser`` read from it
    (``None``: unparsable; for other answer kinds what was read: a count, Yes/No, an output). ``timings`` holds
    seconds by phase (e.g. "encode", "answer"); ``extra`` anything else the runner wants kept (frame count,
    FLOPs, ...; a proactive output's ``answered_at`` and ``expected_at``). ``group``, ``item`` and ``kind`` are
    the question's (`statekv.eval.questions.Question`): a poll's record names the question it polls.
    """

    benchmark: str
    qid: str
    video_id: str
    prediction: str
    parsed: str | None
    correct: bool
    answer: str
    letters: str
    parser: str
    protocol: str
    model: str
    method: str
    budget: int | None
    task_type: str
    duration: str = ""
    domain: str = ""
    sub_category: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    group: str = ""
    item: str = ""
    kind: str = "choice"

    @property
    def item_id(self) -> str:
        """The question this record answers a poll of (its own id when asked once)."""
        return self.item or self.qid

    @classmethod
    def for_answer(
        cls,
        question: Question,
        prediction: str,
        *,
        model: str,
        method: str,
        budget: int | None = None,
        protocol: str = DEFAULT_PROTOCOL,
        parser: str = DEFAULT_PARSER,
        timings: Mapping[str, float] | None = None,
        **extra: Any,
    ) -> AnswerRecord:
        """Parse and score ``prediction`` for ``question``."""
        check_protocol(protocol)
        parsed, correct = judge(
            question.benchmark, prediction, answer=question.answer, letters=question.letters, parser=parser,
            kind=question.kind, answered_at=extra.get("answered_at"), expected_at=extra.get("expected_at"),
        )
        return cls(
            benchmark=question.benchmark,
            qid=question.qid,
            video_id=question.video_id,
            prediction=prediction,
            parsed=parsed,
            correct=correct,
            answer=question.answer,
            letters=question.letters,
            parser=parser,
            protocol=protocol,
            model=model,
            method=method,
            budget=budget,
            task_type=question.task_type,
            duration=question.duration,
            domain=question.domain,
            sub_category=question.sub_category,
            timings=dict(timings or {}),
            extra=extra,
            group=question.group,
            item=question.item,
            kind=question.kind,
        )

    def rescored(self, parser: str) -> AnswerRecord:
        """The same answer read with another parser generation."""
        check_parser(parser)
        parsed, correct = judge(
            self.benchmark, self.prediction, answer=self.answer, letters=self.letters, parser=parser, kind=self.kind,
            answered_at=self.extra.get("answered_at"), expected_at=self.extra.get("expected_at"),
        )
        return dataclasses.replace(self, parser=parser, parsed=parsed, correct=correct)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AnswerRecord:
        """A record from its JSON object; a `KeyError` for a missing field, a `TypeError` for a field of the wrong
        type (`read_records` turns both into one line naming the file and the line)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"an answer record is a JSON object, not {type(data).__name__}")
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        required = [
            f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in data]
        if missing:
            raise KeyError(f"answer record lacks {', '.join(missing)}")
        known = {key: value for key, value in data.items() if key in names}
        unknown = {key: value for key, value in data.items() if key not in names}
        for name, value in known.items():
            kinds = _FIELD_TYPES.get(name, (str,))
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise TypeError(f"field {name!r} is {str(value)[:40]!r}")
        for name in ("timings",):
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in known.get(name, {}).values()):
                raise TypeError(f"field {name!r} must map phases to seconds")
        if unknown:
            known["extra"] = {**known.get("extra", {}), **unknown}
        for name in ("answered_at", "expected_at"):  # what scoring a proactive output reads
            value = known.get("extra", {}).get(name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise TypeError(f"field extra.{name} must be seconds or null, got {str(value)[:40]!r}")
        return cls(**known)


_FIELD_TYPES: dict[str, tuple[type, ...]] = {  # fields not named here are strings
    "parsed": (str, type(None)), "correct": (bool,), "budget": (int, type(None)), "timings": (dict,),
    "extra": (dict,),
}


class ResultsWriter:
    """Appends one JSON line per record to ``path``; each ``write`` is durable when it returns. A line whose fsync
    fails is taken back (its question is asked again) and the writer writes no more: the pages that fsync could not
    write may be dropped, and a later fsync succeeding would vouch for them (`statekv.flushing`)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_unterminated_tail(self.path)
        made = not self.path.exists()
        self._file = self.path.open("a", encoding="utf-8")
        self._failed: OSError | None = None  # the fsync that failed: nothing is written after it
        if made:  # its name on the device too, before the answers it will vouch for
            try:
                flush_folder(self.path.parent)
            except OSError as error:  # made again by a rerun, whose flush then vouches for its name
                self._file.close()
                self.path.unlink(missing_ok=True)
                raise OSError(error.errno, error.strerror, str(self.path)) from None

    def write(self, record: AnswerRecord) -> None:
        if not isinstance(record, AnswerRecord):
            raise TypeError(f"ResultsWriter writes AnswerRecord objects, got {type(record).__name__}")
        if self._failed is not None:
            raise OSError(self._failed.errno, f"{self._failed.strerror} (an earlier fsync failed)", str(self.path))
        end = os.fstat(self._file.fileno()).st_size
        self._file.write(json.dumps(record.to_json(), ensure_ascii=False) + "\n")
        self._file.flush()
        try:
            os.fsync(self._file.fileno())
        except OSError as error:
            self._failed = error
            with contextlib.suppress(OSError):  # not counted answered: asked again
                os.truncate(self._file.fileno(), end)
            raise OSError(error.errno, error.strerror, str(self.path)) from None

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def drop_unterminated_tail(path: Path,
                           what: str = "an answer cut short by a stop; its question is asked again",
                           lost: str = "an answer not yet on the disk; its question is asked again") -> None:
    """Cut a partial last line (left by a killed writer) or a zero-filled end (left by a power loss,
    `durable_end`) so appends start on a fresh line; ``what`` and ``lost``: what the warning says each was."""
    if not path.is_file():
        return
    data = path.read_bytes()
    keep = durable_end(data)
    if keep < len(data):
        if b"\0" in data[keep:]:
            logger.warning("%s: dropping an end a power loss zero-filled (%d bytes), %s", path, len(data) - keep, lost)
        else:
            logger.warning("%s: dropping an unterminated last line (%d bytes), %s", path, len(data) - keep, what)
        with path.open("rb+") as file:
            file.truncate(keep)


def drop_unterminated_tails(run_dir: Path) -> None:
    """`drop_unterminated_tail` of every rank file of the run in ``run_dir``."""
    for path in sorted(run_dir.glob(RANK_FILE_GLOB)):
        drop_unterminated_tail(path)


def read_records(path: Path | str) -> list[AnswerRecord]:
    """Records of one results file, in file order; an unterminated or zero-filled end is dropped (`durable_end`)."""
    path = Path(path)
    if path.is_dir():
        raise ResultsFileError(f"{path} is a folder, not a file of answer records: move it out of the run folder")
    data = path.read_bytes()
    # an unterminated last line is a write under way, or a killed writer's, and a zero-filled end a power loss's
    # (the run that goes on cuts it, and says so): ignored undecoded, as a kill may have cut it inside a character
    complete = data[: durable_end(data)]
    if len(complete) < len(data):
        logger.debug("%s: ignoring an unterminated or zero-filled end", path)
    try:
        text = complete.decode("utf-8")
    except UnicodeDecodeError as error:
        line = complete[: error.start].count(b"\n") + 1
        raise ResultsFileError(f"{path}:{line}: corrupt answer record (not UTF-8 text)") from None
    records = []
    for number, line in enumerate(text.split("\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            records.append(AnswerRecord.from_json(json.loads(line)))
        except (ValueError, KeyError, TypeError, RecursionError) as error:  # ValueError: json's, and huge integers
            raise ResultsFileError(f"{path}:{number}: corrupt answer record ({error})") from None
    return records


def latest_per_question(records: Iterable[AnswerRecord]) -> list[AnswerRecord]:
    """One record per qid (the last written wins, e.g. after a question was re-answered)."""
    latest: dict[str, AnswerRecord] = {}
    for record in records:
        latest[record.qid] = record
    return list(latest.values())


def run_records(run_dir: Path | str) -> list[AnswerRecord]:
    """Every answered question of a run: the merged file and all rank files, deduplicated; a one-line
    `ResultsFileError` naming the first record of another run (another benchmark, method or budget than the
    folder's ``run.json`` or its other records say)."""
    run_dir = Path(run_dir)
    paths = sorted(run_dir.glob(RANK_FILE_GLOB))
    if (run_dir / MERGED_FILE).exists():
        paths.insert(0, run_dir / MERGED_FILE)
    expected = _run_identity(run_dir)
    records = []
    for path in paths:
        for number, record in enumerate(read_records(path), start=1):
            for name in RECORD_IDENTITY:
                value = getattr(record, name)
                if expected.setdefault(name, value) != value:
                    raise ResultsFileError(f"{path}: answer {number} is another run's ({name} {value!r}, this run's "
                                           f"{expected[name]!r}): move that file out of the run folder")
            records.append(record)
    return latest_per_question(records)


RECORD_IDENTITY = ("benchmark", "method", "budget")  # what every record of one run shares with its run.json


def _run_identity(run_dir: Path) -> dict[str, Any]:
    """What ``run_dir``'s ``run.json`` says of `RECORD_IDENTITY` (nothing when it cannot be read: what reads it
    says so)."""
    try:
        settings = json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("settings")
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}
    return {name: settings[name] for name in RECORD_IDENTITY if isinstance(settings, dict) and name in settings}


def completed_qids(run_dir: Path | str) -> set[str]:
    """Question ids already answered in ``run_dir`` (what a resumed run skips)."""
    return {record.qid for record in run_records(run_dir)}


def drop_answers(run_dir: Path | str, qids: set[str]) -> None:
    """Remove the answers to ``qids`` from every file of the run in ``run_dir`` (each file rewritten whole)."""
    if not qids:
        return
    run_dir = Path(run_dir)
    for path in [run_dir / MERGED_FILE, *sorted(run_dir.glob(RANK_FILE_GLOB))]:
        if path.is_file():
            records = read_records(path)
            kept = [record for record in records if record.qid not in qids]
            if len(kept) != len(records):
                write_records_atomically(path, kept)


def merge_rank_files(run_dir: Path | str) -> list[AnswerRecord]:
    """Write ``answers.jsonl`` from all rank files (deduplicated, sorted by qid) and return it."""
    run_dir = Path(run_dir)
    records = sorted(run_records(run_dir), key=lambda record: _natural_key(record.qid))
    write_records_atomically(run_dir / MERGED_FILE, records)
    return records


def write_records_atomically(path: Path, records: Iterable[AnswerRecord]) -> None:
    write_whole(path, "".join(json.dumps(record.to_json(), ensure_ascii=False) + "\n" for record in records).encode())


def _natural_key(text: str) -> tuple[str | int, ...]:
    # re.split with a capture group puts the digit runs at the odd positions
    return tuple(int(part) if index % 2 else part for index, part in enumerate(re.split(r"(\d+)", text)))


def written_in(error: OSError, folder: Path) -> bool:
    """Whether ``error`` came from writing in ``folder`` (an error without a file name: from an open one)."""
    if error.filename is None:
        return True
    try:
        return Path(os.path.abspath(error.filename)).is_relative_to(os.path.abspath(folder))
    except (TypeError, ValueError):
        return False
