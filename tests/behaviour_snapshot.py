"""A snapshot of what statekv computes, to compare two commits bit for bit (a refactor must change nothing).

    git worktree add /tmp/statekv-ref <commit>
    (cd /tmp/statekv-ref && python /path/to/tests/behaviour_snapshot.py record /tmp/ref.pt)
    python tests/behaviour_snapshot.py record /tmp/new.pt          # from this checkout's root
    python tests/behaviour_snapshot.py compare /tmp/ref.pt /tmp/new.pt

``record`` imports the ``statekv`` of the current folder, runs 28 set-ups (the engine alone under every carry
rule, storage and option; the three model families through `VideoQA`: encoding, live streams, several streams
stepped together, saving and resuming, the disk tier, cache caps, retrieval) on tiny random checkpoints made in
``--work`` (kept, so both runs read the same files), and records per set-up: every step's hidden states, the
ATen ops every step and question dispatched (`statekv.testing.OpTrace`), the carried keys, values and positions
of every layer, the engine's state dict, its statistics, the answers' token ids, saved stream files and disk-tier
file sets. ``compare`` prints one line per set-up and exits 1 if anything differs.

What is left out of the comparison, because it is not computed: wall times, the disk tier's random folder
names and a saved stream's random id, and the engine settings a saved stream records since the settings object
was introduced (``engine.settings``, absent from older files).

One change is expected and checked exactly (issue 33: the engine checks every family's prompt): a question's op
trace may gain, once, the engine's check that the prompt's ids are in the vocabulary (`PROMPT_CHECK`, five ops
on the prompt) where the reference's adapter (Qwen3-VL, Eagle) decoded without it. Every other op, and every
answer, must be identical; ``compare`` counts the traces that differ by that check alone.

Against a reference from before issue 34 (streams that never end), these differ by design and ``compare`` reports
them: every step's op trace gains the segment index's ops (min, max and sum of the step's keys per layer) and a
question's loses or gains a few (step starts kept as the steps commit, the question plan); state dicts and saved
files gain ``segment_index`` and ``segment_partial`` per layer; ``EncodingStats`` gains ``earlier_frames``; the
peak device bytes count the open segment's accumulators; disk-tier file sets are format 2 (checkpoints every
``CHECKPOINT_STEPS`` steps, segment index); under a cache cap (``refuse``, ``evict-*``) the cap now counts
summaries, scales and the journal, so fewer frames fit and the answers differ. Hidden states, carried states,
positions and answers of every other set-up must be identical (they were, at the merge of main into issue 34).

Against a reference from after issue 34 but before the segment index's per-step ops were cut, only op traces
differ: per step and layer the index's minimum, maximum, add, two cats, remainder, eq, where, floor division, row
index_copy_ and two copy_ (one at commit) give way to ``minimum.out``, ``maximum.out`` and ``add.out`` (and a few
views); a layer's first step makes the open segment's identities instead of zeros; a step completing a segment
writes its row (cat, copy_) and resets the open segment (copy_); a question's empty segment index is an alias
instead of a slice. Everything else is identical (``compare`` shows them as op-trace differences).

Against a reference from before pooled steps (issue 48), the set-ups that step several streams together
(``push_many``) differ in their op traces and in the bytes their streams hold, by design: their steady batched
steps run as rows of the model's pools (`statekv.core.step.pooled`: an index_select of the rows' carried slots and
counters, one indexed write of every row's chunk and summaries per layer, one index_copy_ of the selected rows
back, where each stream's own layer did each of those per stream), the first of them moves each stream's detailed
cache and summaries into pages (copies), and a question reads a pooled stream's whole cache as a copy; a pooled
stream's ``detailed_bytes``, ``device_bytes`` and peak count the pages and rows it holds (pages of 64 tokens or
steps, its carried row). Their hidden states, carried states, positions, state dicts and answers are identical
(a pooled recency stream without sinks would save its carried tokens, where one alone saves its window's start). A
set-up recorded after them in the same process may slice the rank table of `in_time_order` from a larger table (8
rows where the reference's had 6: a batch of 3 streams is padded to 4 rows): a view's argument shape, nothing
computed. Single-stream set-ups are otherwise identical, op traces included.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the statekv of the checkout this is run from

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # reductions whose order depends on the thread count would differ between runs

import statekv  # noqa: E402
from statekv.testing import OpTrace, make_tiny_checkpoint  # noqa: E402

QUESTION = "Why?"
TIMINGS = {"frame_seconds", "decode_seconds", "vision_seconds", "language_seconds", "seconds"}
LENGTHS = (9, 7, 12, 5, 10, 6, 11, 8, 9, 4, 13, 6)
STREAM_STATS = ("steps", "tokens", "carried_tokens", "detailed_bytes", "device_bytes", "peak_device_bytes",
                "graph_replays", "evicted_steps", "evicted_tokens", "max_carried_tokens")  # those of cf6a498


# -- models -----------------------------------------------------------------------------------------------------
def tiny_lm(work: Path) -> torch.nn.Module:
    """A tiny random Qwen3 decoder (3 layers, 4 query / 2 KV heads), saved once and loaded back."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    path = work / "qwen3-lm"
    if not (path / "config.json").exists():
        config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             max_position_embeddings=1024, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(config)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
        model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def checkpoint(work: Path, family: str) -> Path:
    path = work / f"tiny-{family}"
    if not (path / "config.json").exists():
        make_tiny_checkpoint(family, path)
    return path


