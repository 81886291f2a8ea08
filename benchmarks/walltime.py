"""Per-frame latency versus frame index: full attention (SDPA) vs StateKV with eager or Triton scores.

The paper's wall-time figure (supplementary, "wall-time comparison"), on a real-size language model with
random weights (the cost of a forward does not depend on the weights): InternVL3-8B's LM, a Qwen2 decoder
(hidden 3584, 28 layers, 28/4 heads, head dim 128, FFN 18944, vocab 151674, rope_theta 1e6), bf16 on CUDA,
259 tokens per frame (one InternVL frame).

What each point means -- "given the preceding cache, process one more frame":

* full attention: a plain transformers forward of the decoder (SDPA) on one frame with a ``DynamicCache``
  already holding ``n * 259`` random keys/values per layer (synthesised; their values do not change the
  cost). The cache is trimmed back to ``n * 259`` tokens between repeats. Reported: mean and std over
  ``--repeats`` after warm-up.
* StateKV: ``statekv.StreamingPrefill(model, StateKV(budget=B), attention=eager|triton)`` streams random
  frame embeddings from frame 0; the state before frame ``n`` is therefore the real carried state built by
  streaming (not synthesised). Each ``step`` is timed; a point is the mean and std over the steps of the
  ``--window`` frames ending at ``n``. A short throw-away stream first compiles and autotunes the kernels.

The crossover for each StateKV curve is where the least-squares line through the full-attention points
meets StateKV's steady per-frame cost (median over the frames after its state is full).

    python benchmarks/walltime.py --out docs/benchmarks.md --plot docs/figures/walltime.png
    python benchmarks/walltime.py --quick
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

FRAME_TOKENS = 259


def internvl3_8b_language_config(max_positions: int):
    """The Qwen2 decoder of InternVL3-8B (default RoPE: its scaling type does not change the cost)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        intermediate_size=18944, vocab_size=151674, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=max_positions,
    )


def random_model(config, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A causal LM built from ``config`` directly on ``device`` with transformers' random init (no download)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


class Stopwatch:
    """Milliseconds of one call: CUDA events on a GPU, the wall clock elsewhere (smoke runs only)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)


def frame_embeddings(model: torch.nn.Module, generator: torch.Generator) -> torch.Tensor:
    """``[1, 259, hidden]``: embeddings of random token ids, so activations have the model's own scale."""
    embed = model.get_input_embeddings()
    ids = torch.randint(0, embed.num_embeddings, (1, FRAME_TOKENS), generator=generator)
    return embed(ids.to(embed.weight.device))


@dataclass
class Curve:
    """Per-frame latency (ms) at frame indices: mean and standard deviation."""

    label: str
    points: dict[int, tuple[float, float]] = field(default_factory=dict)
    steady_ms: float | None = None  # StateKV: median cost once the carried state is full


def _mean_std(samples: list[float]) -> tuple[float, float]:
    return statistics.fmean(samples), (statistics.stdev(samples) if len(samples) > 1 else 0.0)


def _trim(cache, length: int) -> None:
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


@torch.no_grad()
def full_attention_curve(model, frame_indices: list[int], repeats: int, warmup: int, stopwatch: Stopwatch,
                         seed: int = 0) -> Curve:
    """Plain decoder forward of frame ``n`` over a synthesised ``DynamicCache`` of ``n * 259`` tokens."""
    from transformers import DynamicCache

    decoder, config = model.model, model.config
    device, dtype = model.device, model.dtype
    generator = torch.Generator().manual_seed(seed)
    longest = max(frame_indices) * FRAME_TOKENS
    cache = DynamicCache(config=config)
    kv_shape = (1, config.num_key_value_heads, longest, config.head_dim)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(kv_shape, device=device, dtype=dtype),
                     torch.randn(kv_shape, device=device, dtype=dtype), layer)
    curve = Curve("full attention (SDPA)")
    for index in sorted(frame_indices, reverse=True):  # shrinking the cache only ever takes views
        prefix = index * FRAME_TOKENS
        positions = torch.arange(prefix, prefix + FRAME_TOKENS, device=device)[None]
        samples = []
        for attempt in range(warmup + repeats):
            _trim(cache, prefix)
            frame = frame_embeddings(model, generator)
            ms = stopwatch(lambda: decoder(inputs_embeds=frame, position_ids=positions, past_key_values=cache,
                                           use_cache=True))
            if attempt >= warmup:
                samples.append(ms)
        curve.points[index] = _mean_std(samples)
    del cache
    return curve


