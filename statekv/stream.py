"""Live streams: push frames as they arrive, ask at any time, save and resume.

    stream = qa.stream(horizon_frames=3600, max_fps=1)    # the RoPE horizon is fixed up front
    for image, t in camera:
        stream.push(image, t)                              # constant cost per kept frame
        if t > 60 and not asked:
            stream.ask("What has the person picked up so far?")   # the stream is not changed; keep pushing
    stream.save("desk.safetensors")                        # carried state + detailed cache + metadata
    stream = Stream.load("desk.safetensors", qa)           # continues bit-exactly

Families that put several frames in one step (Qwen3-VL: two) hold a pushed frame until its step is complete;
`ask` answers from the frames encoded so far, and `flush` encodes a waiting frame on its own (as the last
step of a finished video would be).

With ``vision_batch`` frames per vision-tower call (`VideoQA.stream`, default 1), pushed frames wait until a
batch is complete, so a frame waits for at most one batch; `ask` first encodes every complete step waiting.

`push` copies a frame that waits, so a camera loop may reuse one buffer. One stream is used by one thread at a
time: `push`, `flush`, `ask` and `save` from different threads take turns (a per-stream lock), each seeing the
stream as the previous call left it.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from .core.cache import check_state_dict
from .core.disk import DiskTier, read_file_set, resume
from .core.quantized import check_kv_cache_dtype
from .core.prefill import _geometry_fields, cache_geometry
from .errors import HorizonError, InputError
from .models import LayoutState
from .overlap import check_vision_batch, steps_per_batch
from .encoded import EncodedVideo, EncodingStats
from .stream_file import (FORMAT, FORMAT_VERSION, check_against_model, check_values, read_verified,
                          weights_fingerprint, write_verified)
from .stream_disk import SETUP, frames_lost, read_stream_setup, stream_setup
from .values import check_bool, check_int, check_number
from .video import Frame


log = logging.getLogger("statekv")


def _one_at_a_time(method):
    """Run ``method`` holding the stream's lock, so calls from different threads take turns."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class Stream(EncodedVideo):
    """A video encoded as it arrives (see the module docstring). Create it with `VideoQA.stream`.

    Attributes beyond `EncodedVideo`'s: ``horizon_frames`` (the most frames it can take; None: no horizon, it never
    ends), ``max_fps``, ``vision_batch``, ``pushed`` (frames offered), ``pending`` (kept frames waiting for their step
    or batch), ``reserve_tokens`` (room for a question and its answer).
    """

    def __init__(self, qa: Any, horizon_frames: int | None, *, max_fps: float | None = None, name: str = "stream",
                 vision_batch: int = 1, reserve_tokens: int | None = None, prefix_tokens: int | None = None,
                 kv_cache_dtype: str | None = None, disk_tier: Any = None):
        """prefix_tokens: when resuming (see `load`), the prompt prefix already streamed; None: `start` streams
        it (`VideoQA.stream` returns a started stream). kv_cache_dtype: ``"int8"``/``"int4"`` to store the
        detailed cache quantized, ``"auto"`` the model's dtype (default: the VideoQA's). disk_tier: when resuming
        a disk-tier stream, its file set."""
        if horizon_frames is not None:
            check_int(horizon_frames, "horizon_frames", error=InputError)
        if max_fps is not None:
            check_number(max_fps, "max_fps (or None to keep every frame)", error=InputError)
        vision_batch = check_vision_batch(vision_batch)
        max_fps = None if max_fps is None else float(max_fps)
        super().__init__(qa, qa.horizon_for(horizon_frames, reserve_tokens=reserve_tokens),
                         num_frames=horizon_frames, fps=max_fps, name=name, prefix_tokens=prefix_tokens,
                         kv_cache_dtype=kv_cache_dtype, disk_tier=disk_tier)
        self._lock = threading.RLock()
        self.horizon_frames = horizon_frames
        self.reserve_tokens = qa.reserve_tokens if reserve_tokens is None else reserve_tokens
        self.max_fps = max_fps
        self.vision_batch = vision_batch
        self.pushed = 0
        self.pending: list[Frame] = []
        self._next_tick = 0
        self._last_timestamp: float | None = None
        self.frames_lost = 0  # after `load`: frames pushed before a crash that were not durable
        self._groups: list[list[Frame]] = []  # the steps being encoded (for the disk tier's journal)
        self._steps_before = 0
        if self.prefill.disk is not None and disk_tier is None:
            self.prefill.disk.describe(SETUP, stream_setup(
                name, {**_model_identity(qa), "weights": weights_fingerprint(self.adapter.model)},
                {"method": qa.method, "policy": repr(qa.policy), "attention": self.prefill.attention,
                 "cuda_graph": bool(qa.cuda_graph), "reserve_tokens": self.reserve_tokens},
                horizon=self.horizon, horizon_frames=horizon_frames, max_fps=self.max_fps,
                prefix_tokens=self.prefix_tokens, vision_batch=self.vision_batch,
                kv_cache_dtype=self.prefill.kv_cache_dtype, positions=self.prefill.positions.mode))

    @_one_at_a_time
    def start(self) -> "Stream":
        return super().start()

    # -- pushing ----------------------------------------------------------------------------------------
    @_one_at_a_time
    def push(self, image: Any, timestamp: float | None = None) -> bool:
        """Offer one frame; return whether it was kept (``max_fps`` drops frames between its ticks).

        image: RGB uint8 array ``[H, W, 3]``, a PIL image, or a `Frame` (whose timestamp is used).
        timestamp: seconds since the stream began, non-decreasing; default: one ``1 / max_fps`` (or 1 s)
            after the previous frame.

        Pushes to several streams of one `VideoQA` from different threads share batched steps (see
        `VideoQA.push_many`); this call still returns once its frame is streamed or safely pending.
        """
        kept, timestamp, ready = self._offer(image, timestamp)
        if ready:
            try:
                self._encode_pending()
            except BaseException:
                self.pending.pop()  # a failed push does not take its frame (earlier ones stay encoded or pending)
                raise
        self._accepted(kept, timestamp)
        return kept

    def _offer(self, image: Any, timestamp: float | None) -> tuple[bool, float, bool]:
        """The checks of `push` and, for a kept frame, its place in ``pending``: ``(kept, timestamp, a batch is
        ready to encode)``. Nothing else changes until `_accepted`."""
        if isinstance(image, Frame):
            timestamp = image.timestamp if timestamp is None else timestamp
            image = image.image
        timestamp = self._check_timestamp(timestamp)
        pixels = _rgb_array(image)
        if self.max_fps is not None:
            tick = math.floor(timestamp * self.max_fps + 1e-9)  # the epsilon keeps k / fps itself on tick k
            if tick < self._next_tick:
                return False, timestamp, False
        kept = self.state.frames + len(self.pending)
        if self.horizon_frames is not None and kept + 1 > self.horizon_frames:
            raise HorizonError(f"{self.name}: the stream was declared for {self.horizon_frames} frames; create it "
                               "with a larger horizon_frames to push more")
        # a copy: the caller may refill its buffer (a camera loop) while this frame waits for its step or batch
        self.pending.append(Frame(self.pushed, timestamp, np.array(pixels, copy=True)))
        if self.prefill.disk is not None:  # kept: a resumed stream counts it lost unless a step journals it
            self.prefill.disk.append({"push": self.pushed, "t": timestamp})
        return True, timestamp, len(self.pending) == self._batch_frames

    def _accepted(self, kept: bool, timestamp: float) -> None:
        """Only now, with the frame encoded, safely queued or dropped, does the stream advance."""
        self.pushed += 1
        self._last_timestamp = timestamp
        if kept and self.max_fps is not None:
            self._next_tick = math.floor(timestamp * self.max_fps + 1e-9) + 1

    def push_many(self, frames: Any) -> int:
        """Push ``(image, timestamp)`` pairs or `Frame` objects in order; return how many were kept."""
        kept = 0
        for item in frames:
            kept += self.push(item) if isinstance(item, Frame) else self.push(*item)
        return kept

    @_one_at_a_time
    def flush(self) -> None:
        """Encode frames still waiting for their step or batch (an incomplete step is completed by repetition)."""
        if self.pending:
            self._encode_pending()

    @_one_at_a_time
    def ask_tokens(self, question: str, **ask_kwargs: Any) -> torch.Tensor:
        """As `EncodedVideo.ask_tokens`, after encoding every complete step still waiting for its batch."""
        self._encode_pending(complete_steps_only=True)
        return super().ask_tokens(question, **ask_kwargs)

    @property
    def _batch_frames(self) -> int:
        """Pending frames that make a batch: whole steps, at least one."""
        per_step = self.adapter.frames_per_step
        return steps_per_batch(self.vision_batch, per_step) * per_step

    def _encode_pending(self, complete_steps_only: bool = False) -> None:
        """Encode the pending frames, one vision call for all; steps streamed before a failure stay streamed,
        the frames of the others keep waiting."""
        per_step = self.adapter.frames_per_step
        count = len(self.pending) // per_step * per_step if complete_steps_only else len(self.pending)
        groups = [self.pending[start:start + per_step] for start in range(0, count, per_step)]
        if not groups:
            return
        steps_before = self.stats.chunks
        self.streaming_groups(groups)
        scheduler = getattr(self.qa, "step_scheduler", None)  # batches steps pushed from other threads meanwhile
        try:
            if scheduler is None:
                self._append_steps(groups, vision_batch=self.vision_batch)
            else:
                scheduler.stream(self, groups)
        finally:
            streamed = self.stats.chunks - steps_before
            self.pending = self.pending[sum(len(group) for group in groups[:streamed]):]

    @_one_at_a_time
    def close(self) -> None:
        scheduler = getattr(self.qa, "step_scheduler", None)
        if scheduler is not None:
            scheduler.forget(self)  # batches recorded with this stream (CUDA graphs) are released
        super().close()

    def streaming_groups(self, groups: list[list[Frame]]) -> None:
        """The steps about to be streamed (each a list of frames): what the disk tier journals with them."""
        self._groups, self._steps_before = groups, self.stats.chunks

    def _durable_record(self, after: LayoutState, chunk: Any) -> dict[str, Any]:
        record = super()._durable_record(after, chunk)
        groups = getattr(self, "_groups", None)  # unset while the constructor streams the prompt prefix
        if groups:
            last = groups[self.stats.chunks - self._steps_before][-1]
            record["last_frame"] = [last.index, last.timestamp]
        return record

    def _check_timestamp(self, timestamp: float | None) -> float:
        if timestamp is None:
            step = 1.0 / self.max_fps if self.max_fps else 1.0
            return 0.0 if self._last_timestamp is None else self._last_timestamp + step
        check_number(timestamp, "timestamp (seconds)", minimum=-math.inf, error=InputError)
        if timestamp < 0 or (self._last_timestamp is not None and timestamp < self._last_timestamp):
            raise InputError(f"timestamps must be >= 0 and non-decreasing; got {timestamp} after "
                             f"{self._last_timestamp}")
        return float(timestamp)

    # -- saving -----------------------------------------------------------------------------------------
    @_one_at_a_time
    def save(self, path: str | Path) -> Path:
        """Write the stream (carried state, detailed cache, pending frames, metadata, checksums, the weights'
        fingerprint) to one safetensors file (see `statekv.stream_file`); an `OutputError` when it cannot be
        written there (a folder, an unwritable place, a full disk), leaving nothing behind."""
        self.prefill.check_open()
        self.start()
        if self.prefill.seen_tokens == 0:
            raise InputError(f"{self.name}: nothing is encoded yet to save (the {len(self.pending)} frame(s) pushed "
                             f"wait for a batch of {self._batch_frames}); push more frames or flush() first")
        self.prefill.sync()  # a disk-tier stream's file set is durable as of this save too
        tensors, cache_metadata = self.prefill.state_dict()
        tensors = {f"cache.{name}": tensor for name, tensor in tensors.items()}
        for index, frame in enumerate(self.pending):
            tensors[f"pending.{index}"] = torch.from_numpy(np.ascontiguousarray(frame.image))
        metadata = {
            "format": FORMAT, "version": FORMAT_VERSION, "name": self.name,
            "model": {**_model_identity(self.qa), "weights": weights_fingerprint(self.adapter.model)},
            "engine": {"method": self.qa.method, "policy": repr(self.qa.policy), "attention": self.prefill.attention,
                       "offload": bool(self.qa.offload), "cuda_graph": bool(self.qa.cuda_graph),
                       "reserve_tokens": self.reserve_tokens},
            "horizon": self.horizon, "horizon_frames": self.horizon_frames, "max_fps": self.max_fps,
            "prefix_tokens": self.prefix_tokens, "vision_batch": self.vision_batch,
            "pushed": self.pushed, "next_tick": self._next_tick, "last_timestamp": self._last_timestamp,
            "pending": [[frame.index, frame.timestamp] for frame in self.pending],
            "state": self.state.to_dict(), "stats": {k: v for k, v in self.stats.to_dict().items()
                                                     if k in EncodingStats.__dataclass_fields__},
            "cache": cache_metadata,
        }
        return write_verified(path, tensors, metadata)

    @classmethod
    def load(cls, path: str | Path, qa: Any, *, allow_other_weights: bool = False,
             kv_cache_dtype: str | None = None) -> "Stream":
        """Resume a stream saved by `save` with ``qa`` (the same model, layout and method it was saved with).

        The whole file is verified first (schema, every tensor's presence, dtype, shape and checksum, the model
        and method), so a damaged or foreign file is refused with a one-line `InputError` before anything is
        built. A stream saved with other weights (another checkpoint of the same architecture) is refused unless
        ``allow_other_weights=True``: its cache would not be what this model computes. kv_cache_dtype: how the
        saved detailed cache is stored (default: the VideoQA's); a file stored otherwise is refused.

        ``path`` may also be the folder of a disk-tier stream's file set (``offload="disk"``), e.g. after its
        process was killed: the stream resumes in it from the last step whose data is durable, every step's
        checksum verified first, and ``frames_lost`` (also stated in one log line) counts the frames pushed
        after that step. A damaged or foreign file set is refused with one line.
        """
        check_bool(allow_other_weights, "allow_other_weights")
        if Path(path).is_dir():
            return _resume_disk(cls, Path(path), qa, allow_other_weights)
        metadata, tensors = read_verified(path)
        stored_as = (getattr(qa, "kv_cache_dtype", None) if kv_cache_dtype is None
                     else check_kv_cache_dtype(kv_cache_dtype))
        _check_same_setup(path, metadata, qa, allow_other_weights, stored_as)
        cache = {name[len("cache."):]: t for name, t in tensors.items() if name.startswith("cache.")}
        pending = _pending_images(path, tensors, metadata["pending"], set(cache))
        try:
            check_state_dict(cache, metadata["cache"], cache_geometry(qa.adapter.model), stored_as)
        except InputError as error:
            raise InputError(f"{path}: {error}") from None
        reserve = metadata["engine"]["reserve_tokens"]  # check_against_model holds it to the horizon
        check_values(path, metadata, tensors)  # what recomputed checksums cannot vouch for
        check_against_model(path, metadata, qa.adapter)
        try:
            stream = cls(qa, metadata["horizon_frames"], max_fps=metadata["max_fps"], name=metadata["name"],
                         vision_batch=metadata["vision_batch"], reserve_tokens=reserve,
                         prefix_tokens=metadata["prefix_tokens"], kv_cache_dtype=stored_as or "auto")
        except HorizonError as error:
            raise InputError(f"{path}: {error}") from None
        try:
            stream.prefill.load_state_dict(cache, metadata["cache"])
        except BaseException:
            stream.close()
            raise
        stream.state = LayoutState.from_dict(metadata["state"])
        stream.stats = EncodingStats(**metadata["stats"])
        stream.pushed, stream._next_tick = metadata["pushed"], metadata["next_tick"]
        stream._last_timestamp = metadata["last_timestamp"]
        stream.pending = [Frame(index, timestamp, image)
                          for (index, timestamp), image in zip(metadata["pending"], pending)]
        stream.step_frames = _step_frames(metadata["cache"]["chunk_lengths"], stream.prefix_tokens,
                                          stream.state.frames, stream.adapter.frames_per_step)
        if stream.prefill.disk is not None:  # loaded into the disk tier: its new file set can itself be resumed
            encoded = [frame for frame in metadata["pending"]]
            last = [stream.pushed - 1, stream._last_timestamp or 0.0]
            if encoded:  # the last frame streamed comes before the pending ones
                last = [int(encoded[0][0]) - 1, float(encoded[0][1])]
            stream.prefill.disk.journal_loaded(stream.prefill.cache, stream.step_frames, {
                "state": stream.state.to_dict(), "last_frame": last}, stream.prefill.positions.export().get("steps"))
            for frame in stream.pending:  # waiting in the file, not in the file set
                stream.prefill.disk.append({"push": frame.index, "t": frame.timestamp})
        return stream