def frames(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, 24, 32, 3), dtype=np.uint8)


# -- what is recorded -------------------------------------------------------------------------------------------
def cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()
    if isinstance(value, dict):
        return {key: cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu(item) for item in value)
    return value


def engine_state(prefill) -> dict:
    """Carried state, positions, state dict and statistics of a `StreamingPrefill`."""
    stats = prefill.stats
    layers = len(stats.carried_tokens)
    tensors, metadata = prefill.state_dict()
    return {
        "carried": [cpu(prefill.carried(layer)) for layer in range(layers)],
        "positions": [cpu(prefill.carried_positions(layer)) for layer in range(layers)],
        "state_dict": (cpu(tensors), metadata),
        "stats": {key: stats.to_dict()[key] for key in STREAM_STATS},
        "history": [(record.tokens, record.carried_tokens, record.overlap) for record in stats.history],
        "seen_tokens": prefill.seen_tokens,
    }


def video_state(video) -> dict:
    stats = {key: value for key, value in video.stats.to_dict().items()
             if key not in TIMINGS and not key.endswith("seconds") and key != "frames_per_second"}
    return {**engine_state(video.prefill), "video_stats": stats, "state": video.state.to_dict(),
            "frames": video.frames, "tokens": video.tokens, "step_frames": list(video.step_frames)}


def traced(record: dict, name: str, call):
    """Run ``call`` under an op trace kept as ``record["ops"][name]``; return its result."""
    with OpTrace() as trace:
        result = call()
    record.setdefault("ops", {})[name] = [repr(op) for op in trace.ops]
    return result


def saved_file(path: Path) -> dict:
    from safetensors import safe_open
    import json

    with safe_open(str(path), "pt") as handle:
        metadata = json.loads(handle.metadata()["statekv"])
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    return {"tensors": tensors, "metadata": metadata}


# what differs from run to run in a saved stream's metadata and a file set's descriptions: who the stream is, when it
# was made, the file set's random id, and the checksums over them
RANDOM_FIELDS = ("stream_id", "checksum", "created", "file_set", "owner_digest", "installation")


def file_set(folder: Path) -> dict:
    """Every file of a disk-tier file set, by name (stream.json parsed), but what differs from run to run: the lock's
    note of its holder, `RANDOM_FIELDS` and the journal's first record (naming the file set)."""
    import json

    files = {}
    for path in sorted(folder.iterdir()):
        if path.name == "lock":
            continue
        data = path.read_bytes()
        if path.suffix == ".json":
            data = {key: value for key, value in json.loads(data).items() if key not in RANDOM_FIELDS}
        elif path.name == "journal" and b'"file_set"' in data.split(b"\n", 1)[0]:  # its first record: the set's id
            data = data.split(b"\n", 1)[-1]
        files[path.name] = data
    return files


