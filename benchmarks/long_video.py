"""An hour of video on one GPU: encode time per frame, peak memory, and time to answer from 64 retrieved frames
against the whole detailed cache.

The language model of InternVL3-8B (random bf16 weights: a forward's cost does not depend on them) streams
``--frames`` frames of 256 tokens under StateKV with and without offload and under ReKV (its detailed cache
always in CPU memory), then answers one question from the 64 frames per layer that best match it
(``Retrieval``) and, where the detailed cache is on the GPU, from all of it.

    python benchmarks/long_video.py --device cuda --frames 3600 --out docs/benchmarks.md   # GPU (H100: ~1 h)
    python benchmarks/long_video.py --smoke                                                # CPU, tiny, seconds
    python benchmarks/long_video.py --ten-hours --out docs/benchmarks.md --plot docs/figures/long_stream.png

``--ten-hours`` runs `long_stream.py` instead (its options follow): 36,000 frames streamed on a CPU with the
detailed cache on disk, stored int4; resident memory and disk over time, ms per frame, ask latency.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import statekv  # noqa: E402
from statekv.settings.methods import MethodSettings, method  # noqa: E402
from walltime import internvl3_8b_language_config, random_model  # noqa: E402

PREFIX_TOKENS = 16
QUESTION_TOKENS = 24


@dataclass
class Row:
    label: str
    offload: bool
    ms_per_frame: float
    peak_gib: float
    cache_gib: float
    answer_retrieved_s: float
    answer_whole_s: float | None


def tiny_language_model():
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    return random_model(config, torch.device("cpu"), torch.float32)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure(model, name: str, settings: MethodSettings, *, frames: int, tokens: int, offload: bool,
            retrieve: int) -> Row:
    device, dtype = model.device, model.dtype
    spec = method(name)
    horizon = PREFIX_TOKENS + frames * tokens + QUESTION_TOKENS + 8
    policy = spec.policy(settings, 1).for_prefix(PREFIX_TOKENS)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    prefill = statekv.StreamingPrefill(model, policy, horizon=horizon, offload=offload)
    generator = torch.Generator().manual_seed(0)
    hidden = model.config.hidden_size
    prefill.step(inputs_embeds=(torch.randn(1, PREFIX_TOKENS, hidden, generator=generator) * 0.02).to(device, dtype))
    frame = (torch.randn(1, tokens, hidden, generator=generator) * 0.02).to(device, dtype)
    seconds = []
    for _ in range(frames):
        synchronize(device)
        start = time.perf_counter()
        prefill.step(inputs_embeds=frame)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    question = torch.randint(0, model.config.vocab_size, (1, QUESTION_TOKENS), generator=generator).to(device)
    keep = max(PREFIX_TOKENS, policy.sink_tokens)

    def answer(retrieval) -> float:
        synchronize(device)
        start = time.perf_counter()
        prefill.generate(question, max_new_tokens=8, retrieve=retrieval)
        synchronize(device)
        return time.perf_counter() - start

    answer(statekv.Retrieval(retrieve, keep_tokens=keep))  # warm-up (one-time kernel choices)
    retrieved = answer(statekv.Retrieval(retrieve, keep_tokens=keep))
    whole = None if offload else answer(None)
    stats = prefill.stats
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else stats.peak_device_bytes
    label = spec.label(settings) + (" offloaded" if offload else "")
    steady = seconds[len(seconds) // 2:]
    return Row(label, offload, 1e3 * statistics.median(steady), peak / 2**30, stats.detailed_bytes / 2**30,
               retrieved, whole)


def report(rows: list[Row], header: list[str], retrieve: int, budget: int) -> str:
    lines = [*header, "", "| method | ms / frame (median, 2nd half) | peak device memory GiB | detailed cache GiB | "
             f"answer, {retrieve} frames retrieved (s) | answer, whole cache (s) |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        whole = "n/a (offloaded)" if row.answer_whole_s is None else f"{row.answer_whole_s:.3f}"
        lines.append(f"| {row.label} | {row.ms_per_frame:.2f} | {row.peak_gib:.2f} | {row.cache_gib:.2f} | "
                     f"{row.answer_retrieved_s:.3f} | {whole} |")
    by_label = {row.label: row for row in rows}
    resident, offloaded = by_label.get(f"StateKV B={budget}"), by_label.get(f"StateKV B={budget} offloaded")
    if resident and offloaded:
        lines.append(f"\nStateKV with offload / without: {offloaded.ms_per_frame / resident.ms_per_frame:.3f}x per "
                     "frame.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--ten-hours" in argv:
        import long_stream

        return long_stream.main([arg for arg in argv if arg != "--ten-hours"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--frames", type=int, default=3600)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per frame")
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--window", type=int, default=16, help="ReKV's window R in frames")
    parser.add_argument("--retrieve", type=int, default=64, help="frames retrieved per layer to answer")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on CPU: 40 frames of 8 tokens")
    parser.add_argument("--out", type=Path, help="write the results into this markdown file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.smoke:
        torch.set_num_threads(min(2, torch.get_num_threads()))
        model, args.frames, args.tokens, args.budget, args.window, args.retrieve = tiny_language_model(), 40, 8, 64, 4, 8
        what = "tiny 2-layer Qwen2 decoder, CPU, fp32 (smoke run: the figures mean nothing)"
    elif device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit("benchmarks/long_video.py: the full run needs a CUDA device (--device cuda); --smoke runs "
                         "a tiny model on CPU")
    else:
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        config = internvl3_8b_language_config(max_positions=(args.frames + 2) * args.tokens)
        model = random_model(config, device, torch.bfloat16)
        what = f"InternVL3-8B language model, random bf16 weights, {torch.cuda.get_device_name(device)}"
    runs = [("statekv", MethodSettings(budget=args.budget), False), ("statekv", MethodSettings(budget=args.budget), True),
            ("rekv", MethodSettings(frames=args.window), True)]
    rows = []
    for name, settings, offload in runs:
        rows.append(measure(model, name, settings, frames=args.frames, tokens=args.tokens, offload=offload,
                            retrieve=args.retrieve))
        print(rows[-1], file=sys.stderr, flush=True)
    header = [f"{what}; {args.frames} frames of {args.tokens} tokens after a {PREFIX_TOKENS}-token prefix; a "
              f"{QUESTION_TOKENS}-token question, 8 answer tokens; {args.retrieve} frames retrieved per layer.",
              f"Command: `python benchmarks/long_video.py {shlex.join(argv if argv is not None else sys.argv[1:])}`; "
              f"torch {torch.__version__}."]
    text = report(rows, header, args.retrieve, args.budget)
    print(text)
    if args.out:
        from report import write_section

        write_section(args.out, "Long video: offload and retrieval" + (" (CPU smoke)" if args.smoke else " (GPU)"),
                      text)
    return text


if __name__ == "__main__":
    main()
