"""The GPU suite's sections on a whole 1B VLM: the pipeline, batched streams and steps, cache tiers."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from gpu_measure import (compiled_graphs, peak_gib, profile_counts, release_memory, reset_peak, resident_gib,
                         timed, traced_ops)
from gpu_shapes import Section, Shapes

COMPILED_STREAMS = (1, 16)  # streams stepped together compiled: one, and the batch issue 48's goal names


def make_vlm(folder: Path, shapes: Shapes) -> Path:
    import torch
    from statekv import testing

    overrides = {}
    if shapes.vlm_text is not None:
        overrides = dict(dtype=torch.bfloat16, std=0.02, text_config=shapes.vlm_text, vision_config=shapes.vlm_vision)
    return testing.make_tiny_checkpoint("internvl", folder / "vlm", **overrides)


def vlm_options(shapes: Shapes, **more) -> dict:
    dtype = "bfloat16" if shapes.device.startswith("cuda") else "float32"
    return {**dict(method="statekv", budget=shapes.vlm_budget, dtype=dtype, device=shapes.device), **more}


def pipeline(section: Section, deadline: float, shapes: Shapes, checkpoint: Path, folder: Path) -> None:
    import statekv
    from statekv import testing

    count = shapes.pipeline_frames
    video = testing.write_test_video(folder / "video.mp4", frames=count, fps=1.0,
                                     size=(shapes.image_size, shapes.image_size))
    for variant, more in (("graph", {}), ("graph + compiled", {"compile_step": True})):
        if time.monotonic() > deadline:
            section.rows.append({"variant": variant, "error": "not run: the section's time cap was reached"})
            continue
        qa = statekv.VideoQA.from_pretrained(str(checkpoint), **vlm_options(shapes, **more))
        warmed, _ = timed(shapes.device, lambda: qa.encode(video, max_fps=1, max_frames=min(count, 24)))  # kernels
        reset_peak(shapes.device)  # tuned and compiled, graphs recorded: once per process, not per video
        graphs = compiled_graphs()
        seconds, encoded = timed(shapes.device, lambda: qa.encode(video, max_fps=1, max_frames=count))
        graphs = compiled_graphs() - graphs
        stats = encoded.stats
        encoded.ask("Warm up?", max_new_tokens=2)
        ask_seconds, _ = timed(shapes.device, lambda: encoded.ask("What colour is the square?", max_new_tokens=16))
        head, tail = stats.frame_seconds[1:33], stats.frame_seconds[-64:]
        section.rows.append({
            "variant": variant, "warmup_s": warmed, "compiled_while_timed": graphs, "frames": stats.frames,
            "tokens": stats.tokens,
            "seconds": seconds, "frames_per_s": stats.frames / seconds,
            "frames_per_s_last_64": len(tail) / sum(tail), "ms_per_frame_steady": 1e3 * statistics.median(tail),
            # where a video's start-up goes: before its first frame is streamed, its first frame, frames 2-33
            "seconds_outside_frames": seconds - sum(stats.frame_seconds),
            "first_frame_ms": 1e3 * stats.frame_seconds[0],
            "ms_per_frame_2_to_33": 1e3 * statistics.mean(head) if head else None,
            "language_ms_2_to_33": 1e3 * statistics.mean(stats.language_seconds[1:33]) if head else None,
            "vision_ms_per_frame": 1e3 * statistics.mean(stats.vision_seconds),
            "language_ms_per_frame": 1e3 * statistics.mean(stats.language_seconds),
            "decode_ms_per_frame": 1e3 * statistics.mean(stats.decode_seconds),
            "peak_gib": peak_gib(shapes.device), "ask_s": ask_seconds,
            "frame_ms_1_to_40": [round(1e3 * value, 2) for value in stats.frame_seconds[:40]],
            "language_ms_1_to_40": [round(1e3 * value, 2) for value in stats.language_seconds[:40]]})
        print(f"   {section.rows[-1]}", flush=True)
        del qa, encoded
        release_memory()
    measured = [row for row in section.rows if "frames_per_s" in row]
    if measured:
        best = max(measured, key=lambda row: row["frames_per_s"])
        section.figures["pipeline_fps"] = best["frames_per_s"]
        section.figures["pipeline_variant"] = best["variant"]
    if time.monotonic() < deadline:
        section.rows.append(fresh_stream(shapes, checkpoint))
        print(f"   {section.rows[-1]}", flush=True)


def allocations(device: str) -> int | None:
    """Device allocations the caching allocator has made so far (cudaMalloc calls), on CUDA."""
    import torch

    return torch.cuda.memory_stats().get("num_device_alloc") if device.startswith("cuda") else None


def fresh_stream(shapes: Shapes, checkpoint: Path, frames: int = 24) -> dict[str, Any]:
    """A fresh stream's start-up, one push at a time, once the pipeline's runs have warmed the process up (kernels
    tuned and compiled): the stream's creation (its prompt prefix streamed), then each of its first ``frames``
    frames, in milliseconds and in device allocations, to tell a first frame's costs from the filling state's."""
    import statekv

    frames = min(frames, shapes.pipeline_frames)
    qa = statekv.VideoQA.from_pretrained(str(checkpoint), **vlm_options(shapes, compile_step=True))
    images = frames_of(shapes, frames, seed=1)
    before = allocations(shapes.device)
    created, stream = timed(shapes.device, lambda: qa.stream(horizon_frames=shapes.pipeline_frames))
    push_ms, allocs = [], []
    for image in images:
        counted = allocations(shapes.device)
        seconds, _ = timed(shapes.device, lambda: stream.push(image))
        push_ms.append(round(1e3 * seconds, 2))
        allocs.append(None if counted is None else allocations(shapes.device) - counted)
    stream.close()
    del stream, qa
    release_memory()
    total = None if before is None else allocations(shapes.device) - before
    return {"variant": f"a fresh stream, pushed frame by frame (graph + compiled, {frames} frames)",
            "create_ms": 1e3 * created, "first_frame_ms": push_ms[0], "mean_push_ms_after_first": statistics.mean(
                push_ms[1:]), "device_allocs": total, "push_ms": push_ms, "device_allocs_per_push": allocs}


def frames_of(shapes: Shapes, count: int, seed: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, (count, shapes.image_size, shapes.image_size, 3),
                                                dtype=np.uint8)


def batched_streams(section: Section, deadline: float, shapes: Shapes, checkpoint: Path) -> None:
    import statekv

    qa = statekv.VideoQA.from_pretrained(str(checkpoint), **vlm_options(shapes, budget=1024 if shapes.device
                                                                                 .startswith("cuda") else 32))
    warm = 8 if shapes.device.startswith("cuda") else 3
    video = frames_of(shapes, warm + shapes.stream_frames, 1)
    baseline = None
    for count in shapes.stream_counts:
        if time.monotonic() > deadline:
            section.rows.append({"streams": count, "error": "not run: the section's time cap was reached"})
            continue
        streams = [qa.stream(horizon_frames=len(video) + 1, name=f"s{index}") for index in range(count)]
        for tick in range(warm):
            qa.push_many([(stream, video[tick], float(tick)) for stream in streams])
        rounds = video[warm:]
        seconds, _ = timed(shapes.device, lambda: [qa.push_many([(stream, image, float(warm + tick))
                                                                 for stream in streams])
                                                   for tick, image in enumerate(rounds)])
        fps = count * len(rounds) / seconds
        baseline = baseline or fps
        row = {"streams": count, "frames_per_s": fps, "ms_per_round": 1e3 * seconds / len(rounds),
               "speedup_over_one": fps / baseline, "peak_gib": peak_gib(shapes.device)}
        # per round: decoding and the vision call are each stream's share (summed), a batched language step is
        # the whole step's time in every stream's record (its mean over streams)
        for stage, whole in (("decode", sum), ("vision", sum), ("language", statistics.fmean)):
            per_stream = [sum(getattr(stream.stats, f"{stage}_seconds")[-len(rounds):]) for stream in streams]
            row[f"{stage}_ms_per_round"] = 1e3 * whole(per_stream) / len(rounds)
        section.rows.append(row)
        print(f"   {section.rows[-1]}", flush=True)
        for stream in streams:
            stream.close()
    rows = [row for row in section.rows if "frames_per_s" in row]
    if rows:
        section.figures["streams_speedup"] = {row["streams"]: round(row["speedup_over_one"], 2) for row in rows}


def batched_steps(section: Section, deadline: float, shapes: Shapes) -> None:
    """The engine alone: S streams of the 1B decoder stepped together (`StepBatcher`, StateKV, one frame of
    random embeddings per stream and step, steady, replayed as graphs on CUDA): ms per batched step, frames/s
    against one stream, and per step the launches, GPU busy time and the ATen ops the host dispatched."""
    import statekv
    import torch
    from statekv.core.step.batching import StepBatcher, StepRequest
    from transformers import AutoModelForCausalLM, Qwen2Config

    device = shapes.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    fields = {key: (shapes.vlm_text or shapes.lm)[key] for key in ("hidden_size", "num_hidden_layers",
                                                                    "num_attention_heads", "num_key_value_heads",
                                                                    "head_dim", "intermediate_size")}
    tokens, budget = shapes.frame_tokens if shapes.vlm_text is None else 256, shapes.vlm_budget // 4
    warm, timed_steps = -(-budget // tokens) + 4, 8 if device.startswith("cuda") else 2
    config = Qwen2Config(**fields, vocab_size=1024, max_position_embeddings=(warm + 3 * timed_steps + 4) * tokens)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    generator = torch.Generator(device=device).manual_seed(0)
    frame = 0.02 * torch.randn(1, tokens, config.hidden_size, device=device, dtype=dtype, generator=generator)
    backend = "triton" if device.startswith("cuda") else "chunked"
    baselines: dict[str, float] = {}
    counts = (1, 2, 4, 8, 16, 32) if device.startswith("cuda") else (1, 4, 16)
    # compiled too (the decoder's small kernels fused, `statekv.core.step.compiled`), on CUDA only: Inductor's CPU
    # compile would take a smoke run's time
    runs = [("graph", count) for count in counts] + (
        [("graph + compiled", count) for count in COMPILED_STREAMS] if device.startswith("cuda") else [])
    with torch.no_grad():
        for variant, count in runs:
            if time.monotonic() > deadline:
                section.rows.append({"variant": variant, "streams": count,
                                     "error": "not run: the section's time cap was reached"})
                continue
            prefills = [statekv.StreamingPrefill(model, statekv.StateKV(budget=budget), attention=backend,
                                                 cuda_graph=True, horizon=(warm + 3 * timed_steps + 2) * tokens,
                                                 compile_step=variant.endswith("compiled"))
                        for _ in range(count)]
            batcher = StepBatcher()

            def steps(n: int) -> None:
                for _ in range(n):
                    for outcome in batcher.step([StepRequest(prefill, frame) for prefill in prefills]):
                        if isinstance(outcome, Exception):
                            raise outcome

            steps(warm)
            seconds, _ = timed(device, lambda: steps(timed_steps))
            fps = count * timed_steps / seconds
            baseline = baselines.setdefault(variant, fps)
            row = {"variant": variant, "streams": count, "ms_per_step": 1e3 * seconds / timed_steps,
                   "frames_per_s": fps, "speedup_over_one": fps / baseline, "batched_rows": batcher.batched_rows}
            row.update({key: value for key, value in profile_counts(device, lambda: steps(2), 2).items()
                        if key != "top_kernels"})
            row.update(traced_ops(lambda: steps(1), 1))
            row["peak_gib"] = peak_gib(device)
            section.rows.append(row)
            print(f"   {row}", flush=True)
            for prefill in prefills:
                prefill.close()
            del prefills, batcher
            release_memory()
    for variant, name in (("graph", "steps_speedup"), ("graph + compiled", "compiled_steps_speedup")):
        rows = [row for row in section.rows if "frames_per_s" in row and row["variant"] == variant]
        if rows:
            section.figures[name] = {row["streams"]: round(row["speedup_over_one"], 2) for row in rows}


def cache_tiers(section: Section, deadline: float, shapes: Shapes, checkpoint: Path, folder: Path) -> None:
    import statekv

    video = frames_of(shapes, shapes.tier_frames, 2)
    half = len(video) // 2
    memory = "model dtype, on the GPU" if shapes.device.startswith("cuda") else "model dtype"
    places = [({}, [(memory, None), ("int4", "int4")]),
              ({"offload": "disk", "offload_dir": str(folder / "tiers")}, [("disk", None), ("disk int4", "int4")])]
    for options, tiers in places:
        qa = statekv.VideoQA.from_pretrained(str(checkpoint), **vlm_options(shapes, **options))
        for label, kv_cache_dtype in tiers:
            if time.monotonic() > deadline:
                section.rows.append({"tier": label, "error": "not run: the section's time cap was reached"})
                continue
            reset_peak(shapes.device)
            stream = qa.stream(horizon_frames=len(video), kv_cache_dtype=kv_cache_dtype, name=label.replace(" ", "-"))
            for image in video[:half]:
                stream.push(image)
            seconds, _ = timed(shapes.device, lambda: [stream.push(image) for image in video[half:]])
            ask_seconds, _ = timed(shapes.device, lambda: stream.ask("What happened?", max_new_tokens=4))
            stats = stream.stats
            section.rows.append({"tier": label, "ms_per_frame": 1e3 * seconds / (len(video) - half),
                                 "cache_mib": stats.cache_bytes / 2**20, "peak_gib": peak_gib(shapes.device),
                                 "peak_cache_device_mib": stats.peak_cache_device_bytes / 2**20,
                                 "resident_gib": resident_gib(), "ask_s": ask_seconds})
            print(f"   {section.rows[-1]}", flush=True)
            stream.close()
            del stream
        del qa
        release_memory()