def ask(record: dict, name: str, video, **kwargs) -> None:
    record.setdefault("answers", {})[name] = cpu(traced(record, f"ask {name}", lambda: video.ask_tokens(
        QUESTION, max_new_tokens=5, **kwargs)))


# -- the set-ups --------------------------------------------------------------------------------------------------
def engine_setup(work: Path, policy, *, steps=LENGTHS, resume_at: int | None = None, question: bool = True,
                 retrieve: int | None = None, **kwargs) -> dict:
    model = tiny_lm(work)
    tokens = torch.randint(0, 96, (1, sum(steps)), generator=torch.Generator().manual_seed(1))
    chunks = list(torch.split(tokens, list(steps), dim=1))
    record: dict = {"hidden": []}
    prefill = statekv.StreamingPrefill(model, policy, horizon=sum(steps) + 32, **kwargs)
    for index, chunk in enumerate(chunks):
        if resume_at is not None and index == resume_at:
            tensors, metadata = prefill.state_dict()
            record["saved"] = (cpu(tensors), metadata)
            prefill.close()
            prefill = statekv.StreamingPrefill(model, policy, horizon=sum(steps) + 32, **kwargs)
            prefill.load_state_dict(tensors, metadata)
        record["hidden"].append(cpu(traced(record, f"step {index}", lambda: prefill.step(input_ids=chunk))))
    record.update(engine_state(prefill))
    if question:
        prompt = torch.tensor([[5, 17, 33, 2]])
        retrieval = None if retrieve is None else statekv.Retrieval(retrieve, keep_tokens=0)
        record["answers"] = {"whole": cpu(traced(record, "generate", lambda: prefill.generate(
            prompt, max_new_tokens=5, retrieve=retrieval)))}
    prefill.close()
    return record


def qa_for(work: Path, family: str, policy, *, layout: str | None = None, **kwargs) -> "statekv.VideoQA":
    from statekv.models import load_adapter

    key = (family, layout)
    if key not in ADAPTERS:
        ADAPTERS[key] = load_adapter(checkpoint(work, family), layout=layout,
                                     trust_remote_code=family == "eagle")
    return statekv.VideoQA(ADAPTERS[key], policy, attention="eager", reserve_tokens=40, **kwargs)


ADAPTERS: dict = {}


def encode_setup(work: Path, family: str, policy, *, layout=None, count=6, retrieve=None, **kwargs) -> dict:
    from statekv.video import open_video

    qa = qa_for(work, family, policy, layout=layout, **kwargs)
    record: dict = {}
    video = traced(record, "encode", lambda: qa.encode(open_video(frames(count), fps=1), max_fps=1))
    record.update(video_state(video))
    ask(record, "whole", video, retrieve=None)
    if retrieve is not None:
        ask(record, "retrieved", video, retrieve=retrieve)
    video.close()
    return record


def push_all(record: dict, stream, images, start: int = 0, prefix: str = "push") -> None:
    for index, image in enumerate(images):
        kept = traced(record, f"{prefix} {start + index}", lambda: stream.push(image, float(start + index)))
        record.setdefault("kept", []).append(kept)


def stream_setup(work: Path, family: str, policy, *, layout=None, count=7, vision_batch=1, save_at=None,
                 retrieve=None, stream_kwargs=None, **kwargs) -> dict:
    qa = qa_for(work, family, policy, layout=layout, **kwargs)
    record: dict = {}
    stream = qa.stream(horizon_frames=count + 2, vision_batch=vision_batch, **(stream_kwargs or {}))
    images = frames(count, seed=3)
    split = count if save_at is None else save_at
    push_all(record, stream, images[:split])
    if save_at is not None:
        ask(record, "before save", stream)
        path = work / "out" / f"{family}-{id(record)}.safetensors"
        stream.save(path)
        record["file"] = saved_file(path)
        stream.close()
        stream = statekv.Stream.load(path, qa, **({"kv_cache_dtype": stream_kwargs["kv_cache_dtype"]}
                                                  if stream_kwargs and "kv_cache_dtype" in stream_kwargs else {}))
        push_all(record, stream, images[split:], start=split)
    traced(record, "flush", stream.flush)
    record.update(video_state(stream))
    ask(record, "whole", stream, retrieve=None)
    if retrieve is not None:
        ask(record, "retrieved", stream, retrieve=retrieve)
    stream.close()
    return record


