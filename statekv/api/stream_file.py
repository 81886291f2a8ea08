"""The file a `Stream` is saved to: safetensors tensors and JSON metadata, every part verified before it is used.

Stream format 3 (`FORMAT_VERSION`). The safetensors header's metadata holds two strings:

    statekv          the stream's metadata as JSON (fields: `SCHEMA`)
    statekv_sha256   the SHA-256 of that JSON text

and the metadata records ``checksums`` (the SHA-256 of every tensor's bytes, by name), the model it was saved with
(``model``: family, layout, dtype and a fingerprint of its weights, `weights_fingerprint`) and the engine
(``engine``: the method, its policy and, whole, the `EngineSettings` it streamed with, ``engine.settings``; files
saved before it was recorded lack it). `check_same_setup` refuses a file whose model, policy or binding settings
(those its state depends on) differ from the `VideoQA` loading it. `read_verified` checks the header, the checksums
and the schema, and `check_schema` every field's presence, type and range; `check_values` and `check_against_model`
then check the values themselves (finite tensors, carried tokens that are the cache's own, a horizon, prefix and
steps this model would have written), since checksums recomputed after an edit vouch for nothing. A damaged or
hand-edited file is refused with one line before anything is built from it. Format 1 (written before verification
existed) is refused with a message saying so. Format 3 keeps the lists with an entry per step as runs
(`statekv.api.step_lists`); format 2 files, which list them whole, are read as well.

The push clock is checked against itself too: ``max_fps``, ``next_tick``, ``last_timestamp``, the pending frames'
times and the frames kept must be what pushing at that rate leaves, and the layout state must be what the model
starts a stream of that rate with. (Checksums are recomputable, so a field no other field is checked against can
be forged: ``max_fps`` was one.)

Who a stream is (``stream_id``, ``created``, ``owner_digest``, ``installation``; `OWNERSHIP`) is recorded and
checked by `statekv.api.stream_identity`.

A file is written in a folder ``<name>.<random>.partial`` beside the target (a name of its own: no two saves ever
write one; the temporary file safetensors makes lies in it too) and renamed over the target only once complete and
flushed to the disk, under the exclusive lock of ``<name>.lock`` (removed when the save ends): a second save to the
same file at the same time is refused with one line naming the holder. Just before the rename the save checks that
``<name>.lock`` is still the file it locked; if it was removed or replaced meanwhile (another save may then have
taken it), the save is refused and the target is left as it was. What saves killed before their rename left is
removed by the next save to the same file. (Where ``<name>`` and those suffixes would pass the 255 bytes a file
name may take, they follow its first 200 bytes and a digest of the whole instead.)
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..settings.engine import EngineSettings
from .handover import OWN_LAYOUT, SUCCESSOR_LAYOUT
from .json_checks import (dataclass_check, integer_check, list_check, number_check, optional_check, record_check,
                          type_check)
from .stats import EncodingStats
from .step_lists import compacted, held, held_check, shown, step_set, steps_of
from ..errors import InputError, OtherSetupError, OutputError
from ..flushing import flush_file, flush_folder
from ..locks import FileLock
from ..core.storage.step_values import StepValues
from ..models import LayoutState
from ..settings.values import HIGHEST_FPS, LATEST_TIMESTAMP, check_output_file, printable
from ..video.sampling import tick

FORMAT = "statekv-stream"
FORMAT_VERSION = 3  # 2: the per-step lists listed whole (still read)
READ_VERSIONS = (2, FORMAT_VERSION)
FINGERPRINT_SAMPLES = 256  # elements read from each parameter for the weights fingerprint
MAX_METADATA_CHARS = 64 << 20  # the per-step lists in runs (`step_lists`): a steady stream's stay small at any age
PARTIAL = re.compile(r"\.[0-9a-f]{8}\.partial")  # what follows the target's name in a save's partial file

# -- checksums and fingerprints ---------------------------------------------------------------------------------
def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a CPU tensor's bytes (row-major; the dtype and shape are checked apart)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A SHA-256 over every parameter's name, shape, dtype and `FINGERPRINT_SAMPLES` evenly spaced elements.

    Two checkpoints of one architecture (a fine-tune, another size's sibling) differ in almost every element of
    their trained matrices, so the samples tell them apart; reading a few hundred bytes per tensor keeps it
    cheap for an 8B model (milliseconds). Independent of the device the weights are on."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype};".encode())
        if parameter.device.type == "meta":
            continue
        flat = parameter.detach().reshape(-1)
        if flat.numel() > FINGERPRINT_SAMPLES:
            index = torch.arange(FINGERPRINT_SAMPLES) * flat.numel() // FINGERPRINT_SAMPLES
            flat = flat.index_select(0, index.to(flat.device))
        digest.update(tensor_sha256(flat.to("cpu")).encode())
    return digest.hexdigest()


# -- writing and reading --------------------------------------------------------------------------------------
def write_verified(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: dict[str, Any]) -> Path:
    """Write ``tensors`` and ``metadata`` (with the tensors' checksums added) to ``path`` through a ``.partial``
    folder beside it; an `OutputError` naming the reason when it cannot be written (nothing is left behind)."""
    path = check_output_file(path, "stream file")
    where = printable(path)
    on_cpu = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    metadata = {**metadata, "checksums": {name: tensor_sha256(tensor) for name, tensor in on_cpu.items()}}
    text = json.dumps(compacted(metadata), allow_nan=False)
    if len(text) > MAX_METADATA_CHARS:  # a file that could not be read back is not written
        raise OutputError(f"cannot save the stream to {where}: its metadata is {len(text):,} characters, more than a "
                          f"saved stream holds ({MAX_METADATA_CHARS:,}); {UNCHANGED}")
    # a folder of its own: two saves never share one, even if the lock below is broken, and the temporary file
    # safetensors writes beside its target lies in it, so a save killed at any point leaves one thing to remove
    partial = path.with_name(f"{_stem(path)}.{secrets.token_hex(4)}.partial")
    written = partial / path.name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"cannot save the stream to {where}: {_reason(error)}; {UNCHANGED}") from None
    lock = FileLock.acquire(path.with_name(_stem(path) + ".lock"), what=f"{where} (being saved)",
                            error=OutputError, advice="wait for that save to end, or save elsewhere",
                            remove=True)
    renamed = False
    try:
        _remove_stale_partials(path)
        partial.mkdir()
        save_file(on_cpu, str(written), metadata={"statekv": text, "statekv_sha256": _sha256(text)})
        flush_file(written)  # before the rename
        if not lock.owns():
            raise _lock_lost(path)
        os.replace(written, path)
        renamed = True
        flush_folder(path.parent)  # the new name, not only the data: a power loss then keeps this save
    except (OSError, SafetensorError) as error:
        if isinstance(error, OutputError):
            raise
        if renamed:  # the file there is this save's now, but its name is not on the device
            raise OutputError(f"cannot save the stream to {where}: its folder could not be forced to the device "
                              f"({_reason(error)}); the file there now is this save, but a power loss may bring back "
                              "the one it replaced (or none): save again once the folder can be written") from None
        if not lock.owns():  # the save that took the name may have removed this one's folder as a stale one
            raise _lock_lost(path) from None
        raise OutputError(f"cannot save the stream to {where}: {_reason(error)}; {UNCHANGED}") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)
        lock.release()
    return path


def _lock_lost(path: Path) -> OutputError:
    """The save's lock file was removed or replaced while it wrote: another save may own the name now."""
    return OutputError(f"cannot save the stream to {printable(path)}: its lock file was removed or replaced while "
                       f"it was written, and another save may be writing there; {UNCHANGED}")


def _stem(path: Path) -> str:
    """What a save's lock and partial folder beside ``path`` are named after: its name, or, where that name and
    their suffixes would pass the 255 bytes a file name may take, its start and a digest of the whole."""
    name = os.fsencode(path.name)
    if len(name) <= 255 - len(".00000000.partial"):
        return path.name
    return name[:200].decode("utf-8", "ignore") + "~" + hashlib.sha256(name).hexdigest()[:16]


def _remove_stale_partials(path: Path) -> None:
    """Remove what saves to ``path`` killed before their rename left (``<name>.<hex>.partial``, a folder, or a
    file from before saves wrote in folders); called under its lock, so no live save's partial is among them."""
    for stale in path.parent.glob(f"{glob.escape(_stem(path))}.*.partial"):
        if PARTIAL.fullmatch(stale.name[len(_stem(path)):]):
            try:
                if stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale)
                else:
                    stale.unlink()
            except OSError:
                pass


