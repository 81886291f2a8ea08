"""Micro-benchmark of the carried state's selection at the 8B shapes (CUDA only): the parts of a StateKV step
after its scores, per step of 28 layers (4 KV heads, B = 4096 kept of 4096 + 259 candidates).

Each variant runs eagerly, 100 steps back to back between two CUDA events, so a variant of many small ops is
bound by the host's launches: read it for eager steps (the carried state filling, a stream without graphs);
the GPU suite's breakdown of GPU time by kernel kind is what a graph-replayed step pays.

* ``topk``: the top-B candidates, unordered;
* ``topk + sort``: ordered by sorting them (a radix sort per row), what the engine did before;
* ``topk + in_time_order``: ordered by `statekv.core.rules.scored.in_time_order`, what it does now;
* ``gather + copy back``: the kept keys and values gathered element by element and written to the first B slots,
  with their positions (what `CarriedSlots.keep` does);
* ``index_select rows + copy back``: the same, each kept slot copied as one row of a flat view (tried, reverted).

    python benchmarks/selection_gpu.py
"""

from __future__ import annotations

import sys

import torch

from statekv.core.rules import in_time_order

LAYERS, HEADS, BUDGET, FRAME, DIM = 28, 4, 4096, 259, 128
CANDIDATES = BUDGET + FRAME
STEPS = 100


def timed_ms(step) -> float:
    """Milliseconds per call of ``step``, over `STEPS` calls after three warm-ups."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(STEPS):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / STEPS


def rows(kv: torch.Tensor, selection: torch.Tensor) -> torch.Tensor:
    """``kv [2, 1, H, N, D]`` at ``selection [1, H, K]``, each slot copied as one row of a flat view."""
    two, b, h, size, d = kv.shape
    starts = torch.arange(0, b * h * size, size, device=kv.device).view(b, h, 1)
    return kv.view(two, b * h * size, d).index_select(1, (selection + starts).view(-1)).view(two, b, h, -1, d)


def main() -> int:
    if not torch.cuda.is_available():
        print("selection_gpu.py measures a GPU: no CUDA device here", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    scores = [torch.rand(1, HEADS, CANDIDATES, device="cuda") for _ in range(LAYERS)]
    kv = [torch.randn(2, 1, HEADS, CANDIDATES, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    positions = [torch.arange(CANDIDATES, device="cuda").expand(1, HEADS, -1).contiguous() for _ in range(LAYERS)]
    kept = [s.topk(BUDGET, dim=-1, sorted=False).indices.sort(dim=-1).values for s in scores]

    def gathered(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x.gather(3, index[None, ..., None].expand(2, -1, -1, -1, DIM))

    same = all(torch.equal(in_time_order(s.topk(BUDGET, dim=-1, sorted=False).indices, CANDIDATES), k)
               and torch.equal(rows(x, k), gathered(x, k)) for s, x, k in zip(scores, kv, kept))
    print(f"the variants give the same indices and rows: {same}")

    def copy_back(select):
        def step():
            for x, p, k in zip(kv, positions, kept):
                x[:, :, :, :BUDGET] = select(x, k)
                p[..., :BUDGET] = p.gather(2, k)
        return step

    variants = {
        "topk": lambda: [s.topk(BUDGET, dim=-1, sorted=False) for s in scores],
        "topk + sort": lambda: [s.topk(BUDGET, dim=-1, sorted=False).indices.sort(dim=-1) for s in scores],
        "topk + in_time_order": lambda: [in_time_order(s.topk(BUDGET, dim=-1, sorted=False).indices, CANDIDATES)
                                         for s in scores],
        "gather + copy back": copy_back(gathered),
        "index_select rows + copy back": copy_back(rows),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per step of {LAYERS} layers, eager")
    for name, step in variants.items():
        print(f"| {name} | {timed_ms(step):.3f} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
