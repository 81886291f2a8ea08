"""Read annotation tables (parquet, JSON, JSON Lines) into plain row dicts.

Parquet needs ``pyarrow`` (imported only when a parquet file is read); JSON and JSON Lines need
nothing, so a layout converted to ``.jsonl`` works with the core install.
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from statekv.errors import ConfigurationError, MissingFileError
from statekv.eval.questions import AnnotationError

logger = logging.getLogger(__name__)

ANNOTATION_SUFFIXES = (".parquet", ".jsonl", ".json")


def find_annotation_files(directories: Sequence[Path], stem: str) -> list[Path]:
    """Files named ``<stem>*.parquet|jsonl|json`` in the first directory that has any.

    Within that directory one format is used, in the order parquet > jsonl > json; several
    files of it (shards such as ``test-00000-of-00002.parquet``) are all returned, sorted.
    """
    for directory in directories:
        for suffix in ANNOTATION_SUFFIXES:
            found = sorted(directory.glob(f"{stem}*{suffix}"))
            if found:
                return found
    tried = ", ".join(str(d / f"{stem}*{{{','.join(ANNOTATION_SUFFIXES)}}}") for d in directories)
    raise MissingFileError(f"no annotation file found; looked for {tried}")


def read_rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """All rows of the given files, in order."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows.extend(read_table(path))
    return rows


def read_table(path: Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"annotation file not found: {path}"
                               + ("" if path.parent.is_dir() else f" ({path.parent} is a file, not a folder)"
                                  if path.parent.is_file() else f" (there is no folder {path.parent})"))
    check_readable(path)
    if path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    if path.suffix == ".json":
        return _read_json(path)
    raise AnnotationError(f"{path}: unsupported annotation format (use {', '.join(ANNOTATION_SUFFIXES)})")