@torch.no_grad()
def stream_step_times(model, budget: int, backend: str, frames: int, stopwatch: Stopwatch,
                      seed: int = 0) -> list[float]:
    """Milliseconds of each ``StreamingPrefill.step`` for frames ``0 .. frames - 1`` under StateKV(budget)."""
    import statekv

    generator = torch.Generator().manual_seed(seed)
    times = []
    with statekv.StreamingPrefill(model, statekv.StateKV(budget=budget), attention=backend,
                                  horizon=frames * FRAME_TOKENS) as stream:
        for _ in range(frames):
            frame = frame_embeddings(model, generator)
            times.append(stopwatch(lambda: stream.step(inputs_embeds=frame)))
    return times


def frames_to_fill(budget: int) -> int:
    """Steps after which the carried state holds ``budget`` tokens (selection starts on the next one)."""
    return math.ceil(budget / FRAME_TOKENS) + 1


def statekv_curve(model, budget: int, backend: str, frame_indices: list[int], window: int,
                  stopwatch: Stopwatch) -> Curve:
    # Compile and autotune first (Triton tunes once per bucket of key lengths), outside the measurement.
    stream_step_times(model, budget, backend, frames_to_fill(budget) + 2, stopwatch, seed=1)
    times = stream_step_times(model, budget, backend, max(frame_indices) + 1, stopwatch)
    curve = Curve(f"StateKV B={budget} ({backend})")
    for index in frame_indices:
        curve.points[index] = _mean_std(times[max(0, index - window + 1): index + 1])
    steady = times[frames_to_fill(budget):]
    curve.steady_ms = statistics.median(steady) if steady else None
    return curve


