"""A disk tier's file set as written and read back: its descriptions, each vouching for itself with the SHA-256 of
its fields (`write_checked`, `read_checked`, `read_description`) and naming the file set it belongs to (its
manifest's ``file_set``, `check_file_set`), its one owner's lock (`hold`), and its journal, whose first record names
the file set too, read up to the last checkpoint (`read_file_set`: a `Journaled`), and compacted
(`compacted_journal`). See `statekv.core.disk.tier` for the file set.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...errors import ForeignFilesError, InputError
from ...flushing import write_whole
from ...locks import FolderLock
from ..cache.step_runs import StepRuns
from ..storage.memory import available_bytes
from .compaction import (BACKLOG, COMPACTED, JournalSteps, compacted_record, joined_record, last_step,
                         merged_record, record_pieces)
from .open_files import refuse_out_of_files
from .power_loss import checkpointed, synced
from .slots import slot_matches

FORMAT = "statekv-disk-cache"
# 5: its layers' files in blocks (`statekv.core.disk.buffers`); 4: one file a part, a row for every token ever
# streamed (read, and continued so); its journal may be compacted (`statekv.core.disk.compaction`); 3: not; 2: its
# files not bound to each other (no file_set); 1: the carried state journaled every step
FORMAT_VERSION = 5
READ_VERSIONS = (3, 4, FORMAT_VERSION)
MERGED_RECORDS = 8  # compacted records kept side by side before they are merged into one (`merged_record`)
FILE_SET = "file_set"  # the field naming the file set a description or the journal's first record belongs to
MANIFEST = "manifest.json"
JOURNAL = "journal"
FOLLOWED_BY = "followed_by"  # a checkpoint's record: the records written with it, after it (a kill may tear them)
LOCK = "lock"  # held by the one stream living in the file set
CHECKSUM = "checksum"  # the field of a description holding the SHA-256 of the others
MOST_STEPS = 1 << 40  # the steps a journal may stand for (one ``compacted`` record's most, `compaction`)
# Read back once too irregular for runs, a journal's steps take up to this much each (five lists of one integer a
# step), so they may be as many as the memory available holds, at least `FEWEST_STEPS`: a forged ``compacted``
# record of a few runs cannot exhaust it (as `statekv.api.step_lists` bounds a saved file's lists)
STEP_BYTES = 64
FEWEST_STEPS = 1 << 24


@dataclass
class Journaled:
    """What a file set's journal says, up to its last checkpoint: the ``steps`` resumed (one record each, in order,
    the last one checkpointed), the ``carry`` record of that checkpoint, the ``evicted`` steps among them, and the
    records written after the checkpoint that are not steps (e.g. frames pushed but not streamed durably)."""

    manifest: dict[str, Any]
    steps: JournalSteps = field(default_factory=JournalSteps)
    evicted: StepRuns = field(default_factory=StepRuns)
    after: list[dict[str, Any]] = field(default_factory=list)
    end: int = 0  # byte offset of the journal just after the checkpoint's record and the records it counts
    carry: dict[str, Any] | None = None
    later_evictions: list[int] = field(default_factory=list)  # evicted after the checkpoint (their rows are gone)
    # what a power loss took of writes not yet on the device ("": nothing seen), and the steps journaled after the
    # checkpoint (`statekv.core.disk.power_loss`)
    unsynced: str = ""
    steps_after: int = 0
    frames_beyond: int = 0  # the frames streamed by the last step whose record reads after such a loss's gap


# -- one owner, and descriptions that vouch for themselves -----------------------------------------------------
def hold(folder: Path, holder: str | None) -> FolderLock:
    """The exclusive lock of the file set in ``folder`` for ``holder`` (held on the folder itself: removing or
    replacing its ``lock`` file does not break it); a one-line `InputError` naming whoever holds it already."""
    return FolderLock.acquire(folder, what=f"the disk cache {folder}", holder=holder, error=InputError, name=LOCK)


def _fields_sha256(fields: dict[str, Any]) -> str:
    text = json.dumps({k: v for k, v in fields.items() if k != CHECKSUM}, sort_keys=True, separators=(",", ":"),
                      allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def write_checked(path: Path, fields: dict[str, Any]) -> None:
    write_whole(path, json.dumps({**fields, CHECKSUM: _fields_sha256(fields)}, allow_nan=False).encode())


def read_checked(path: Path) -> dict[str, Any]:
    """The fields of a description written by this module (its ``checksum`` removed); a one-line `InputError`
    naming the file when it is unreadable, not a JSON object, or its checksum does not match."""
    try:
        described = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as error:
        if isinstance(error, OSError):
            refuse_out_of_files(error, path.parent)
        raise InputError(f"{path.parent}: the disk cache is damaged: {path.name} cannot be read") from None
    if not isinstance(described, dict):
        raise InputError(f"{path.parent}: the disk cache is damaged: {path.name} is not a JSON object")
    recorded = described.pop(CHECKSUM, None)
    if recorded is None:
        raise InputError(f"{path.parent}: {path.name} records no checksum (made by an earlier statekv, or edited); "
                         "it cannot be verified")
    if recorded != _fields_sha256(described):
        raise InputError(f"{path.parent}: the disk cache is damaged: {path.name} does not match its checksum")
    return described


def check_file_set(folder: Path, file: str, described: dict[str, Any], file_set: str) -> None:
    """A one-line `InputError` unless the description ``file`` (its fields ``described``) belongs to the file set
    ``file_set`` (its manifest's): a file copied or swapped in from another stream's file set is refused."""
    named = described.get(FILE_SET)
    if named != file_set:
        whose = f"another file set's ({str(named)[:40]})" if named is not None else "no file set's"
        raise InputError(f"{folder}: {file} is {whose}, not this one's ({file_set}): it was copied or swapped in from "
                         "another stream")


def check_plain_files(folder: Path) -> None:
    """A one-line `InputError` naming the first entry of ``folder`` that is neither a file nor a folder (a pipe,
    a socket, a device, a dangling link): reading it could wait for ever or never end."""
    for entry in sorted(folder.iterdir()):
        if not (entry.is_file() or entry.is_dir()):
            raise InputError(f"{folder}: {entry.name[:120]} is not a regular file; a disk-tier file set holds only "
                             "files and folders")


def read_description(folder: Path, file: str, form: str, version: int | tuple[int, ...],
                     what: str) -> dict[str, Any]:
    """The JSON object ``folder/file`` if it declares ``form`` at ``version`` (or one of them) and matches its
    checksum; a one-line `InputError` naming ``what`` it is not otherwise."""
    try:
        described = json.loads((folder / file).read_text())
    except (OSError, ValueError, RecursionError) as error:
        if isinstance(error, OSError):
            refuse_out_of_files(error, folder)
        raise InputError(f"{folder}: not a {what} (no readable {file})") from None
    if not isinstance(described, dict) or described.get("format") != form:
        raise InputError(f"{folder}: not a {what}")
    versions = version if isinstance(version, tuple) else (version,)
    if described.get("version") not in versions:
        raise ForeignFilesError(f"{folder}: {what} format {described.get('version')!r}; this statekv reads "
                                f"{' and '.join(map(str, versions))}")
    return read_checked(folder / file)


def read_file_set(folder: str | os.PathLike, *, latest: bool = False, format_2: bool = False) -> Journaled:
    """The manifest and journal of the file set in ``folder``, up to its last checkpoint; a one-line `InputError`
    if it is not one, if a record before the last is damaged (a torn last line, what a kill leaves, is dropped), or
    if no checkpoint was written yet. ``latest``: up to its last step instead (the live stream restoring itself,
    which holds that step's carried state; see `resume`). ``format_2``: read a file set of format 2, whose files
    name no file set (to check it before `upgrade_file_set` writes anything)."""
    folder = Path(folder)
    if format_2:
        manifest = read_description(folder, MANIFEST, FORMAT, 2, "statekv disk cache")
    else:
        manifest = read_manifest(folder)
    try:
        data = (folder / JOURNAL).read_bytes()
    except OSError as error:
        refuse_out_of_files(error, folder)
        raise InputError(f"{folder}: the disk cache has no journal") from None
    records, offset, unsynced = [], 0, ""  # records: (end offset, record) of everything but steps
    beyond: list[dict[str, Any]] = []  # what reads after a gap a power loss left (counted lost, never resumed)
    held: list[dict[str, Any]] = []  # the steps' records, in order
    compacted: list[dict[str, Any]] = []  # the compacted records, checked
    lines = data.split(b"\n")
    header = _record(lines[0]) if len(lines) > 1 else None
    named_set = header is not None and set(header) == {FILE_SET}  # format 2: only where an upgrade was cut short
    if not named_set and not format_2:
        raise InputError(f"{folder}: the disk cache's journal is damaged: its first record does not name its file set")
    if not format_2:
        check_file_set(folder, JOURNAL, header, manifest[FILE_SET])
    first = 1 if named_set else 0
    offset = sum(len(line) + 1 for line in lines[:first])
    for number, line in enumerate(lines[first:], start=first):
        last = number == len(lines) - 1  # no newline after it: torn by a kill, or empty
        record = None if last else _record(line)
        if record is None:
            tail = last or all(not rest for rest in lines[number + 1:])  # what a kill leaves: a torn last line
            # never forced to the device unless a checkpoint's record follows: marked, forced after it; an earlier
            # statekv's, appended after it (a page of it lost with a later one kept is damage to refuse, not a
            # stream to cut back to the checkpoint before it)
            if not latest and (b"\0" in line or not tail) and not any(checkpointed(_record(rest))
                                                                      for rest in lines[number + 1:]):
                unsynced = f"its journal does not read from line {number + 1} on"
                beyond = [r for r in map(_record, lines[number + 1:]) if r is not None]
                break
            if tail:
                break
            raise InputError(f"{folder}: the disk cache's journal is damaged at line {number + 1}")
        offset += len(line) + 1
        if COMPACTED in record:
            try:
                compacted.append(merged_record([record]))  # checked, without unfolding a step
            except (ValueError, TypeError) as error:
                raise InputError(f"{folder}: the disk cache's journal is damaged at line {number + 1}: its compacted "
                                 f"steps do not read ({str(error) or 'too many'})") from None
            if compacted[-1][COMPACTED] and held and compacted[-1][COMPACTED][0][0] <= held[-1]["step"]:
                raise InputError(f"{folder}: the disk cache's journal is damaged: its compacted steps skip step "
                                 f"{held[-1]['step'] + 1}")
        if "step" in record:
            if not isinstance(record["step"], int) or held and not record["step"] > held[-1]["step"]:
                raise InputError(f"{folder}: the disk cache's journal is damaged: step {str(record['step'])[:20]} "
                                 "out of order")
            held.append(record)
        records.append((offset, record))
    try:
        pieces, named = record_pieces(merged_record(compacted) if len(compacted) > 1 else
                                      compacted[0] if compacted else {COMPACTED: [], "tokens": [], "frames": []})
    except ValueError as error:
        raise InputError(f"{folder}: the disk cache's journal is damaged: its compacted steps do not read "
                         f"({error})") from None
    count = len(held) + sum(piece[0] for piece in pieces)
    if count > MOST_STEPS:
        _too_many(folder, count)
    checkpoint = None if latest else _last_checkpoint(records, count)
    while checkpoint is not None and len(records) - 1 - checkpoint < _followers(records[checkpoint][1]):
        records = records[:checkpoint]  # its write was torn by a kill: the checkpoint before vouches, with its own
        checkpoint = _last_checkpoint(records, count)
    carry = None if checkpoint is None else records[checkpoint][1]
    if carry is not None and not latest and not synced(carry) and not slot_matches(folder, carry):
        earlier = _last_checkpoint(records[:checkpoint], count)  # in the slot the unsynced one did not overwrite
        if earlier is not None and records[earlier][1].get("slot") != carry.get("slot"):
            unsynced = f"the carried state of step {carry['carry']} does not match its checksum"
            records, checkpoint = records[:checkpoint] + records[checkpoint + 1 + _followers(carry):], earlier
    upto = count if latest else 0 if checkpoint is None else records[checkpoint][1]["carry"] + 1
    steps = _steps(folder, held, pieces, named, upto)
    journal = Journaled(manifest, steps=steps)
    journal.evicted = StepRuns.from_runs(  # the compacted steps: evicted before any checkpoint
        run for count, step, difference, *_ in pieces
        for run in ([(step, min(step + count, upto))] if count == 1 or difference == 1 else
                    ((at, at + 1) for at in range(step, min(step + difference * (count - 1) + 1, upto), difference))))
    if latest:
        for record in (record for _, record in records if "evict" in record):
            for step in (int(s) for s in record["evict"] if int(s) < len(steps)):
                journal.evicted.add(step)
        return journal
    if checkpoint is None:
        return journal if not count else _no_checkpoint(folder)
    journal.carry = records[checkpoint][1]
    steps_beyond = [r["step"] for r in beyond if type(r.get("step")) is int]
    journal.unsynced, journal.steps_after = unsynced, max(count, max(steps_beyond, default=-1) + 1) - upto
    journal.end = records[checkpoint + _followers(journal.carry)][0]  # cut before them, it would read as torn
    for index, (_, record) in enumerate(records):
        if "evict" in record:
            evicted = [int(s) for s in record["evict"] if int(s) < len(steps)]
            for step in evicted if index < checkpoint else ():
                journal.evicted.add(step)
            if index > checkpoint:
                journal.later_evictions.extend(evicted)
        elif index > checkpoint and "step" not in record and "carry" not in record and COMPACTED not in record:
            journal.after.append(record)
    journal.after += [record for record in beyond if "push" in record]  # lost frames, counted (`frames_lost`)
    journal.frames_beyond = max((r["state"]["frames"] for r in beyond if "step" in r
                                 and isinstance(r.get("state"), dict) and type(r["state"].get("frames")) is int),
                                default=0)
    return journal


def _steps(folder: Path, held: list[dict[str, Any]], pieces: list[list[int]], named: dict[int, Any],
           upto: int) -> JournalSteps:
    """The first ``upto`` of the steps the records ``held`` and the compacted ``pieces`` (`record_pieces`,
    ascending) stand for; a one-line `InputError` unless together they are steps 0, 1, ... each once. Costs what
    they hold (a piece of consecutive steps is taken whole), not how many steps they stand for."""
    steps, at, index, pieces = JournalSteps(), 0, 0, list(pieces)  # the next step, the piece reached
    for record in [*held, None]:
        while index < len(pieces) and pieces[index][1] == at and (record is None or at < record["step"]):
            piece = pieces[index]
            take = piece[0] if piece[2] == 1 else 1  # consecutive steps at once, others one at a time
            if at < upto:
                end = min(at + take, upto)  # held a step at a time, so many would fill the memory:
                if steps.dense and end > FEWEST_STEPS and \
                        end > (available_bytes(torch.device("cpu")) or 0) // STEP_BYTES:
                    _too_many(folder, end)
                steps.fold(piece, min(take, upto - at))
            at += take
            if take == piece[0]:
                index += 1
            else:
                pieces[index] = _advanced(piece, take)
        if record is None:
            if index < len(pieces):
                raise InputError(f"{folder}: the disk cache's journal is damaged: its compacted steps skip step {at}")
            break
        if record["step"] != at:
            raise InputError(f"{folder}: the disk cache's journal is damaged: step {record['step']} after {at} steps")
        if at < upto:
            try:
                steps.add(record)
            except (KeyError, TypeError, ValueError):
                raise InputError(f"{folder}: the disk cache's journal is damaged: step {at}'s record does not "
                                 "read") from None
        at += 1
    steps.name_frames({step: frame for step, frame in named.items() if step < upto})
    return steps


def _too_many(folder: Path, count: int) -> None:
    raise InputError(f"{folder}: the disk cache's journal is damaged: its compacted steps do not read (too many: "
                     f"{count} steps)")


def _advanced(piece: list[int], taken: int) -> list[int]:
    """The piece (`record_pieces`) less its first ``taken`` steps."""
    return [piece[0] - taken, *(v for first, change in zip(piece[1::2], piece[2::2])
                                for v in (first + change * taken, change))]


def _last_checkpoint(records: list[tuple[int, dict[str, Any]]], steps: int) -> int | None:
    """The index in ``records`` of the last checkpoint's record of one of the first ``steps`` steps."""
    return next((i for i in range(len(records) - 1, -1, -1) if "carry" in records[i][1]
                 and isinstance(records[i][1]["carry"], int) and records[i][1]["carry"] < steps), None)


def _followers(record: dict[str, Any]) -> int:
    count = record.get(FOLLOWED_BY, 0)
    return count if isinstance(count, int) and count >= 0 else 0


def read_manifest(folder: Path) -> dict[str, Any]:
    """The verified manifest of the file set in ``folder`` (naming the file set, ``file_set``); a one-line
    `InputError` if it is not one of this format."""
    manifest = read_description(folder, MANIFEST, FORMAT, READ_VERSIONS, "statekv disk cache")
    if not isinstance(manifest.get(FILE_SET), str) or not manifest[FILE_SET]:
        raise InputError(f"{folder}: the disk cache is damaged: {MANIFEST} does not name its file set")
    return manifest


def journal_line(record: dict[str, Any]) -> bytes:
    """``record`` as a line of the journal: the CRC-32 of its JSON, then its JSON."""
    text = json.dumps(record, separators=(",", ":"), allow_nan=False)
    return f"{zlib.crc32(text.encode()):08x} {text}\n".encode()


def compacted_journal(data: bytes) -> bytes | None:
    """The journal ``data`` compacted (`statekv.core.disk.compaction`): its first record; its ``compacted`` records,
    the records of its evicted steps up to its last checkpoint (but the checkpoint's own step and those a successor
    replays) folded in (joined to the last one when they all come after its steps, else beside it; more than
    `MERGED_RECORDS` of them merged into one); the other steps' records up to the checkpoint as they were, and one
    ``evict`` record of the other evicted steps; from the checkpoint's record on, every line as it was. None when
    no step record is left to fold, or ``data`` does not read as a whole journal."""
    lines = data.split(b"\n")
    if len(lines) < 3 or lines[-1]:
        return None
    records = [_record(line) for line in lines[:-1]]
    carries = [index for index, record in enumerate(records) if record is not None and "carry" in record]
    if not carries or any(record is None for record in records):
        return None
    last, steps, evicted, folded = carries[-1], {}, set(), []
    try:
        for line, record in zip(lines[1:last], records[1:last]):
            if COMPACTED in record:
                folded.append(record)
            elif "step" in record:
                steps[int(record["step"])] = (line, record)
            elif "evict" in record:
                evicted.update(int(step) for step in record["evict"])
        upto = records[last]["carry"]
        fold = sorted(step for step in evicted if step in steps and step < upto and BACKLOG not in steps[step][1])
        if not fold:
            return None
        new = compacted_record([steps[step][1] for step in fold])
        if folded and last_step(folded[-1]) < fold[0] and joined_record(folded[-1], new) is not None:
            folded[-1] = joined_record(folded[-1], new)
        else:
            folded.append(new)
        if len(folded) > MERGED_RECORDS:
            folded = [merged_record(folded)]
    except (ValueError, TypeError, KeyError):
        return None
    folding = set(fold)
    kept = [lines[0], *(journal_line(record).rstrip(b"\n") for record in folded)]
    kept.extend(steps[step][0] for step in sorted(steps) if step not in folding)
    others = sorted((evicted & set(steps)) - folding)
    if others:
        kept.append(journal_line({"evict": others}).rstrip(b"\n"))
    return b"\n".join(kept + lines[last:])


def journal_header(file_set: str) -> dict[str, Any]:
    """The journal's first record: the file set it belongs to."""
    return {FILE_SET: file_set}


def _no_checkpoint(folder: Path) -> Journaled:
    raise InputError(f"{folder}: the disk cache holds no checkpoint of its carried state yet; there is nothing to "
                     "resume")


def _record(line: bytes) -> dict[str, Any] | None:
    crc, _, text = line.partition(b" ")
    try:
        if int(crc, 16) != zlib.crc32(text):
            return None
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


# -- format 2, whose files named no file set ------------------------------------------------------------------
def upgrade_file_set(folder: Path) -> dict[str, Any]:
    """Bind the files of a format-2 file set in ``folder`` to each other as format 4 does: a new ``file_set`` id in
    every layer description, the journal's first record and, last, the manifest (so an upgrade cut short is still
    format 2, and run again). Its caller holds the set's lock and vouches for its files: before, nothing told a file
    swapped in from another set apart. Returns the new manifest's fields; a one-line `InputError` if it is not a
    format-2 file set."""
    manifest = read_description(folder, MANIFEST, FORMAT, 2, "statekv disk cache")
    try:
        data = (folder / JOURNAL).read_bytes()
    except OSError:
        raise InputError(f"{folder}: the disk cache has no journal") from None
    first, newline, rest = data.partition(b"\n")
    header = _record(first) if newline else None
    if header is not None and set(header) == {FILE_SET}:  # an upgrade cut short: its id is kept
        file_set, data = header[FILE_SET], rest
    else:
        file_set = uuid.uuid4().hex
    for described in sorted(folder.glob("layer*.bin.json")):
        write_checked(described, {**read_checked(described), FILE_SET: file_set})
    write_whole(folder / JOURNAL, journal_line(journal_header(file_set)) + data)
    manifest = {**manifest, "version": FORMAT_VERSION, FILE_SET: file_set,
                "created": manifest.get("created") or datetime.datetime.now(datetime.timezone.utc).isoformat()}
    write_checked(folder / MANIFEST, manifest)
    return read_manifest(folder)
