"""Resuming a stream's cache from its disk tier: every step's checksum verified, the carried state of the last
checkpoint read back, the files adopted as they are (see `statekv.core.disk.tier`)."""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from typing import Any

import torch

from ...errors import InputError, OutputError
from ..cache import persistence
from .buffers import PER_SEGMENT, PER_STEP, MappedTokenBuffer, rows_crc, rows_of
from .compaction import BACKLOG, JournalSteps
from .files import Journaled, check_file_set, read_checked
from .slots import carried_layout, layout_bytes
from .tier import DiskTier

SUMMARIES = ("step_means", "step_samples")  # the step summaries' buffers


def resume(tier: DiskTier, journal: Journaled, cache: Any, device: torch.device, *, verify: bool = True,
           carried: list[tuple[torch.Tensor | None, ...]] | None = None, keep_after: bool = False) -> None:
    """Resume ``cache`` (a `TwoStateCache` whose layers' storages ``tier`` made) at the journal's last checkpoint:
    every step's CRC up to it is checked first (evicted steps excepted; ``verify=False``: not, for a stream
    restoring the files it has just written) and the checkpoint's carried state; a one-line `InputError` names the
    first damage. Nothing is rewritten: the files are adopted as they are (rows after the checkpoint's lengths are
    written over as the stream goes on). The journal is then cut after the checkpoint
    (`DiskTier.truncate_journal`), keeping the evictions recorded since.

    ``carried``: a stream restoring itself after a step its disk could not take (``journal`` read with
    ``latest=True``) passes the carried state its last journaled step left (`DiskTier.remembered`): the journal
    is then kept as it is and no checkpoint is read. ``keep_after``: the journal is not cut (a file set whose last
    step was checkpointed by the caller, followed by records of its own: a handover's pending frames)."""
    where, steps = tier.folder, journal.steps
    last = steps[-1]
    lengths = steps.tokens  # as runs: a stream that evicted for weeks is not walked step by step
    sizes = last.get("lengths")
    if not isinstance(sizes, dict) or len(tier.buffers) != len(cache.layers):
        raise InputError(f"{where}: the disk cache's journal is damaged: its last step lacks its files' lengths")
    for layer in range(len(tier.buffers)):
        for name, buffer in tier.buffers[layer].items():
            mapped = getattr(buffer, "mirror", buffer)
            described = Path(f"{mapped.paths[0]}.json")
            if not described.exists() and not int(sizes.get(name, 0) or 0):
                continue  # never written (the segment index before its first segment)
            shape = read_checked(described)
            check_file_set(where, described.name, shape, tier.file_set)
            blocks = shape.get("block_rows")  # None: one file a part (format 4), whose rows are all there
            missing = [path for path in mapped.paths if not path.is_file()] if blocks is None else []
            if missing and int(sizes.get(name, 0) or 0):  # rows the journal lists: not made again empty
                raise InputError(f"{where}: the disk cache is damaged: {missing[0].name} is missing")
            try:
                mapped.close()  # reopened as the journal says (also in place, after a step it could not write)
                mapped.open(tuple(shape["row"]), getattr(torch, shape["dtype"]), int(sizes[name]), block_rows=blocks)
            except (InputError, OutputError):
                raise  # names the file, or the limit on open files
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise InputError(f"{where}: the disk cache is damaged: {mapped.paths[0].name} cannot be "
                                 "reopened") from None
    evicted = journal.evicted.copy()
    for step in journal.later_evictions:
        evicted.add(step)
    per_segment, restoring, tally = cache.layers[0].storage.segment_steps, carried is not None, None
    for layer in range(len(tier.buffers)):
        if "segment_index" in tier.buffers[layer]:
            _check_segments_there(where, tier.buffers[layer]["segment_index"].mirror, evicted, per_segment, len(steps))
    if not restoring:
        carried, tally = _carried_slot(where, journal.carry, len(cache.layers), lengths.total(), len(steps))
    for layer in range(len(tier.buffers)):
        for name, buffer in tier.buffers[layer].items():
            _check_rows_written(where, name, getattr(buffer, "mirror", buffer), evicted, lengths, per_segment,
                                carried[layer][0])
    start, at = 0, 0  # the first token of step ``at``
    with tier.reading():
        for record in steps.held():  # a compacted step is evicted: its rows are punched, nothing to check
            start, at = start + lengths.total(at, record["step"]), record["step"]
            length = lengths[at]
            if verify and at not in evicted:
                crc = 0
                for layer in range(len(tier.buffers)):
                    for name, buffer in tier.layer_files(layer):
                        rows = rows_of(name, at, start, length, per_segment)
                        crc = zlib.crc32((rows_crc(buffer, *rows) if rows else 0).to_bytes(4, "little"), crc)
                if crc != record["crc"]:
                    raise InputError(f"{where}: the disk cache is damaged: step {at}'s data does not match its "
                                     "checksum")
            start, at = start + length, at + 1
    start += lengths.total(at)
    cache.positions.load(_placements(where, cache.positions, steps), lengths)
    for index, (layer, (positions, keys, values, placements, segment)) in enumerate(zip(cache.layers, carried)):
        tensors = {"carried_positions": positions, "carried_keys": keys, "carried_values": values}
        if placements is not None:
            tensors["carried_placements"] = placements
        files = {name: getattr(buffer, "mirror", buffer) for name, buffer in tier.buffers[index].items()}
        # a file set from before the summaries and the segment index were kept has them recomputed from its keys,
        # read whole; else the layer adopts its files as they are, reading none of these rows
        whole = segment is None or not all(name in files and files[name].length for name in SUMMARIES)
        for name, mapped in files.items():
            views = _rows(mapped, whole)
            if name == "detailed":
                tensors.update(keys=views[0], values=views[1])
            elif name == "segment_index":
                if segment is not None:
                    tensors.update(segment_index=views[0] if views else segment[:, :, :0], segment_partial=segment)
            elif views is not None:
                tensors["block_keys" if name == "step_means" else name] = views[0]
        persistence.restore_layer(layer, tensors, None, lengths, device)
    cache.shared_ring.reset()
    cache.chunk_lengths = lengths
    cache.seen_tokens = start
    cache.evicted_steps = evicted
    if cache.tally is not None and tally is not None:
        cache.tally.restore(*tally, len(steps))
    elif cache.tally is not None and restoring:  # the step the disk could not take: its mass goes with it
        cache.tally.undo()
    cache.seen_device = None
    cache.settle_placement()
    cache.buffers_replaced()
    tier.adopt(cache, len(steps) - 1)
    if not restoring:
        tier.checkpointed = len(steps) - 1
        tier.checkpoints = int(journal.carry["slot"]) + 1
        if not keep_after:
            tier.truncate_journal(journal.end)
            if journal.later_evictions:  # their rows may be punched (forced since): they stay evicted
                tier.append({"evict": sorted(set(journal.later_evictions))})
    whole = [record["step"] for record in steps.held() if "crc" in record and BACKLOG not in record]  # foldable
    tier.replayed = {record["step"] for record in steps.held() if BACKLOG in record}
    tier.evicted_records = sum(step in evicted for step in whole)
    tier.held_records = len(whole) - tier.evicted_records