def _step_frames(lengths: list[int], prefix_tokens: int, frames: int, per_step: int) -> list[int]:
    """Frames of each step of a saved stream: none in the prompt prefix, ``per_step`` in the others (fewer in a
    last step completed by repetition) adding up to ``frames``."""
    counts = [0 if index == 0 and prefix_tokens else per_step for index in range(len(lengths))]
    if counts and counts[-1]:
        counts[-1] -= sum(counts) - frames
    return counts


def _resume_disk(cls: type, folder: Path, qa: Any, allow_other_weights: bool) -> "Stream":
    """`Stream.load` of a disk-tier stream's file set (see there)."""
    journal = read_file_set(folder)
    setup = read_stream_setup(folder)
    _check_same_setup(folder, {**setup, "cache": {"kv_cache_dtype": setup["kv_cache_dtype"]}}, qa,
                      allow_other_weights, check_kv_cache_dtype(getattr(qa, "kv_cache_dtype", None)))
    geometry = cache_geometry(qa.adapter.model)
    made = journal.manifest.get("geometry")
    if made != _geometry_fields(geometry):
        raise InputError(f"{folder}: made for a cache of {made}, but this model's is {_geometry_fields(geometry)}")
    if not journal.steps:
        raise InputError(f"{folder}: no step of this stream was durable yet; there is nothing to resume")
    last = journal.steps[-1]
    if not isinstance(last.get("state"), dict):
        raise InputError(f"{folder}: the disk cache's journal is damaged: its last step lacks the stream's state")
    check_against_model(folder, {"horizon": setup["horizon"], "horizon_frames": setup["horizon_frames"],
                                 "engine": setup["engine"], "max_fps": setup["max_fps"],
                                 "prefix_tokens": setup["prefix_tokens"],
                                 "cache": {"chunk_lengths": [r["tokens"] for r in journal.steps]},
                                 "state": {"frames": last["state"].get("frames")}}, qa.adapter)
    tier = DiskTier(folder, journal.manifest)
    try:
        stream = cls(qa, setup["horizon_frames"], max_fps=setup["max_fps"], name=setup["name"],
                     vision_batch=setup["vision_batch"], reserve_tokens=setup["engine"]["reserve_tokens"],
                     prefix_tokens=setup["prefix_tokens"], kv_cache_dtype=setup["kv_cache_dtype"] or "auto",
                     disk_tier=tier)
    except BaseException:
        tier.close()
        raise
    try:
        resume(tier, journal, stream.prefill.cache, stream.prefill.device)
        stream.state = LayoutState.from_dict(last["state"])
    except BaseException:
        stream.close()
        raise
    if stream.prefill.keeper is not None:
        stream.prefill.keeper.adopt()
    stream.step_frames = [int(record.get("frames", 0)) for record in journal.steps]
    engine = stream.prefill.stats
    stream.stats = EncodingStats(frames=stream.state.frames, tokens=engine.tokens, chunks=engine.steps,
                                 carried_tokens=engine.max_carried_tokens, cache_bytes=engine.detailed_bytes,
                                 evicted_frames=sum(stream.step_frames[s] for s in set(journal.evicted)))
    framed = [record["last_frame"] for record in journal.steps if isinstance(record.get("last_frame"), list)]
    if framed:
        index, timestamp = framed[-1]
        stream.pushed, stream._last_timestamp = int(index) + 1, float(timestamp)
        if stream.max_fps is not None:
            stream._next_tick = math.floor(timestamp * stream.max_fps + 1e-9) + 1
    stream.frames_lost = frames_lost(journal.after, stream.pushed)
    log.warning("%s: resumed from %s at frame %d; %d frame(s) pushed after it were not durable and are lost",
                stream.name, folder, stream.frames, stream.frames_lost)
    return stream


