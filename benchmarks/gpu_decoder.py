"""The GPU suite's sections on a large decoder alone: the 8B step, bounded positions' cost per step, and the
512-frame prefill."""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any, Callable

from gpu_measure import (compiled_graphs, peak_gib, profile_counts, release_memory, reset_peak, synchronize,
                         timed, traced_ops)
from gpu_shapes import Section, Shapes


class LanguageModel:
    """A random decoder of the large shape and its frames' embeddings ``[1, T, D]``."""

    def __init__(self, shapes: Shapes, frames: int):
        import torch
        from transformers import AutoModelForCausalLM, Qwen2Config

        self.shapes, self.device = shapes, shapes.device
        self.dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        config = Qwen2Config(**shapes.lm, max_position_embeddings=(frames + 8) * shapes.frame_tokens)
        with torch.device(self.device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, attn_implementation="sdpa").eval()
        generator = torch.Generator(device=self.device).manual_seed(0)
        self.frames = [0.02 * torch.randn(1, shapes.frame_tokens, config.hidden_size, device=self.device,
                                          dtype=self.dtype, generator=generator) for _ in range(frames)]
        self.config = config


def step_variants(shapes: Shapes) -> list[tuple[str, Callable[[], Any], dict[str, Any]]]:
    """(label, policy factory, engine settings) of the measured streamed steps. A label without ``graph`` steps
    eagerly (``cuda_graph`` off, so its launches are the eager step's); ``compiled``: the decoder of steady steps
    compiled by torch.compile (`statekv.core.step.compiled`)."""
    import statekv

    budget, window = shapes.budget, shapes.window_frames
    eager, graph, compiled = dict(cuda_graph=False), dict(cuda_graph=True), dict(cuda_graph=True, compile_step=True)
    return [
        (f"StateKV B={budget} eager", lambda: statekv.StateKV(budget=budget), dict(attention="eager", **eager)),
        (f"StateKV B={budget} triton", lambda: statekv.StateKV(budget=budget), dict(attention="triton", **eager)),
        (f"StateKV B={budget} triton + graph", lambda: statekv.StateKV(budget=budget), dict(attention="triton",
                                                                                          **graph)),
        (f"StateKV B={budget} triton + graph + compiled", lambda: statekv.StateKV(budget=budget),
         dict(attention="triton", **compiled)),
        (f"recency R={window}", lambda: statekv.Recency(frames=window), eager),
        (f"recency R={window} + graph", lambda: statekv.Recency(frames=window), graph),
        (f"recency R={window} + graph + compiled", lambda: statekv.Recency(frames=window), compiled),
    ]


def hf_cache(lm: LanguageModel, cached_frames: int):
    """Hugging Face's own cache of the first ``cached_frames`` frames (a ``DynamicCache``)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.config)
    with torch.no_grad():
        for start in range(0, cached_frames, 64):
            lm.model.model(inputs_embeds=torch.cat(lm.frames[start:min(start + 64, cached_frames)], 1),
                           past_key_values=cache, use_cache=True)
    return cache


def hf_one_frame(lm: LanguageModel, cache, repeats: int) -> float:
    """Hugging Face's own forward of one more frame over ``cache`` (SDPA), seconds per frame; the cache is
    cropped back after each."""
    import torch

    frame, tokens = lm.frames[-1], lm.shapes.frame_tokens

    def one():
        lm.model.model(inputs_embeds=frame, past_key_values=cache, use_cache=True)
        cache.crop(-tokens)

    with torch.no_grad():
        one()
        seconds, _ = timed(lm.device, lambda: [one() for _ in range(repeats)])
    return seconds / repeats


def lm_step(section: Section, deadline: float, lm: LanguageModel) -> None:
    import statekv
    import torch

    shapes, device = lm.shapes, lm.device
    warm, count = shapes.step_warmup, shapes.step_timed
    with torch.no_grad():
        for label, policy, settings in step_variants(shapes):
            row: dict[str, Any] = {"variant": label}
            section.rows.append(row)
            if time.monotonic() > deadline:
                row["error"] = "not run: the section's time cap was reached"
                continue
            if settings.get("attention") == "triton" and not device.startswith("cuda"):
                settings = dict(settings, attention="chunked")
                row["note"] = "CPU run: chunked scoring in place of the Triton kernels"
            try:
                reset_peak(device)
                with statekv.StreamingPrefill(lm.model, policy(), horizon=(warm + 3 * count + 2) * shapes.frame_tokens,
                                              **settings) as prefill:
                    frames = iter(lm.frames)
                    warmed, _ = timed(device, lambda: [prefill.step(inputs_embeds=next(frames)) for _ in range(warm)])
                    row["warmup_s"] = warmed  # a compiled step compiles in its first steady step
                    graphs = compiled_graphs()
                    seconds, _ = timed(device, lambda: [prefill.step(inputs_embeds=next(frames))
                                                        for _ in range(count)])
                    row["ms_per_frame"] = 1e3 * seconds / count
                    row["compiled_while_timed"] = compiled_graphs() - graphs  # 0: nothing compiled in the timing
                    row.update(profile_counts(device, lambda: [prefill.step(inputs_embeds=next(frames))
                                                               for _ in range(2)], 2))
                    row.update(traced_ops(lambda: [prefill.step(inputs_embeds=next(frames)) for _ in range(2)], 2))
                    stats = prefill.stats
                    row["graph_replays"] = stats.graph_replays
                    row["carried_tokens"] = stats.max_carried_tokens
                    row["peak_gib"] = peak_gib(device)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
            print(f"   {row}", flush=True)
        if time.monotonic() < deadline:
            context = -(-shapes.budget // shapes.frame_tokens)
            row = {"variant": f"Hugging Face one frame over {context} cached frames"}
            cache = hf_cache(lm, context)
            row["ms_per_frame"] = 1e3 * hf_one_frame(lm, cache, max(2, count // 2))
            row.update(profile_counts(device, lambda: hf_one_frame(lm, cache, 1), 2))
            del cache
            section.rows.append(row)
    graphed = [row for row in section.rows if "graph" in row["variant"] and "StateKV" in row["variant"]
               and "ms_per_frame" in row]
    if graphed:
        best = min(graphed, key=lambda row: row["ms_per_frame"])
        section.figures["statekv_graph_ms"] = best["ms_per_frame"]
        section.figures["statekv_graph_variant"] = best["variant"]
        if "launches" in best:
            section.figures["statekv_graph_launches"] = best["launches"] + best["graph_launches"]
    eager = [row for row in section.rows if row["variant"].endswith("eager") and "launches" in row]
    if eager:
        section.figures["statekv_eager_launches"] = eager[0]["launches"]


def with_range(lm: LanguageModel, tokens: int, open_stream: Callable[[], Any]) -> Any:
    """A stream opened while ``lm``'s declared range is ``tokens`` (the engine reads it when a stream opens)."""
    declared = lm.config.max_position_embeddings
    lm.config.max_position_embeddings = tokens
    try:
        return open_stream()
    finally:
        lm.config.max_position_embeddings = declared


