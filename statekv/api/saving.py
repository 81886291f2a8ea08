"""`Stream.save` and `Stream.load`: a stream to its file (`statekv.api.stream_file`) and back, or resumed from its
disk-tier file set (`statekv.api.durability.resume_stream`).

A stream's file records its engine state (`StreamingPrefill.state_dict`), its pending frames, its push clock and
layout state, the model and the engine (`EngineSettings`, whole); loading checks all of it, and that the
`VideoQA` given could have written it, before anything is built.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.cache.persistence import check_state_dict
from ..core.storage.step_values import StepValues
from ..core.stream.prefill import cache_geometry
from .durability import loaded_record, resume_stream
from ..settings.engine import HANDOVER, EngineSettings
from ..settings.values import is_folder, printable
from .handover import OWN_LAYOUT, resumed_engine
from .stats import EncodingStats
from .watch_saving import records as watch_records, restore as restore_watches, tensors as watch_tensors
from ..errors import HorizonError, InputError, OutputError
from ..models import LayoutState
from .stream_file import (FORMAT, FORMAT_VERSION, UNCHANGED, check_against_model, check_same_setup, check_values,
                          model_identity, read_verified, recorded_settings, weights_fingerprint, write_verified)
from .stream_identity import check_ownership
from ..video import Frame
from ..video.sampling import tick


BACKLOG = "backlog.inputs_embeds"  # a handover stream's steps its successor has yet to replay


def save_stream(stream: Any, path: str | Path) -> Path:
    """Write ``stream`` (a `Stream` with something encoded) to ``path`` (see `Stream.save`); the stream is not
    changed, whether the save succeeds or not."""
    where = printable(path)
    try:
        stream.prefill.sync()  # a disk-tier stream's file set is durable as of this save too
        if stream.durability.journal_watches():  # its watches as this save holds them
            stream.prefill.sync()
        stream.durability.sync()
    except OutputError as error:
        raise OutputError(f"cannot save the stream to {where}: {error}; {UNCHANGED}") from None
    tensors, cache_metadata = stream.prefill.state_dict(as_runs=True)  # runs: no list a step
    tensors = {f"cache.{name}": tensor for name, tensor in tensors.items()}
    successor = backlog = None
    if stream.successor is not None:  # the handover layout, inside the range: the engine it continues with
        if stream.successor.seen_tokens:  # the steps it replayed (`EncodedVideo.catch_up`)
            successor_tensors, successor = stream.successor.state_dict(as_runs=True)
            tensors.update({f"successor.{name}": tensor for name, tensor in successor_tensors.items()})
        if stream.backlog.steps:  # those it has yet to replay
            tensors[BACKLOG] = stream.backlog.tensor()
            backlog = {"spans": stream.backlog.spans}
    for index, frame in enumerate(stream.pending):
        tensors[f"pending.{index}"] = torch.from_numpy(np.ascontiguousarray(frame.image))
    tensors.update(watch_tensors(stream))
    metadata = {
        "format": FORMAT, "version": FORMAT_VERSION, "name": stream.name, **stream.identity,
        "model": {**model_identity(stream.qa), "weights": weights_fingerprint(stream.adapter.model)},
        "engine": engine_record(stream, offload=bool(stream.engine.offload)),
        "horizon": stream.horizon, "horizon_frames": stream.horizon_frames, "max_fps": stream.max_fps,
        "prefix_tokens": stream.prefix_tokens, "vision_batch": stream.vision_batch,
        "pushed": stream.pushed, "next_tick": stream.next_tick, "last_timestamp": stream.last_timestamp,
        "kept_timestamp": stream.kept_timestamp, "encoded_timestamp": stream.encoded_timestamp,
        "pending": [[frame.index, frame.timestamp] for frame in stream.pending],
        "state": stream.state.to_dict(), "stats": {k: v for k, v in stream.stats.to_dict().items()
                                                   if k in {field.name for field in fields(EncodingStats)}},
        "cache": cache_metadata,
    }
    if successor is not None:
        metadata["successor"] = successor
    if backlog is not None:
        metadata["backlog"] = backlog
    if stream.watches:
        metadata["watches"] = watch_records(stream)
    return write_verified(path, tensors, metadata)


def engine_record(stream: Any, **more: Any) -> dict[str, Any]:
    """What a stream's file and its disk tier's ``stream.json`` record of its engine: the method, its policy,
    the attention backend it ran, ``more``, whether it was handed over (only when it was: a stream resumed past its
    handover streams under the cache layout's settings), CUDA graphs, the reserve after the video, and the engine
    settings whole."""
    return {"method": stream.qa.method, "policy": repr(stream.qa.policy), "attention": stream.prefill.attention,
            **more, **({"handed_over": True} if stream.handover == "handed over" else {}),
            "cuda_graph": bool(stream.engine.cuda_graph),
            "reserve_tokens": stream.reserve_tokens,
            "settings": stream.engine.to_dict()}


def load_stream(cls: type, path: str | Path, qa: Any, engine: EngineSettings, *, allow_other_weights: bool = False,
                stream_id: str | None = None, owner: str | None = None) -> Any:
    """`Stream.load` (see there): a stream of class ``cls`` from its file or its disk tier's folder, with the engine
    settings ``engine`` (checked against those it was saved with; its positions are the saved stream's)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"the stream to load must be a path (its file, or its disk tier's folder), got {path!r}")
    where = printable(path)
    if is_folder(path):
        return resume_stream(cls, Path(path), qa, allow_other_weights, stream_id=stream_id, owner=owner,
                             engine=engine)
    metadata, tensors = read_verified(path)
    check_ownership(path, metadata, stream_id, owner)
    check_same_setup(path, metadata, qa, allow_other_weights, engine)
    cache = {name[len("cache."):]: t for name, t in tensors.items() if name.startswith("cache.")}
    successor = {name[len("successor."):]: t for name, t in tensors.items() if name.startswith("successor.")}
    kept = {name: t for name, t in tensors.items() if name.startswith("watches.")}
    backlog = tensors.get(BACKLOG)
    pending = _pending_images(path, tensors, metadata["pending"], set(cache),
                              set(kept) | {f"successor.{name}" for name in successor} | ({BACKLOG} & set(tensors)))
    if successor and "successor" not in metadata:
        raise InputError(f"{where}: the stream file holds successor.* tensors but no successor record")
    if (backlog is None) != ("backlog" not in metadata):
        raise InputError(f"{where}: the stream file holds " + ("a backlog record but no backlog.inputs_embeds"
                                                               if backlog is None else
                                                               "backlog.inputs_embeds but no backlog record"))
    try:
        check_state_dict(cache, metadata["cache"], cache_geometry(qa.adapter.model), engine.kv_cache_dtype)
    except InputError as error:
        raise InputError(f"{where}: {error}") from None
    if "successor" in metadata:
        try:
            check_state_dict(successor, metadata["successor"], cache_geometry(qa.adapter.model),
                             engine.kv_cache_dtype)
        except InputError as error:
            raise InputError(f"{where}: the successor engine's state (successor.*): {error}") from None
    reserve = metadata["engine"]["reserve_tokens"]  # check_against_model holds it to the horizon
    check_values(path, metadata, tensors)  # what recomputed checksums cannot vouch for
    check_against_model(path, metadata, qa.adapter)
    recorded = recorded_settings(metadata)
    beside = "successor" in metadata or "backlog" in metadata
    if beside and engine.bounded_layout not in (None, HANDOVER, OWN_LAYOUT):
        raise InputError(f"{where}: the stream was saved with its successor engine beside it (bounded_layout="
                         f"{HANDOVER}); resume it with bounded_layout={HANDOVER} or the default")
    engine, handed_over = resumed_engine(engine.with_changes(positions=recorded.get("positions") or "stream"),
                                         recorded.get("bounded_layout"),
                                         (metadata["cache"].get("positions") or {}).get("layout"),
                                         metadata["engine"].get("handed_over") is True)
    try:
        stream = cls(qa, metadata["horizon_frames"], max_fps=metadata["max_fps"], name=metadata["name"],
                     vision_batch=metadata["vision_batch"], reserve_tokens=reserve,
                     prefix_tokens=metadata["prefix_tokens"], engine=engine,
                     stream_id=metadata.get("stream_id"), owner=owner, created=metadata.get("created"))
    except HorizonError as error:
        raise InputError(f"{where}: {error}") from None
    state = LayoutState.from_dict(metadata["state"])
    step_frames = _step_frames(metadata["cache"]["chunk_lengths"], stream.prefix_tokens, state.frames,
                               stream.adapter.frames_per_step)
    stream.state = state
    stream.stats = EncodingStats(**metadata["stats"])
    stream.pushed, stream.next_tick = metadata["pushed"], metadata["next_tick"]
    stream.last_timestamp = metadata["last_timestamp"]
    stream.kept_timestamp = metadata.get("kept_timestamp", stream.last_timestamp)  # absent: saved before it was kept
    stream.pending = [Frame(index, timestamp, image)
                      for (index, timestamp), image in zip(metadata["pending"], pending)]
    encoded = metadata.get("encoded_timestamp")
    stream.encoded_timestamp = _encoded_before(stream) if encoded is None else float(encoded)
    last = [stream.pushed - 1, stream.last_timestamp or 0.0]
    if stream.pending:  # the last frame streamed comes before the pending ones: a resume pushes them again
        last = [stream.pending[0].index - 1, stream.encoded_timestamp]
    stream.encoded_pushed = last[0] + 1
    loaded = loaded_record(state, last, stream.encoded_timestamp)
    try:
        if handed_over:
            stream.handover = "handed over"
        resume_successor(stream, metadata.get("successor"), successor, metadata.get("backlog"), backlog, path,
                         step_frames, loaded)
        stream.prefill.load_state_dict(cache, metadata["cache"])
        stream.keep_to_cap()  # resumed under a smaller cap than it was saved with, it may no longer keep one
    except InputError as error:
        stream.close()
        raise InputError(error.args[0] if str(error).startswith(where) else f"{where}: {error}") from None
    except BaseException:
        stream.close()
        raise
    stream.step_frames = step_frames
    # loaded into the disk tier: its new file set can itself be resumed, its watches with it (reopened first, so
    # the checkpoint the load takes keeps them: a kill before the next one still reopens them)
    try:
        restore_watches(stream, metadata.get("watches", []), kept, where=where)
        stream.durability.loaded(stream.prefill, stream.step_frames, loaded, stream.pending,
                                 successor=stream.successor is not None)
    except BaseException:
        stream.close()  # a file set that could not take the state is removed: nothing half-written stays
        raise
    return stream


def resume_successor(stream: Any, record: dict | None, tensors: dict[str, torch.Tensor], backlog_record: dict | None,
                     backlog: torch.Tensor | None, path: str | Path, step_frames: Sequence[int],
                     loaded: dict[str, Any]) -> None:
    """A resumed handover stream's successor (`statekv.api.handover`): the state of the steps it replayed
    (``record``, its metadata, and ``tensors``) loaded and its backlog (``backlog_record`` and ``backlog``)
    restored, or, saved with neither (its successor had been dropped, or it was streamed under own-then-cache),
    dropped: the stream streams on alone, as it was. (A stream that had handed over is resumed with the cache
    layout's engine alone, `statekv.api.handover.resumed_engine`.) ``step_frames``: the frames of each of the
    stream's steps; ``loaded``, what the journal record of the loaded state's last step adds
    (`statekv.api.durability.loaded_record`).

    Loaded into the disk tier, the successor's state goes into its file set, journaled, and the steps it has yet
    to replay are kept in memory with the frames each journals (the last with ``loaded``): the stream hands over
    as it would have, its folder resumable after the handover however it came. Its folder
    keeps the embeddings of the steps streamed from then on only, not those of every step that a folder resumed
    before the handover rebuilds its successor from (`statekv.api.durability.resume_stream` says so)."""
    where = printable(path)
    if stream.successor is None:
        return
    if record is None and backlog_record is None:
        stream.drop_successor("the saved stream kept no successor beside it", warn=False)
        return
    try:
        if record is not None:
            stream.successor.load_state_dict(tensors, record)
    except InputError as error:
        raise InputError(f"{where}: the successor engine's state (successor.*): {error}") from None
    if backlog_record is not None:
        embeddings = stream.adapter.language_embeddings.weight
        stream.backlog.restore(backlog, backlog_record["spans"], embeddings.shape[1], embeddings.dtype,
                               embeddings.device)
    if stream.durability.enabled:
        replayed = len(stream.successor.cache.chunk_lengths)  # with the backlog's, the stream's (`check_values`)
        records = deque({"frames": frames} for frames in step_frames[replayed:])  # their replays'
        if records:
            records[-1].update(loaded)
        if replayed:
            stream.successor.journal_loaded(step_frames[:replayed], {} if records else loaded)
        stream.backlog.records = records


def _encoded_before(stream: Any) -> float | None:
    """The last encoded frame's time, for a file saved before it was recorded: the last kept frame's when none
    waits; else a time before the first waiting frame (the tick before its own, under ``max_fps``), so that a
    resume takes the waiting frames again."""
    if not stream.pending:
        return stream.kept_timestamp
    first = stream.pending[0].timestamp
    if stream.max_fps is None:
        return math.nextafter(first, -math.inf)
    return max(0.0, (tick(first, stream.max_fps) - 1) / stream.max_fps)


def _step_frames(lengths: Sequence[int], prefix_tokens: int, frames: int, per_step: int) -> StepValues:
    """Frames of each step of a saved stream: none in the prompt prefix, ``per_step`` in the others (fewer in a
    last step completed by repetition) adding up to ``frames``; as runs (a few, however many steps)."""
    counts, steps = StepValues(), len(lengths)
    prefix = int(bool(steps and prefix_tokens))
    if prefix:
        counts.append(0)
    if steps > prefix:
        counts.extend_run(per_step, 0, steps - prefix - 1)
        counts.append(frames - per_step * (steps - prefix - 1))
    return counts


def _pending_images(path: str | Path, tensors: dict[str, torch.Tensor], pending: list, cache: set[str],
                    others: set[str] = frozenset()) -> list:
    """The pending frames' images ``[H, W, 3]`` uint8, refusing missing, malformed or unexpected tensors (the cache's
    and ``others``, the watches' and the successor's, are checked where they are read)."""
    where = printable(path)
    expected = {f"pending.{index}" for index in range(len(pending))} | set(others)
    unexpected = sorted(set(tensors) - expected - {f"cache.{name}" for name in cache})
    if unexpected:
        raise InputError(f"{where}: the stream file holds an unexpected tensor {unexpected[0]}")
    images = []
    for index in range(len(pending)):
        image = tensors.get(f"pending.{index}")
        if image is None:
            raise InputError(f"{where}: the stream file lacks pending.{index}, the image of a pending frame")
        if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[-1] != 3 or 0 in image.shape:
            raise InputError(f"{where}: pending.{index} is {image.dtype} {list(image.shape)}, not an RGB uint8 image "
                             "[H, W, 3]")
        images.append(image.numpy())
    return images