def _model_identity(qa: Any) -> dict[str, Any]:
    config = qa.adapter.model.config
    text = config.get_text_config()
    return {"family": qa.adapter.family, "layout": qa.adapter.layout, "model_type": config.model_type,
            "name_or_path": str(getattr(config, "_name_or_path", "")), "layers": text.num_hidden_layers,
            "hidden_size": text.hidden_size, "dtype": str(qa.adapter.dtype).removeprefix("torch.")}


def _check_same_setup(path: str | Path, metadata: dict[str, Any], qa: Any, allow_other_weights: bool,
                      kv_cache_dtype: str | None) -> None:
    saved, current = metadata["model"], _model_identity(qa)
    for key in ("family", "model_type", "layout", "layers", "hidden_size", "dtype"):
        if saved[key] != current[key]:
            raise InputError(f"{path}: saved with {key} {saved[key]!r}, but this VideoQA has {current[key]!r}")
    stored = metadata["cache"].get("kv_cache_dtype")
    if stored != kv_cache_dtype:
        raise InputError(f"{path}: saved with kv_cache_dtype={stored or 'auto'}, but it is being loaded as "
                         f"{kv_cache_dtype or 'auto'}; load it with kv_cache_dtype={stored or 'auto'}")
    policy = metadata["engine"]["policy"]
    if policy != repr(qa.policy):
        raise InputError(f"{path}: saved with {policy}, but this VideoQA uses {qa.policy!r}")
    if not allow_other_weights and saved["weights"] != weights_fingerprint(qa.adapter.model):
        raise InputError(f"{path}: saved with other weights ({saved['name_or_path'] or 'another checkpoint'}) "
                         "than this model's, whose cache would differ; pass allow_other_weights=True to load "
                         "it anyway")