def many_setup(work: Path, family: str, policy, *, streams=3, count=6, **kwargs) -> dict:
    qa = qa_for(work, family, policy, **kwargs)
    record: dict = {}
    opened = [qa.stream(horizon_frames=count + 1) for _ in range(streams)]
    videos = [frames(count, seed=10 + s) for s in range(streams)]
    for index in range(count):
        items = [(stream, videos[s][index], float(index)) for s, stream in enumerate(opened)
                 if not (s == 0 and index >= count - 2)]  # the first stream leaves early
        record.setdefault("kept", []).append(traced(record, f"push_many {index}", lambda: qa.push_many(items)))
    record["streams"] = []
    for s, stream in enumerate(opened):
        state = video_state(stream)
        answers: dict = {}
        ask(answers, "whole", stream, retrieve=None)
        record["streams"].append({**state, **answers})
        stream.close()
    return record


def disk_setup(work: Path, policy, *, count=6, kv_cache_dtype=None) -> dict:
    folder = work / "out" / "disk"
    folder.mkdir(parents=True, exist_ok=True)
    qa = qa_for(work, "internvl", policy, layout="chat", offload="disk", offload_dir=folder,
                kv_cache_dtype=kv_cache_dtype)
    record: dict = {}
    stream = qa.stream(horizon_frames=count + 2, name="disk")
    push_all(record, stream, frames(count, seed=5)[:count - 2])
    ask(record, "live", stream)
    tier = next(path for path in folder.iterdir() if path.name.startswith("disk-"))
    record["file set"] = file_set(tier)
    stream.close()
    resumed = statekv.Stream.load(tier, qa)
    push_all(record, resumed, frames(count, seed=5)[count - 2:], start=count - 2, prefix="resumed push")
    record.update(video_state(resumed))
    ask(record, "resumed", resumed, retrieve=2)
    record["file set after"] = file_set(tier)
    resumed.close()
    return record


def capped_setup(work: Path, policy, when_full: str, *, count=8) -> dict:
    qa = qa_for(work, "internvl", policy, offload=True, max_cache_bytes=60_000, cache_limit=when_full)
    record: dict = {}
    stream = qa.stream(horizon_frames=count + 1)
    errors = []
    for index, image in enumerate(frames(count, seed=7)):
        try:
            push_all(record, stream, [image], start=index)
        except statekv.StateKVError as error:
            errors.append((index, type(error).__name__, str(error)))
    record["errors"] = errors
    record.update(video_state(stream))
    ask(record, "whole", stream)
    ask(record, "retrieved", stream, retrieve=3)
    stream.close()
    return record