def _check_segments_there(where: Path, index: Any, evicted: Any, per_segment: int, steps: int) -> None:
    """A one-line `InputError` when a block of the segment index ``index`` whose files are missing holds the row of a
    segment not every step of which was evicted (a block's files are removed once every row of it was given back):
    that row is kept, while the step that wrote it, whose checksum covers it, may be evicted and left unchecked."""
    for start, end in index.missing:
        for first, last in evicted.held_runs(min(steps, end * per_segment)):
            if last > start * per_segment:
                segment = max(first, start * per_segment) // per_segment
                name = f"{index.prefix.name}.0.{segment // index.block_rows}.bin"
                raise InputError(f"{where}: the disk cache is damaged: {name} is missing (it holds the retrieval "
                                 f"index of segment {segment}, whose steps are not all evicted)")


def _check_rows_written(where: Path, name: str, mapped: MappedTokenBuffer, evicted: Any, lengths: Any,
                        per_segment: int, carried: torch.Tensor) -> None:
    """A one-line `InputError` when a row past the end of one of ``mapped``'s block files (`MappedTokenBuffer.short`)
    is kept: a step's not evicted, or a token the layer carries (``carried``, its positions ``[B, H_kv, K]``: their
    rows, and under a quantized cache their steps' key scales, outlive their steps). Only rows given back may be
    missing from a file (a stream loaded from a saved file never wrote those it had given back)."""
    if not mapped.short:
        return
    kept = []
    for first, last in evicted.held_runs(len(lengths)):
        if name in PER_STEP:
            kept.append((first, last))
        elif name in PER_SEGMENT:
            kept.append((first // per_segment, -(-last // per_segment)))
        else:
            kept.append((lengths.total(0, first), lengths.total(0, last)))
    rows = carried.reshape(-1).to("cpu")
    if name == "key_scales":
        rows = lengths.running_totals().searched(rows) - 1  # the steps they are of
    elif name in PER_STEP or name in PER_SEGMENT:
        rows = rows[:0]
    for start, end, file in mapped.short:
        if any(low < end and start < high for low, high in kept) or bool(((rows >= start) & (rows < end)).any()):
            raise InputError(f"{where}: the disk cache is damaged: {file} is shorter than the rows its journal lists")


def check_durable(folder: Path, journal: Journaled) -> None:
    """A one-line `InputError` when no step of ``journal`` (`read_file_set`) was durable: there is nothing to resume
    (a stream killed before its first step leaves such a folder, as does a journal emptied)."""
    if not journal.steps:
        raise InputError(f"{folder}: no step of this stream was durable yet; there is nothing to resume")


def check_checkpoint(folder: Path, journal: Journaled) -> None:
    """A one-line `InputError` when the carried state of ``journal``'s last checkpoint (`read_file_set`) is
    damaged or missing, as `resume` would find it, without a model: the carried state is read and checked, not
    kept. A file set with no step journaled has none to check."""
    if not journal.steps:
        return
    layers = (journal.manifest.get("geometry") or {}).get("layers")
    if not isinstance(layers, int) or layers < 1:
        raise InputError(f"{folder}: the disk cache's manifest does not say how many layers it holds")
    _carried_slot(folder, journal.carry, layers, journal.steps.tokens.total(), len(journal.steps))


def _rows(mapped: MappedTokenBuffer, whole: bool) -> tuple[torch.Tensor, ...] | None:
    """What a layer is handed of ``mapped``'s rows: None (nothing written), or per part ``[B, H_kv, length, X]``:
    views of every row (``whole``), else their shape alone (zeros of stride 0, nothing mapped: a view of a stream's
    whole history asks for a run of addresses as long as it, and a capped stream's history outgrows a process's
    addresses in days, although it holds a bounded part of it)."""
    if not mapped.length and (mapped.row is None or not mapped.capacity):
        return None
    if whole or not mapped.length:
        return mapped.view(0, mapped.length)
    b, h, x = mapped.row
    return tuple(torch.zeros((), dtype=mapped.dtype).expand(b, h, mapped.length, x) for _ in range(mapped.parts))


def _placements(where: Path, positions: Any, steps: JournalSteps) -> dict[str, Any] | None:
    """What `StreamPositions.load` takes, from the steps' records (each ``placed``: ``[first, span, base]``), as
    its three columns of runs."""
    if not positions.bounded:
        return None
    if steps.placed is None:
        raise InputError(f"{where}: the disk cache's journal lacks the bounded positions of its steps")
    return {"mode": "bounded", "layout": positions.layout.name, "limit": positions.limit,
            "steps": tuple(steps.placed)}


def _carried_slot(where: Path, carry: dict[str, Any], layers: int, tokens: int, steps: int
                  ) -> tuple[list[tuple[torch.Tensor | None, ...]], tuple[torch.Tensor, torch.Tensor] | None]:
    """The carried state the checkpoint ``carry`` wrote: per layer, positions ``[B, H_kv, K]``, keys, values,
    placements (or None) and the open segment (or None); and evict-least-attended's tally (steps ``[L]`` and their
    totals ``[L]``; None if it wrote none), of a state of ``tokens`` tokens in ``steps`` steps."""
    layout = carried_layout(carry)
    if layout is None or len(layout) != layers:
        raise InputError(f"{where}: the disk cache is damaged: its carried state does not fit {layers} layers")
    size = layout_bytes(layout)
    tallied = carry.get("tally")
    if tallied is not None and (type(tallied) is not int or not 0 <= tallied <= steps):
        raise InputError(f"{where}: the disk cache's journal is damaged: its checkpoint's tally of {tallied!r} steps")
    size += 16 * (tallied or 0)
    if not isinstance(carry.get("slot"), int):
        raise InputError(f"{where}: the disk cache's journal is damaged: its checkpoint names no carried state")
    carried_file = where / f"carry.{carry['slot']}.bin"
    if not carried_file.is_file():
        raise InputError(f"{where}: the disk cache is damaged: {carried_file.name}, the carried state of step "
                         f"{carry['carry']}, is missing")
    try:
        data = carried_file.read_bytes()[:size]
    except OSError:
        data = b""
    if zlib.crc32(data) != carry.get("carry_crc"):
        raise InputError(f"{where}: the disk cache is damaged: the carried state of step {carry['carry']} does not "
                         "match its checksum")
    buffer, offset, carried = bytearray(data), 0, []
    for parts in layout:
        tensors = []
        for part in parts:
            if part is None:
                tensors.append(None)
                continue
            kind, shape = part
            count = math.prod(shape)
            tensors.append(torch.frombuffer(buffer, dtype=kind, count=count, offset=offset).clone().view(*shape))
            offset += count * kind.itemsize
        carried.append(tuple(tensors))
        positions = tensors[0]
        if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= tokens):
            raise InputError(f"{where}: the disk cache is damaged: carried positions outside its {tokens} tokens")
    tally = None
    if tallied == 0:  # nothing scored yet, or every step it scored evicted
        tally = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64))
    elif tallied is not None:
        tally = (torch.frombuffer(buffer, dtype=torch.int64, count=tallied, offset=offset).clone(),
                 torch.frombuffer(buffer, dtype=torch.float64, count=tallied, offset=offset + 8 * tallied).clone())
        offset += 16 * tallied
        if tallied and (int(tally[0].min()) < 0 or int(tally[0].max()) >= steps):
            raise InputError(f"{where}: the disk cache is damaged: its tally names steps outside its {steps}")
    if offset != len(data):
        raise InputError(f"{where}: the disk cache is damaged: its carried state does not fit {layers} layers")
    return carried, tally