def _pending_images(path: str | Path, tensors: dict[str, torch.Tensor], pending: list, cache: set[str]) -> list:
    """The pending frames' images ``[H, W, 3]`` uint8, refusing missing, malformed or unexpected tensors."""
    expected = {f"pending.{index}" for index in range(len(pending))}
    unexpected = sorted(set(tensors) - expected - {f"cache.{name}" for name in cache})
    if unexpected:
        raise InputError(f"{path}: the stream file holds an unexpected tensor {unexpected[0]}")
    images = []
    for index in range(len(pending)):
        image = tensors.get(f"pending.{index}")
        if image is None:
            raise InputError(f"{path}: the stream file lacks pending.{index}, the image of a pending frame")
        if image.dtype != torch.uint8 or image.dim() != 3 or image.shape[-1] != 3 or 0 in image.shape:
            raise InputError(f"{path}: pending.{index} is {image.dtype} {list(image.shape)}, not an RGB uint8 image "
                             "[H, W, 3]")
        images.append(image.numpy())
    return images


def _rgb_array(image: Any) -> np.ndarray:
    """A pushed frame as an RGB uint8 array ``[H, W, 3]``."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8 or 0 in array.shape:
        raise InputError(f"a frame must be an RGB uint8 array [H, W, 3] or a PIL image, got {array.dtype} "
                         f"{list(array.shape)}")
    return array