def setups(work: Path) -> dict:
    S = statekv
    return {
        "engine full": lambda: engine_setup(work, S.FullAttention(), attention="eager"),
        "engine statekv eager": lambda: engine_setup(work, S.StateKV(budget=16), attention="eager"),
        "engine statekv chunked": lambda: engine_setup(work, S.StateKV(budget=16), attention="chunked"),
        "engine recency ring": lambda: engine_setup(work, S.Recency(frames=3), steps=(4,) + (6,) * 10),
        "engine rekv": lambda: engine_setup(work, S.ReKV(frames=3, sinks=2).for_prefix(4), steps=(4,) + (6,) * 10),
        "engine keynorm": lambda: engine_setup(work, S.KeyNorm(budget=12)),
        "engine sinks+recency": lambda: engine_setup(work, S.SinksAndRecency(sinks=3, frames=2)),
        "engine withsinks(statekv)": lambda: engine_setup(work, S.WithSinks(S.StateKV(budget=10), sinks=3)),
        "engine perlayer(statekv)": lambda: engine_setup(work, S.PerLayerBudget(S.StateKV(budget=8), (8, 12, 16))),
        "engine statekv offload": lambda: engine_setup(work, S.StateKV(budget=16), offload=True),
        "engine statekv int8": lambda: engine_setup(work, S.StateKV(budget=16), kv_cache_dtype="int8"),
        "engine statekv int4 offload": lambda: engine_setup(work, S.StateKV(budget=16), kv_cache_dtype="int4",
                                                            offload=True),
        "engine statekv overlap": lambda: engine_setup(work, S.StateKV(budget=16), track_overlap=True),
        "engine statekv resumed": lambda: engine_setup(work, S.StateKV(budget=16), resume_at=6),
        "engine statekv retrieval": lambda: engine_setup(work, S.StateKV(budget=16), retrieve=3),
        "internvl encode statekv": lambda: encode_setup(work, "internvl", S.StateKV(budget=12), layout="paper",
                                                        retrieve=2),
        "internvl stream saved": lambda: stream_setup(work, "internvl", S.StateKV(budget=12), layout="chat",
                                                      save_at=4, retrieve=2),
        "internvl stream recency batch 3": lambda: stream_setup(work, "internvl", S.Recency(frames=2), count=8,
                                                                vision_batch=3),
        "qwen3_vl encode statekv": lambda: encode_setup(work, "qwen3_vl", S.StateKV(budget=12), count=7, retrieve=2),
        "qwen3_vl stream recency": lambda: stream_setup(work, "qwen3_vl", S.Recency(frames=2), count=7),
        "eagle encode full": lambda: encode_setup(work, "eagle", S.FullAttention(), count=4),
        "internvl push_many statekv": lambda: many_setup(work, "internvl", S.StateKV(budget=12)),
        "qwen3_vl push_many rekv": lambda: many_setup(work, "qwen3_vl", S.ReKV(frames=2, sinks=2), count=8),
        "internvl disk tier resumed": lambda: disk_setup(work, S.StateKV(budget=12)),
        "internvl evict-oldest": lambda: capped_setup(work, S.StateKV(budget=12), "evict-oldest"),
        "internvl evict-least-attended": lambda: capped_setup(work, S.StateKV(budget=12), "evict-least-attended"),
        "internvl refuse": lambda: capped_setup(work, S.Recency(frames=2), "refuse"),
        "internvl int4 saved rekv retrieval": lambda: stream_setup(
            work, "internvl", S.ReKV(frames=2, sinks=2), save_at=3, retrieve=2, retrieval="rekv", offload=True,
            kv_cache_dtype="int4"),
    }


def record(out: Path, work: Path, only: list[str] | None) -> None:
    work.mkdir(parents=True, exist_ok=True)
    import shutil

    shutil.rmtree(work / "out", ignore_errors=True)
    (work / "out").mkdir()
    print(f"statekv from {Path(statekv.__file__).parent}", flush=True)
    results = {}
    for name, run in setups(work).items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        results[name] = run()
        print(f"recorded {name}", flush=True)
    torch.save(results, out)
    print(f"{len(results)} set-ups written to {out}")


