"""What one ask asks of the host on a deep decoder: the ATen ops it dispatches (compute ops, and the buffer queries
among the rest) and its time, median of ``--asks``.

A random Qwen2 decoder of ``--layers`` tiny layers streams ``--steps`` chunks of 16 tokens under StateKV B=64,
then answers a 12-token prompt with one token; the first ask is a warm-up. Its op counts are what a GPU would
launch, less the buffer queries (``is_pinned``: host work only). Compare two commits by running it under each
(``PYTHONPATH=<checkout>``, from outside the checkout):

    python benchmarks/ask_host_ops.py --layers 24
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import statekv
from statekv.testing.op_trace import OpTrace


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--asks", type=int, default=60)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=8192)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    prompt = torch.randint(3, 290, (1, 12))
    with torch.no_grad(), statekv.StreamingPrefill(model, statekv.StateKV(budget=64), horizon=2000) as prefill:
        for _ in range(args.steps):
            prefill.step(inputs_embeds=0.02 * torch.randn(1, 16, 64))
        prefill.generate(prompt, max_new_tokens=1)
        with OpTrace() as trace:
            prefill.generate(prompt, max_new_tokens=1)
        times = []
        for _ in range(args.asks):
            started = time.perf_counter()
            prefill.generate(prompt, max_new_tokens=1)
            times.append(time.perf_counter() - started)
    counted = collections.Counter(trace.compute)
    queries = counted.pop("is_pinned.default", 0)
    print(f"layers {args.layers}: {sum(counted.values())} compute ops, {queries} buffer queries, "
          f"{len(trace.syncs)} host syncs; ask median {1e3 * statistics.median(times):.2f} ms over {args.asks}")


if __name__ == "__main__":
    main()