def linear_fit(points: dict[int, tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of mean latency against frame index."""
    xs = list(points)
    ys = [points[x][0] for x in xs]
    x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - x_mean) ** 2 for x in xs)
    slope = sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return y_mean - slope * x_mean, slope


def crossover_frame(full: Curve, curve: Curve) -> float | None:
    """Frame index from which StateKV's steady per-frame cost is below full attention's fitted line."""
    intercept, slope = linear_fit(full.points)
    if curve.steady_ms is None or slope <= 0:
        return None
    return max(0.0, (curve.steady_ms - intercept) / slope)


def markdown_report(full: Curve, curves: list[Curve], header: list[str]) -> str:
    indices = sorted(full.points)
    columns = [full, *curves]
    lines = [*header, "", "| frame | " + " | ".join(c.label for c in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for index in indices:
        cells = [f"{c.points[index][0]:.1f} ± {c.points[index][1]:.1f}" for c in columns]
        lines.append(f"| {index} | " + " | ".join(cells) + " |")
    lines.append("")
    intercept, slope = linear_fit(full.points)
    lines.append(f"Full attention fit: {intercept:.1f} ms + {slope:.3f} ms/frame.")
    for curve in curves:
        cross = crossover_frame(full, curve)
        where = "not within a growing full-attention cost" if cross is None else f"frame {cross:.0f}"
        steady = "n/a (state never full)" if curve.steady_ms is None else f"{curve.steady_ms:.1f} ms"
        lines.append(f"- {curve.label}: steady {steady}; crossover {where}")
    return "\n".join(lines) + "\n"


def plot(full: Curve, curves: list[Curve], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = sorted({c.label.rsplit("(", 1)[1].rstrip(")") for c in curves})
    figure, axes = plt.subplots(1, len(backends), figsize=(6 * len(backends), 4), squeeze=False)
    for axis, backend in zip(axes[0], backends):
        for curve in [c for c in curves if c.label.endswith(f"({backend})")]:
            xs = sorted(curve.points)
            axis.errorbar(xs, [curve.points[x][0] for x in xs], yerr=[curve.points[x][1] for x in xs],
                          label=curve.label.split(" (")[0], capsize=2)
        xs = sorted(full.points)
        axis.errorbar(xs, [full.points[x][0] for x in xs], yerr=[full.points[x][1] for x in xs],
                      label=full.label, color="black", linestyle="--", capsize=2)
        axis.set(title=f"StateKV with {backend} scores", xlabel="frame index", ylabel="ms per frame")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="CUDA device to measure on (default: cuda)")
    parser.add_argument("--frames", type=int, default=512, help="largest frame index")
    parser.add_argument("--points", type=int, default=9, help="frame indices sampled between 1 and --frames")
    parser.add_argument("--budgets", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--backends", nargs="+", choices=("eager", "triton"), default=["eager", "triton"])
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per full-attention point")
    parser.add_argument("--warmup", type=int, default=3, help="untimed forwards before each full-attention point")
    parser.add_argument("--window", type=int, default=8, help="streamed frames averaged per StateKV point")
    parser.add_argument("--quick", action="store_true",
                        help="64 frames, budgets 1024 and 4096, 5 repeats: a few minutes end to end")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--plot", type=Path, help="write a matplotlib figure here (PNG/PDF)")
    args = parser.parse_args(argv)
    if args.quick:
        args.frames, args.points, args.budgets, args.repeats = 64, 5, [1024, 4096], 5
    return args


def frame_indices(frames: int, points: int) -> list[int]:
    return sorted({1, *(round(frames * i / (points - 1)) for i in range(1, points))}) if points > 1 else [frames]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit(
            f"benchmarks/walltime.py measures GPU latency; device {args.device!r} is not an available CUDA device"
        )
    if device.index is None:  # set_device needs an index: "cuda" means the current device
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    indices = frame_indices(args.frames, args.points)
    stopwatch = Stopwatch(device)
    config = internvl3_8b_language_config(max_positions=(args.frames + 1) * FRAME_TOKENS)
    model = random_model(config, device, torch.bfloat16)

    full = full_attention_curve(model, indices, args.repeats, args.warmup, stopwatch)
    print(f"full attention done: {full.points}", file=sys.stderr)
    torch.cuda.empty_cache()
    curves = []
    for backend in args.backends:
        for budget in args.budgets:
            curves.append(statekv_curve(model, budget, backend, indices, args.window, stopwatch))
            print(f"{curves[-1].label}: steady {curves[-1].steady_ms}", file=sys.stderr)
            torch.cuda.empty_cache()

    import transformers

    header = [
        "# Per-frame latency vs frame index (InternVL3-8B language model, random weights, bf16)",
        "",
        f"- device: {torch.cuda.get_device_name(device)}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        f"- command: python {shlex.join(sys.argv)}",
        f"- {FRAME_TOKENS} tokens per frame; full attention: decoder forward with SDPA over a synthesised "
        f"DynamicCache, {args.repeats} repeats after {args.warmup} warm-up; StateKV: streamed from frame 0, "
        f"mean ± std over the {args.window} frames ending at each index",
    ]
    report = markdown_report(full, curves, header)
    print(report)
    if args.out:
        sys.path.insert(0, str(Path(__file__).parent))
        from report import write_section

        write_section(args.out, "Per-frame wall time (GPU)", report)
    if args.plot:
        plot(full, curves, args.plot)


if __name__ == "__main__":
    main()