# -- comparing ----------------------------------------------------------------------------------------------------
def differences(a, b, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (tensors: dtype, shape and every bit), at most a few places."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{where}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"]
        same = torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point and a.dim() else a,
                           b.view(torch.uint8) if b.dtype.is_floating_point and b.dim() else b)
        return [] if same else [f"{where}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                found.append(f"{where}.{key}: only in {'the new' if key not in a else 'the reference'}")
            else:
                found += differences(a[key], b[key], f"{where}.{key}")
            if len(found) > 5:
                break
        return found
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        found = []
        for index, (x, y) in enumerate(zip(a, b)):
            found += differences(x, y, f"{where}[{index}]")
            if len(found) > 5:
                break
        return found
    return [] if a == b else [f"{where}: {str(a)[:120]!r} vs {str(b)[:120]!r}"]


PROMPT_CHECK = ("ge.Scalar", "lt.Scalar", "bitwise_and.Tensor", "all.default", "_local_scalar_dense.default")


def without_prompt_check(reference: list[str], new: list[str]) -> list[str] | None:
    """``new`` with the engine's prompt check removed, if that check (inserted once) is all that differs from
    ``reference``; else None."""
    if len(new) != len(reference) + len(PROMPT_CHECK):
        return None
    first = next((i for i, (a, b) in enumerate(zip(reference, new)) if a != b), len(reference))
    inserted = new[first:first + len(PROMPT_CHECK)]
    names = [op.split("'")[1] for op in inserted]
    if names != list(PROMPT_CHECK) or new[first + len(PROMPT_CHECK):] != reference[first:]:
        return None
    return new[:first] + new[first + len(PROMPT_CHECK):]


def allow_prompt_checks(reference, new) -> int:
    """Strip the expected prompt check from ``new``'s question traces (in place); how many were stripped."""
    count = 0
    if isinstance(reference, dict) and isinstance(new, dict):
        for key in set(reference) & set(new):
            if key == "ops" and isinstance(new[key], dict):
                for name in set(reference[key]) & set(new[key]):
                    stripped = without_prompt_check(reference[key][name], new[key][name])
                    if name.startswith("ask") and stripped is not None:
                        new[key][name] = stripped
                        count += 1
            else:
                count += allow_prompt_checks(reference[key], new[key])
    elif isinstance(reference, (list, tuple)) and isinstance(new, (list, tuple)):
        count += sum(allow_prompt_checks(a, b) for a, b in zip(reference, new))
    return count


def comparable(record):
    """A record without what the comparison leaves out (see the module docstring)."""
    if isinstance(record, dict):
        kept = {}
        for key, value in record.items():
            if key in TIMINGS:
                continue
            if key == "metadata" and isinstance(value, dict):  # a saved stream's id is random per run
                value = {k: v for k, v in value.items() if k not in RANDOM_FIELDS}
            if key == "engine" and isinstance(value, dict):
                value = {k: v for k, v in value.items() if k != "settings"}
            if key == "stream.json" and isinstance(value, dict):
                value = {**value, "engine": {k: v for k, v in value["engine"].items() if k != "settings"}}
            kept[key] = comparable(value)
        return kept
    if isinstance(record, (list, tuple)):
        return type(record)(comparable(item) for item in record)
    if isinstance(record, str):
        return re.sub(r"disk-[0-9a-f]{8}", "disk-*", record)  # a disk-tier folder's random name
    return record


def compare(reference: Path, new: Path) -> int:
    ref, got = torch.load(reference, weights_only=False), torch.load(new, weights_only=False)
    failed = checked = 0
    for name in ref:
        if name not in got:
            print(f"MISSING {name}")
            failed += 1
            continue
        reference, new = comparable(ref[name]), comparable(got[name])
        prompt_checks = allow_prompt_checks(reference, new)
        checked += prompt_checks
        found = differences(reference, new, "")
        ops = sum(len(trace) for trace in ref[name].get("ops", {}).values())
        if found:
            failed += 1
            print(f"DIFFERS {name}: " + "; ".join(found))
        else:
            note = f"; {prompt_checks} question(s) + the engine's prompt check" if prompt_checks else ""
            print(f"same    {name} ({ops} ops traced{note})")
    print(f"{len(ref) - failed} of {len(ref)} set-ups identical"
          + (f" ({checked} question traces differ only by the engine's prompt check)" if checked else ""))
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    recording = commands.add_parser("record", help="run every set-up with the statekv of the current folder")
    recording.add_argument("out", type=Path)
    recording.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "statekv-behaviour",
                           help="where the tiny checkpoints are made (and kept) and files are saved")
    recording.add_argument("--only", nargs="*", help="set-ups to run (default: all)")
    comparing = commands.add_parser("compare", help="compare two recordings bit for bit")
    comparing.add_argument("reference", type=Path)
    comparing.add_argument("new", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.work, args.only)
    else:
        sys.exit(compare(args.reference, args.new))


if __name__ == "__main__":
    main()