def check_readable(path: Path) -> None:
    """A one-line `AnnotationError` when ``path`` (a file) cannot be read: no permission, a disk error."""
    try:
        open(path, "rb").close()
    except OSError as error:
        raise AnnotationError(f"{path}: cannot be read ({error.strerror or error})") from None


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise ConfigurationError(f"reading {path} needs pyarrow (pip install pyarrow), or convert it to JSON "
                                 "Lines") from error
    try:
        return pq.read_table(path).to_pylist()
    except Exception as error:  # pyarrow raises its own kinds for a damaged file
        reason = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
        raise AnnotationError(f"{path}: not a readable parquet file ({reason})") from None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, raw in enumerate(path.read_bytes().removeprefix(codecs.BOM_UTF8).split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise AnnotationError(f"{path}:{number}: not UTF-8 text") from None
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise AnnotationError(f"{path}:{number}: not valid JSON ({error.msg}: column {error.colno})") from None
        except ValueError as error:  # an integer of more digits than Python converts
            raise AnnotationError(f"{path}:{number}: not valid JSON ({str(error)[:80]})") from None
        except RecursionError:
            raise AnnotationError(f"{path}:{number}: JSON nested too deeply") from None
    return _require_objects(path, rows)


def _read_json(path: Path) -> list[dict[str, Any]]:
    data = read_json_document(path)
    if not isinstance(data, list):
        raise AnnotationError(f"{path}: expected a JSON list of question objects")
    return _require_objects(path, data)


def read_json_document(path: Path) -> Any:
    """The JSON value a file holds; a one-line `AnnotationError` naming the file (and line) when it is not
    UTF-8 JSON, a `MissingFileError` when there is no such file."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"annotation file not found: {path}")
    check_readable(path)
    data_bytes = path.read_bytes().removeprefix(codecs.BOM_UTF8)  # a mark some editors put first: not text
    try:
        return json.loads(data_bytes.decode("utf-8"))
    except UnicodeDecodeError as error:
        line = data_bytes[: error.start].count(b"\n") + 1
        raise AnnotationError(f"{path}:{line}: not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise AnnotationError(f"{path}: not valid JSON ({error.msg}: line {error.lineno} column {error.colno})") \
            from None
    except ValueError as error:  # an integer of more digits than Python converts
        raise AnnotationError(f"{path}: not valid JSON ({str(error)[:80]})") from None
    except RecursionError:
        raise AnnotationError(f"{path}: JSON nested too deeply") from None


def _require_objects(path: Path, rows: list[Any]) -> list[dict[str, Any]]:
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise AnnotationError(f"{path}: row {index} is not a JSON object")
    return rows


def video_in(folder: Path, name: Any, where: str, field: str = "video") -> Path:
    """``folder / name``: the video an annotation row names, refused in one line when the name leaves ``folder``
    (an absolute path, or one up through ``..``): a benchmark's rows name videos inside its own folder."""
    text = str(name)
    relative = PurePosixPath(text.replace("\\", "/"))
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise AnnotationError(f"{where}: field {field!r} ({text[:80]!r}) must be a path inside {folder}")
    return folder / relative


def require_fields(row: dict[str, Any], fields: Sequence[str], where: str) -> None:
    """Every field present; text fields (all but options, answers given as indices, times) must be non-empty
    strings or integers, not null, lists or objects."""
    missing = [field for field in fields if field not in row]
    if missing:
        raise AnnotationError(f"{where}: missing field(s) {', '.join(missing)}")
    for field in fields:
        if field in NOT_TEXT:
            continue
        value = row[field]
        if isinstance(value, bool) or not isinstance(value, (str, int)) or (isinstance(value, str)
                                                                            and not value.strip()):
            shown = "empty" if isinstance(value, str) else f"{type(value).__name__} {str(value)[:40]!r}"
            raise AnnotationError(f"{where}: field {field!r} must be a non-empty text, got {shown}")


NOT_TEXT = frozenset({"options", "candidates", "gt", "realtime", "evidence_frames", "num_frames", "test_info",
                      "questions"})


def parse_options(value: Any, where: str, *, distinct: bool = True) -> tuple[str, ...]:
    """A list of 2 to 26 option texts (numbers are taken as their text). ``distinct``: every option a non-empty text
    appearing once (statekv's own sets, where anything else is damage); otherwise the options are kept exactly as
    listed, empty and repeated texts included (a benchmark's release: its code prompts them as listed, and the
    answer is a letter, so a repeated text is still one right letter)."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise AnnotationError(f"{where}: options must be a list, got {type(value).__name__}")
    value = list(value)
    for index, option in enumerate(value):
        empty = distinct and not str(option).strip()
        if isinstance(option, bool) or not isinstance(option, (str, int, float)) or empty:
            shown = "empty" if isinstance(option, str) else f"{type(option).__name__} {str(option)[:40]!r}"
            raise AnnotationError(f"{where}: option {index} must be a non-empty text, got {shown}")
    options = tuple(str(option) for option in value)
    if not 2 <= len(options) <= 26:
        raise AnnotationError(f"{where}: expected 2 to 26 options, got {len(options)}")
    repeated = next((option for index, option in enumerate(options) if option.strip() in
                     {other.strip() for other in options[:index]}), None)
    if distinct and repeated is not None:
        raise AnnotationError(f"{where}: option {repeated!r} appears twice")
    return options


def checked_groups(groups: Iterable[str] | None, known: Iterable[str], benchmark: str,
                   note: str = "") -> tuple[str, ...]:
    """``groups`` checked against a benchmark's ``known`` groups (None: all of them); an unknown or empty choice is
    a one-line `AnnotationError` naming the choices, then ``note`` when given."""
    known = tuple(known)
    if groups is None:
        return known
    groups = tuple(groups)
    unknown = [group for group in groups if group not in known]
    if unknown or not groups:
        raise AnnotationError(f"unknown {benchmark} group {unknown[0] if unknown else ''!r}; choose from "
                              f"{', '.join(known)}{note}")
    return groups


class LoadNotes:
    """What a load took otherwise than as written (rows or parts of rows not used, values read the release's way),
    counted by kind, for one warning line (`warn`) naming the counts and the first places."""

    SHOWN = 3  # places named per kind

    def __init__(self, benchmark: str):
        self.benchmark = benchmark
        self.kinds: dict[str, list[str]] = {}

    def add(self, kind: str, where: str) -> None:
        """One more case of ``kind`` (a phrase that reads after a count: "questions of task 'X' (why)") at
        ``where``."""
        self.kinds.setdefault(kind, []).append(where)

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def line(self) -> str:
        parts = []
        for kind, places in self.kinds.items():
            shown = ", ".join(places) if len(places) <= self.SHOWN else f"the first at {places[0]}"
            parts.append(f"{len(places):,} {kind}: {shown}")
        return f"{self.benchmark}: " + "; ".join(parts)

    def warn(self) -> None:
        """Log `line` as one warning (nothing when there is nothing to say)."""
        if self.kinds:
            logger.warning("%s", self.line())