def positions(section: Section, deadline: float, lm: LanguageModel) -> None:
    """The graphed StateKV steps of `step_variants` with bounded positions past the model's range against stream
    positions (issue 48's 5%). The bounded stream sees the decoder's declared range lowered to its budget and eight
    frames, the other's set to its horizon (the weights and the rotary module are untouched: only the engine
    reads that number, when a stream opens), so the bounded stream's warm-up passes the range and every timed step
    of it is placed (in cache order, the default past the range). Both streams declare the same horizon, so their
    detailed buffers are made at once and never move: without one they grow, and each growth re-records the step's
    graph (``timed_steps_replayed`` counts the timed steps that replayed). The two streams are timed in turn,
    ``shapes.step_timed`` steps a block, three blocks each; each row's ``ms_per_frame`` is the median block."""
    import statistics

    import statekv
    import torch

    shapes, device = lm.shapes, lm.device
    count, frames_per_range = shapes.step_timed, -(-shapes.budget // shapes.frame_tokens) + 8
    warm, blocks = frames_per_range + 4, 3
    variants = [(label, settings) for label, _, settings in step_variants(shapes)
                if label.startswith("StateKV") and "graph" in label]
    with torch.no_grad():
        for label, settings in variants:
            if time.monotonic() > deadline:
                section.rows.append({"variant": label, "error": "not run: the section's time cap was reached"})
                continue
            if not device.startswith("cuda"):
                settings = dict(settings, attention="chunked")
            rows = {mode: {"variant": label, "positions": mode} for mode in ("stream", "bounded")}
            try:
                with contextlib.ExitStack() as streams:
                    horizon = (warm + blocks * count + 6) * shapes.frame_tokens
                    opened = {mode: streams.enter_context(with_range(
                        lm, horizon if mode == "stream" else frames_per_range * shapes.frame_tokens,
                        lambda: statekv.StreamingPrefill(lm.model, statekv.StateKV(budget=shapes.budget),
                                                         positions=mode, horizon=horizon, **extra, **settings)))
                              for mode, extra in (("stream", {}), ("bounded", {"bounded_layout": "cache"}))}
                    feeds = {mode: itertools.cycle(lm.frames) for mode in opened}
                    for mode, prefill in opened.items():
                        warmed, _ = timed(device, lambda: [prefill.step(inputs_embeds=next(feeds[mode]))
                                                           for _ in range(warm)])
                        rows[mode]["warmup_s"] = warmed
                    graphs, times = compiled_graphs(), {mode: [] for mode in opened}
                    replays = {mode: prefill.stats.graph_replays for mode, prefill in opened.items()}
                    for _ in range(blocks):
                        for mode, prefill in opened.items():
                            seconds, _ = timed(device, lambda: [prefill.step(inputs_embeds=next(feeds[mode]))
                                                                for _ in range(count)])
                            times[mode].append(1e3 * seconds / count)
                    compiled_while_timed = compiled_graphs() - graphs  # both streams' timed steps together
                    for mode, prefill in opened.items():
                        row = rows[mode]
                        row["ms_per_frame"] = statistics.median(times[mode])
                        row["placed"] = prefill.positions.moved
                        row["timed_steps_replayed"] = prefill.stats.graph_replays - replays[mode]
                        row.update(profile_counts(device, lambda: [prefill.step(inputs_embeds=next(feeds[mode]))
                                                                   for _ in range(2)], 2))
                        row["graph_replays"] = prefill.stats.graph_replays
                    rows["bounded"]["over_stream"] = rows["bounded"]["ms_per_frame"] / rows["stream"]["ms_per_frame"]
                    if "gpu_busy_ms" in rows["stream"]:
                        rows["bounded"]["gpu_busy_over_stream"] = (rows["bounded"]["gpu_busy_ms"]
                                                                   / rows["stream"]["gpu_busy_ms"])
                    rows["bounded"]["compiled_while_timed"] = compiled_while_timed
            except Exception as error:
                first_line = str(error).splitlines()[0] if str(error) else ""
                rows["bounded"]["error"] = f"{type(error).__name__}: {first_line}"[:300]
            section.rows.extend(rows.values())
            print(f"   {list(rows.values())}", flush=True)
    # the goal's figure: the worst variant's GPU time, profiled (wall time where no profile was taken, on a CPU)
    ratios = {row["variant"]: row.get("gpu_busy_over_stream", row["over_stream"]) for row in section.rows
              if "over_stream" in row}
    if ratios:
        section.figures["bounded_variant"] = max(ratios, key=ratios.get)
        section.figures["bounded_ratio"] = ratios[section.figures["bounded_variant"]]


def prefill(section: Section, deadline: float, lm: LanguageModel) -> None:
    import statekv
    import torch

    shapes, device = lm.shapes, lm.device
    count = shapes.prefill_frames
    frames = lm.frames[:count]
    backend = "triton" if device.startswith("cuda") else "eager"
    with torch.no_grad():
        reset_peak(device)
        whole = torch.cat(frames, 1)
        seconds, output = timed(device, lambda: lm.model(inputs_embeds=whole, logits_to_keep=1, use_cache=True))
        one_shot = {"variant": f"one-shot Hugging Face SDPA forward, {count} frames", "seconds": seconds,
                    "frames": count, "peak_gib": peak_gib(device)}
        section.rows.append(one_shot)
        del whole
        print(f"   {one_shot}", flush=True)
        full_frame = hf_one_frame(lm, output.past_key_values, 2)
        section.rows.append({"variant": f"Hugging Face one frame over {count} cached frames (full attention's "
                                        "cost there)", "ms_per_frame": 1e3 * full_frame})
        del output
        release_memory()
        for label, policy, compile_step in [
                (f"StateKV B={shapes.budget} {backend} + graph", statekv.StateKV(budget=shapes.budget), False),
                (f"StateKV B={shapes.budget} {backend} + graph + compiled", statekv.StateKV(budget=shapes.budget),
                 True),
                (f"recency R={shapes.window_frames} + graph", statekv.Recency(frames=shapes.window_frames), False)]:
            if time.monotonic() > deadline:
                section.rows.append({"variant": label, "error": "not run: the section's time cap was reached"})
                continue
            reset_peak(device)
            blocks = []  # (frames, seconds) per block of 32 frames, synchronized at its end only
            # compiled: the step section compiled this shape (the cache's state is no guard), else in the loop
            graphs = compiled_graphs()
            with statekv.StreamingPrefill(lm.model, policy, attention=backend, cuda_graph=True,
                                          compile_step=compile_step, horizon=count * shapes.frame_tokens) as streamed:
                synchronize(device)
                started = block_started = time.perf_counter()
                for index, frame in enumerate(frames, start=1):
                    streamed.step(inputs_embeds=frame)
                    if index % 32 == 0 or index == count or time.monotonic() > deadline:
                        synchronize(device)
                        now = time.perf_counter()
                        blocks.append((index - sum(n for n, _ in blocks), now - block_started))
                        block_started = now
                        if time.monotonic() > deadline:
                            break
                total = time.perf_counter() - started
            done = sum(n for n, _ in blocks)
            tail = 1e3 * blocks[-1][1] / blocks[-1][0]
            row = {"variant": label, "seconds": total, "frames": done, "peak_gib": peak_gib(device),
                   "ms_per_frame_last_block": tail, "compiled_while_timed": compiled_graphs() - graphs}
            if done < count:  # the rest at the last block's pace, said so
                row["seconds_for_all_estimated"] = total + (count - done) * tail / 1e3
            section.rows.append(row)
            print(f"   {row}", flush=True)
    streamed_rows = [row for row in section.rows if row["variant"].startswith("StateKV") and "seconds" in row]
    if streamed_rows:
        best = min(streamed_rows, key=lambda row: row.get("seconds_for_all_estimated", row["seconds"]))
        section.figures["prefill_ratio"] = best.get("seconds_for_all_estimated", best["seconds"]) / one_shot["seconds"]
        section.figures["prefill_ratio_estimated"] = "seconds_for_all_estimated" in best
        section.figures["prefill_variant"] = best["variant"]