UNCHANGED = "nothing was written there (a file already there is as it was) and the stream is unchanged"


def read_verified(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The metadata and tensors of a stream file, once the header, every tensor's checksum and the schema
    (`check_schema`) are verified; a one-line `InputError` naming the first problem otherwise."""
    path = Path(path)
    metadata, tensors = _read(path, with_tensors=True)
    checksums = metadata["checksums"]
    missing, unlisted = sorted(set(checksums) - set(tensors)), sorted(set(tensors) - set(checksums))
    if missing or unlisted:
        what = f"lacks tensor {missing[0]}" if missing else f"holds a tensor it does not list, {unlisted[0]}"
        raise InputError(f"{printable(path)}: the stream file {what}")
    for name, tensor in tensors.items():
        if tensor_sha256(tensor) != checksums[name]:
            raise InputError(f"{printable(path)}: tensor {name} is corrupt (its checksum does not match); the file "
                             "was damaged after it was saved")
    return metadata, tensors


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a stream file, once its header and schema are verified, without reading its tensors (which
    `read_verified` verifies too); a one-line `InputError` naming the first problem otherwise."""
    return _read(Path(path), with_tensors=False)[0]


def _read(path: Path, with_tensors: bool) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    where = printable(path)
    if not path.is_file():
        raise InputError(f"{where}: " + ("not a regular file; a saved stream is one" if path.exists() else
                                        "no such saved stream"))
    try:
        open(path, "rb").close()  # safetensors says a file it may not read is missing
    except OSError as error:
        raise InputError(f"{where}: cannot be read ({error.strerror or error})") from None
    try:
        with safe_open(str(path), "pt") as handle:
            header = handle.metadata() or {}
            text = header.get("statekv")
            if not isinstance(text, str):
                raise InputError(f"{where}: not a saved statekv stream (no statekv metadata)")
            if len(text) > MAX_METADATA_CHARS:
                raise InputError(f"{where}: the stream's metadata is {len(text)} characters, more than a saved "
                                 f"stream holds ({MAX_METADATA_CHARS})")
            try:
                metadata = json.loads(text)
            except RecursionError:
                raise InputError(f"{where}: malformed stream metadata (JSON nested too deeply)") from None
            _check_format(path, metadata)
            if header.get("statekv_sha256") != _sha256(text):
                raise InputError(f"{where}: the stream's metadata is corrupt (its checksum does not match)")
            metadata = held(metadata, where)  # as runs: no list a step
            tensors = {name: handle.get_tensor(name) for name in handle.keys()} if with_tensors else {}
    except (SafetensorError, OSError, ValueError) as error:
        if isinstance(error, InputError):
            raise
        raise InputError(f"{where}: not a saved statekv stream ({_reason(error)})") from None
    check_schema(metadata, where=where)
    return metadata, tensors


def check_values(path: str | os.PathLike, metadata: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """What checksums cannot vouch for (a file edited and its checksums recomputed): the values themselves.

    Every floating-point tensor finite; each layer's carried positions strictly increasing (each token carried
    once, in order) with the carried keys and values those of the detailed cache at those positions; the
    pending frames in push order before the last timestamp. The model-dependent checks (horizon, prompt
    prefix, step lengths) are `check_against_model`'s."""
    where = printable(path)
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise InputError(f"{where}: tensor {name} holds NaN or infinite values")
    for name, positions in tensors.items():
        if not name.endswith(".carried_positions") or positions.shape[-1] < 1:
            continue
        if positions.shape[-1] > 1 and not bool((positions[..., 1:] > positions[..., :-1]).all()):
            raise InputError(f"{where}: {name} must list each carried token once, in increasing order")
        layer = name[: -len("carried_positions")]
        keys, values = tensors.get(layer + "keys"), tensors.get(layer + "values")
        released = tensors.get(layer + "keys.released")  # runs of rows saved without (`host_pages.saved_rows`)
        if keys is None or values is None or keys.dim() != 4 or int(positions.min()) < 0:
            continue  # `check_state_dict` names the missing or malformed tensor
        if released is not None:
            positions = saved_rows(positions, released)
            if positions is None:
                raise InputError(f"{where}: {name} lists a token its layer gave back ({layer}keys.released)")
        if int(positions.max()) >= keys.shape[2]:
            continue
        index = positions.unsqueeze(-1).expand(*positions.shape, keys.shape[-1])
        for kind, detailed in (("keys", keys), ("values", values)):
            carried = tensors.get(f"{layer}carried_{kind}")
            if carried is not None and carried.shape == index.shape and \
                    not torch.equal(detailed.gather(2, index), carried):
                raise InputError(f"{where}: {layer}carried_{kind} are not the detailed cache's {kind} at the carried "
                                 "positions")
    pending, pushed, last = metadata["pending"], metadata["pushed"], metadata["last_timestamp"]
    if (last is None) != (pushed == 0):
        raise InputError(f"{where}: malformed stream metadata: last_timestamp {last!r} after {pushed} pushed frames")
    for field in ("kept_timestamp", "encoded_timestamp"):
        if metadata.get(field) is not None and metadata[field] > (last or 0.0):
            raise InputError(f"{where}: malformed stream metadata: {field} {metadata[field]} is after the last "
                             f"timestamp {last}")
    for number, (index, timestamp) in enumerate(pending):
        previous = pending[number - 1] if number else None
        if (index != int(index) or index >= pushed or timestamp > (last or 0.0)
                or (previous is not None and (index <= previous[0] or timestamp < previous[1]))):
            raise InputError(f"{where}: malformed stream metadata: pending[{number}] = {[index, timestamp]} is not a "
                             f"frame pushed in order before the last timestamp {last}")
    check_clock(path, metadata)


def saved_rows(positions: torch.Tensor, released: torch.Tensor) -> torch.Tensor | None:
    """Where tokens ``positions`` (any shape) lie among the rows a tensor saved without its ``released`` runs
    (LongTensor ``[R, 2]``, checked) holds; None if one of them was released."""
    starts, ends = released[:, 0].contiguous(), released[:, 1].contiguous()
    before = torch.cat([ends.new_zeros(1), (ends - starts).cumsum(0)])
    runs = torch.searchsorted(ends, positions, right=True)  # the runs ending at or before each position
    inside = runs < len(starts)
    if bool((positions[inside] >= starts[runs[inside]]).any()):
        return None
    return positions - before[runs]


def check_clock(path: str | os.PathLike, metadata: dict[str, Any]) -> None:
    """The push clock as pushing leaves it: without ``max_fps`` every frame pushed is kept and ``next_tick`` stays
    0; at ``max_fps`` every kept frame has a tick (`statekv.video.sampling.tick`; in a file written before that
    rule, `_fixed_slack_tick`) of its own, the pending ones in increasing order, and ``next_tick`` follows the tick
    of the last frame pushed."""
    where = printable(path)
    fps, next_tick, last = metadata["max_fps"], metadata["next_tick"], metadata["last_timestamp"]
    pushed = metadata["pushed"]
    kept = metadata["state"]["frames"] + len(metadata["pending"])
    clock = f"max_fps {fps}, next_tick {next_tick}, last_timestamp {last}, {pushed} pushed and {kept} kept"
    if fps is None:
        fault = "without max_fps every frame pushed is kept" if kept != pushed else \
            None if next_tick == 0 else "next_tick would be 0"
    else:
        faults = [_tick_fault(metadata, rule) for rule in (tick, _fixed_slack_tick)]
        fault = None if None in faults else faults[0]
    if fault is not None:
        raise InputError(f"{where}: malformed stream metadata: the push clock does not hold ({clock}): {fault}")


def _tick_fault(metadata: dict[str, Any], rule: Callable[[float, float], int]) -> str | None:
    """What does not hold of a clock at ``max_fps`` whose frames are put on ticks by ``rule`` (None: it holds)."""
    fps, last = metadata["max_fps"], metadata["last_timestamp"]
    kept = metadata["state"]["frames"] + len(metadata["pending"])
    expected = 0 if last is None else rule(last, fps) + 1
    ticks = [rule(seconds, fps) for _, seconds in metadata["pending"]]
    if kept > expected or any(b <= a for a, b in zip(ticks, ticks[1:])) or (ticks and ticks[-1] >= expected):
        return "at max_fps each kept frame has a tick of its own"
    return None if metadata["next_tick"] == expected else f"next_tick would be {expected}"


def _fixed_slack_tick(seconds: float, rate: float) -> int:
    """The tick a file written before `tick` put a frame on: a fixed slack, which left a time within a few ulps
    below a tick (an epoch's) on the tick before."""
    return math.floor(seconds * rate + 1e-9)


def check_against_model(path: str | os.PathLike, metadata: dict[str, Any], adapter: Any) -> None:
    """The fields that depend on the model, recomputed from it: the horizon (the frames' tokens plus the
    reserve), the prompt prefix's length, and every step's length and count."""
    where = printable(path)
    frames_per_step = adapter.frames_per_step
    horizon_frames, frames = metadata["horizon_frames"], metadata["state"]["frames"]
    if (horizon_frames is None) != (metadata["horizon"] is None):
        raise InputError(f"{where}: malformed stream metadata: horizon and horizon_frames must both be null (no "
                         "horizon) or both be set")
    reserve = metadata["engine"]["reserve_tokens"]
    video_tokens = None if horizon_frames is None else adapter.max_video_tokens(horizon_frames)
    if horizon_frames is not None and metadata["horizon"] != video_tokens + reserve:
        raise InputError(f"{where}: malformed stream metadata: horizon {metadata['horizon']} is not the "
                         f"{video_tokens} tokens of its {metadata['horizon_frames']} frames plus its reserve of "
                         f"{reserve} for this model")
    state = adapter.start(horizon_frames, metadata["max_fps"])
    saved = metadata["state"].get("extra")
    for key, value in state.extra.items() if saved is not None else ():
        if saved.get(key) != value:  # what a stream of these frames at this rate starts with (Eagle states its rate)
            raise InputError(f"{where}: malformed stream metadata: state.extra.{key} is {saved.get(key)!r}, but this "
                             f"model starts a stream of {metadata['horizon_frames']} frames at max_fps "
                             f"{metadata['max_fps']} with {value!r}")
    prefix = adapter.prefix(state)
    expected_prefix = 0 if prefix is None else prefix.num_tokens
    if metadata["prefix_tokens"] != expected_prefix:
        raise InputError(f"{where}: malformed stream metadata: prefix_tokens is {metadata['prefix_tokens']}, this "
                         f"model's prompt prefix is {expected_prefix} tokens")
    lengths, skip = metadata["cache"]["chunk_lengths"], int(bool(expected_prefix))  # a disk tier's: `StepValues`
    if expected_prefix:
        if not lengths or lengths[0] != expected_prefix:
            raise InputError(f"{where}: malformed stream metadata: the first step must be the {expected_prefix}-token "
                             f"prompt prefix, got {list(lengths[:1])}")
        if 0 in metadata["cache"].get("evicted_steps", ()):
            raise InputError(f"{where}: malformed stream metadata: the cache's evicted_steps list the prompt prefix "
                             "(step 0), which a cache limit never evicts")
    longest = adapter.max_video_tokens(frames_per_step if horizon_frames is not None else max(frames, frames_per_step))
    for number, length in enumerate(() if StepValues(lengths).within(1, longest, skip) else lengths[skip:]):
        if not 1 <= length <= longest:  # (runs checked by their ends first: a resumed disk tier's are never unfolded)
            raise InputError(f"{where}: malformed stream metadata: step {number} holds {length} tokens; a step of "
                             f"this model holds 1 to {longest}")
    if len(lengths) - skip != math.ceil(frames / frames_per_step):
        raise InputError(f"{where}: malformed stream metadata: {len(lengths) - skip} frame steps for {frames} frames "
                         f"({frames_per_step} per step)")


def _check_format(path: Path, metadata: Any) -> None:
    where = printable(path)
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise InputError(f"{where}: not a saved statekv stream")
    version = metadata.get("version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise InputError(f"{where}: malformed stream metadata: no format version (got {version!r})")
    if version == 1:
        raise InputError(f"{where}: saved in stream format 1 by an earlier statekv, which records no checksums or "
                         f"weights fingerprint, so it cannot be verified; this statekv reads formats "
                         f"{', '.join(map(str, READ_VERSIONS))}: encode the video again")
    if version not in READ_VERSIONS:
        raise InputError(f"{where}: saved in stream format {version!r}; this statekv reads formats "
                         f"{', '.join(map(str, READ_VERSIONS))}")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _reason(error: BaseException) -> str:
    text = getattr(error, "strerror", None) or str(error).strip() or type(error).__name__
    return text.splitlines()[0]


# -- the schema -----------------------------------------------------------------------------------------------
TEXT = type_check(str, "a string")
TIME = number_check(highest=LATEST_TIMESTAMP)  # a stream's seconds (`statekv.api.stream.checked_timestamp`)
BOOLEAN = type_check(bool, "true or false")
# who a stream is: its id, creation, owner's digest and the installation that keyed it (files saved before they
# were recorded lack them)
OWNERSHIP = {"stream_id": TEXT, "owner_digest": optional_check(TEXT), "created": optional_check(TEXT),
             "installation": optional_check(TEXT)}
# the engine's settings as recorded (`EngineSettings.to_dict`); `check_same_setup` compares the binding ones
SETTINGS = type_check(dict, "an object")

CACHE = record_check({"chunk_lengths": held_check(list_check(integer_check(1)), 1), "seen_tokens": integer_check(0),
                      "window_starts": list_check(optional_check(integer_check(0)))},
                     optional={"kv_cache_dtype": type_check(str, "a string"),  # absent: the model's dtype
                               "evicted_steps": held_check(list_check(integer_check(0)), 0),
                               "positions": type_check(dict, "an object"),  # absent: stream positions
                               "attention_tally": type_check(dict, "an object")})  # checked by the cache

SCHEMA = record_check({
    "format": TEXT, "version": integer_check(1), "name": TEXT,
    "model": record_check({"family": TEXT, "layout": TEXT, "model_type": TEXT, "name_or_path": TEXT,
                      "layers": integer_check(1), "hidden_size": integer_check(1), "dtype": TEXT, "weights": TEXT}),
    "engine": record_check({"method": TEXT, "policy": TEXT, "attention": TEXT, "offload": BOOLEAN,
                            "cuda_graph": BOOLEAN, "reserve_tokens": integer_check(1)},
                           optional={"settings": SETTINGS, "handed_over": BOOLEAN}),  # absent: not resumed so
    "horizon": optional_check(integer_check(1)), "horizon_frames": optional_check(integer_check(1)),  # null: none
    "max_fps": optional_check(number_check(positive=True, highest=HIGHEST_FPS)),
    "prefix_tokens": integer_check(0), "vision_batch": integer_check(1),
    "pushed": integer_check(0), "next_tick": integer_check(0), "last_timestamp": optional_check(TIME),
    "pending": list_check(list_check(number_check(), length=2)),
    "state": dataclass_check(LayoutState),
    "stats": dataclass_check(EncodingStats, optional=("evicted_frames", "earlier_seconds", "earlier_frames")),
    "cache": CACHE,
    "checksums": type_check(dict, "an object"),
}, optional={**OWNERSHIP, "watches": list_check(type_check(dict, "an object")),  # `watch_saving.check_record`
             "kept_timestamp": optional_check(TIME),  # absent: saved before it was kept
             "encoded_timestamp": optional_check(TIME),  # absent: saved before it was kept
             # the handover layout's successor (`statekv.api.handover`): the steps it replayed, those it has yet to
             "successor": CACHE, "backlog": record_check({"spans": list_check(integer_check(1))})})


def check_schema(metadata: dict[str, Any], *, where: str) -> None:
    """Every field of `SCHEMA` present with its type and range, and the counts consistent with each other."""
    try:
        SCHEMA(metadata, "metadata")
        for name, checksum in metadata["checksums"].items():
            TEXT(checksum, f"metadata.checksums[{name!r}]")
        _check_counts(metadata)
    except InputError as error:
        raise InputError(f"{where}: malformed stream metadata: {error}") from None


def _check_counts(metadata: dict[str, Any]) -> None:
    state, stats, cache = metadata["state"], metadata["stats"], metadata["cache"]
    seen, kept = cache["seen_tokens"], state["frames"] + len(metadata["pending"])
    agreements = {"state.tokens": (state["tokens"], seen), "stats.tokens": (stats["tokens"], seen),
                  "stats.frames": (stats["frames"], state["frames"]),
                  "stats.chunks": (stats["chunks"], len(cache["chunk_lengths"])),
                  "cache.seen_tokens": (seen, StepValues(cache["chunk_lengths"]).total())}
    if "successor" in metadata or "backlog" in metadata:  # every step the stream took (inside the range: a few)
        successor, backlog = metadata.get("successor"), metadata.get("backlog")
        replayed = steps_of(successor["chunk_lengths"] if successor is not None else [],
                            backlog["spans"] if backlog is not None else [])  # as runs: no list a step
        agreements["the successor's steps (replayed and backlog)"] = (replayed, steps_of(cache["chunk_lengths"]))
    if "successor" in metadata:  # under the cache layout beside the stream's own
        evicted = [record.get("evicted_steps") for record in (metadata["successor"], cache)]
        agreements["successor.evicted_steps"] = tuple(map(step_set, evicted))
        layouts = [(record.get("positions") or {}).get("layout") for record in (cache, metadata["successor"])]
        agreements["the engines' layouts"] = (layouts, [OWN_LAYOUT, SUCCESSOR_LAYOUT])
    for name, (value, expected) in agreements.items():
        if value != expected:
            raise InputError(f"{name} is {shown(value)}, inconsistent with the rest ({shown(expected)})")
    if kept > metadata["pushed"]:
        raise InputError(f"pushed is {metadata['pushed']}, fewer than the {kept} frames kept")
    if metadata["horizon_frames"] is not None and kept > metadata["horizon_frames"]:
        raise InputError(f"horizon_frames is {metadata['horizon_frames']}, fewer than the {kept} frames kept")
    if metadata["horizon"] is not None and seen > metadata["horizon"]:
        raise InputError(f"horizon is {metadata['horizon']} tokens, fewer than the {seen} streamed")
    if metadata["prefix_tokens"] > seen:
        raise InputError(f"prefix_tokens is {metadata['prefix_tokens']}, more than the {seen} tokens streamed")


# -- the model and the engine a file was saved with ---------------------------------------------------------------
def model_identity(qa: Any) -> dict[str, Any]:
    """What a saved stream records of ``qa``'s model (without the weights' fingerprint)."""
    config = qa.adapter.model.config
    text = config.get_text_config()
    return {"family": qa.adapter.family, "layout": qa.adapter.layout, "model_type": config.model_type,
            "name_or_path": str(getattr(config, "_name_or_path", "")), "layers": text.num_hidden_layers,
            "hidden_size": text.hidden_size, "dtype": str(qa.adapter.dtype).removeprefix("torch.")}


def recorded_settings(metadata: dict[str, Any]) -> dict[str, Any]:
    """The engine settings a saved stream records (an older file: the only one it recorded, ``kv_cache_dtype``)."""
    recorded = metadata["engine"].get("settings")
    return recorded if recorded is not None else {"kv_cache_dtype": metadata["cache"].get("kv_cache_dtype")}


def check_same_setup(path: str | os.PathLike, metadata: dict[str, Any], qa: Any, allow_other_weights: bool,
                     engine: EngineSettings) -> None:
    """Refuse (one line) a saved stream whose model, binding engine settings or policy differ from ``qa``'s
    (``engine``: the settings it is being loaded with), or whose weights do unless ``allow_other_weights``."""
    where = printable(path)
    saved, current = metadata["model"], model_identity(qa)
    for key in ("family", "model_type", "layout", "layers", "hidden_size", "dtype"):
        if saved[key] != current[key]:
            raise OtherSetupError(f"{where}: saved with {key} {saved[key]!r}, but this VideoQA has "
                                  f"{current[key]!r}")
    refusal = engine.refusal(recorded_settings(metadata), where)
    if refusal is not None:
        raise OtherSetupError(refusal)
    policy, method = metadata["engine"]["policy"], metadata["engine"].get("method")
    if policy != repr(qa.policy):
        saved_with = policy if method is None else f"method {str(method)[:40]!r} ({policy})"
        raise OtherSetupError(f"{where}: saved with {saved_with}, but this VideoQA uses method {qa.method!r} "
                              f"({qa.policy!r})")
    if not allow_other_weights and saved["weights"] != weights_fingerprint(qa.adapter.model):
        raise OtherSetupError(f"{where}: saved with other weights ({saved['name_or_path'] or 'another checkpoint'})"
                              " than this model's, whose cache would differ; pass allow_other_weights=True to load "
                              "it anyway")
