"""Where each object frame's tokens put their attention while the frame is encoded, per layer and query head.

A frame writes what questions later read from the keys and values of its lower layers, computed while its step
ran (docs/accuracy.md, "Past the range: which keys and values lose full attention's answers"). This probe streams
synthetic videos (`statekv synthetic make`) through `VideoQA.stream()` under `StreamingPrefill.probing` and, at each
object frame's step, takes its visual token's and its ``</img>``'s queries against everything the step attends over
(the carried keys as the step placed them, then the chunk's own, causally): the attention each query head gives to
the frame's own tokens, the prompt's prefix (the stream's first step), the carried tokens of the last ``--recent``
positions before the frame, and everything farther; and the attention's entropy. Frames split, as in
`frame_readout.py`, at the step that ends past the positions the model declares.

    python benchmarks/attention_share.py --data data/dev2400 --method full --json runs/share/full.jsonl
    python benchmarks/attention_share.py --data data/dev2400 --method statekv --bounded-layout cache \\
        --json runs/share/statekv.jsonl

One JSON line per video (each object frame's shares, and how many carried keys its step attended over), then the
means per place (inside the range, past it), layer, token and head. ``--range N`` declares a shorter range, as in
`frame_readout.py`; a stream that hands over is refused, as there, and so is the recency baseline (its keys come in
ring-slot order, its positions in time order: they would not line up). Checkpoints whose frames are one
visual token then ``</img>`` only (the built-in model's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from frame_readout import add_set_arguments, open_model, push_video, read_set, truth

PLACES = ("own", "prefix", "recent", "far")
TOKENS = {"visual": 0, "</img>": 1}  # after a frame's (first) visual token


def shares(queries: torch.Tensor, keys: torch.Tensor, token: int, positions: torch.Tensor, prefix: int,
           recent_from: int) -> dict[str, list[float]]:
    """Attention of one chunk token over what its step attends to, split by where each key lies.

    queries: ``[Hq, T, D]`` the chunk's, rotated; keys: ``[H_kv, K + T, D]`` the carried then the chunk's;
    token: the query's index in the chunk (negative: from its end); positions: ``[H_kv, K]`` the carried keys'
    own positions in the stream; prefix: the prompt prefix's length; recent_from: the first position counted as
    recent.
    Returns each place's share per query head (summing to 1 over the places) and the entropy, in nats.
    """
    heads, chunk, dim = queries.shape
    carried = keys.shape[1] - chunk
    if not -chunk <= token < chunk or positions.shape[-1] != carried:
        raise ValueError(f"token {token} of a {chunk}-token chunk, {positions.shape[-1]} positions for {carried} "
                         "carried keys: out of the chunk, or positions that do not match the keys")
    token %= chunk
    group = heads // keys.shape[0]
    seen = keys[:, :carried + token + 1].repeat_interleave(group, 0).float()  # [Hq, K + token + 1, D]
    weights = torch.softmax(torch.einsum("hd,hkd->hk", queries[:, token].float(), seen) * dim ** -0.5, -1)
    carried_at = positions.repeat_interleave(group, 0)  # [Hq, K]
    on_carried = weights[:, :carried]
    split = {"own": weights[:, carried:].sum(-1),
             "prefix": (on_carried * (carried_at < prefix)).sum(-1),
             "recent": (on_carried * (carried_at >= max(prefix, recent_from))).sum(-1)}
    split["far"] = on_carried.sum(-1) - split["prefix"] - split["recent"]
    split["entropy"] = -(weights * weights.clamp_min(1e-30).log()).sum(-1)
    return {name: value.tolist() for name, value in split.items()}


class Shares:
    """A probe of one stream: each object frame step's shares at every layer, and where each frame step ends."""

    def __init__(self, stream, objects: set[int], recent: int):
        self.stream, self.objects, self.recent = stream, objects, recent
        starts = stream.prefill.cache.starts
        self.begun = len(starts) - 1  # the steps before the first frame
        self.prefix = starts[1] if self.begun else 0
        self.rows: dict[int, dict] = {}
        self.ends: list[int] = []  # each frame step's first position after its tokens at their own positions
        self.visual: list[int] = []  # where each frame step's first visual token lies in its chunk
        adapter, original = stream.qa.adapter, stream.qa.adapter.features_chunk
        image_end = adapter.tokenizer.convert_tokens_to_ids("</img>")

        def features_chunk(*args, **kwargs):
            chunk = original(*args, **kwargs)
            ids = chunk.input_ids[0]
            visual = int((ids == adapter.image_token_id).nonzero()[0, 0])
            if visual + 1 >= ids.numel() or int(ids[visual + 1]) != image_end:
                raise SystemExit("this probe reads checkpoints whose frames are one visual token, then </img>")
            self.ends.append(chunk.next_position)
            self.visual.append(visual)
            return chunk

        self.restore = lambda: setattr(adapter, "features_chunk", original)
        adapter.features_chunk = features_chunk

    def __call__(self, step: int, layer: int, queries, keys, values) -> None:
        frame = step - self.begun
        if frame not in self.objects:
            return
        start = self.stream.prefill.cache.starts[step]  # the chunk's first own position
        positions = self.stream.prefill.carried_positions(layer)[0]  # lined up with the keys (window, slots)
        row = self.rows.setdefault(frame, {"frame": frame, "carried": int(positions.shape[-1])})
        for name, offset in TOKENS.items():
            row[f"{layer}/{name}"] = shares(queries[0], keys[0], self.visual[frame] + offset, positions,
                                            self.prefix, start - self.recent)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_set_arguments(parser, method="full", methods=("full", "statekv"))  # recency's keys: ring-slot order
    parser.add_argument("--recent", type=int, default=64, help="positions before a frame counted as recent")
    parser.add_argument("--json", type=Path, required=True, help="JSON lines out, one per video, then the means")
    args = parser.parse_args(argv)

    import statekv

    manifest, frames, count, options = read_set(args)
    sums: dict[str, list] = {}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with args.json.open("w", encoding="utf-8") as out:
        for index in range(count):
            stream = open_model(statekv, args, options).stream()
            probe = Shares(stream, set(truth(manifest["seed"], index, frames)), args.recent)
            try:
                with stream.prefill.probing(probe):
                    push_video(stream, args.data, index)
            finally:
                probe.restore()
            if len(probe.ends) != frames:
                raise SystemExit(f"v{index:04d}: probed {len(probe.ends)} frame steps of {frames}")
            inside_until = sum(end <= stream.prefill.positions.limit for end in probe.ends)
            stream.close()
            for frame, row in sorted(probe.rows.items()):
                place = "inside" if frame < inside_until else "past"
                for key, split in row.items():
                    if "/" in key:
                        total = sums.setdefault(f"{place}/{key}", [0, {}])
                        total[0] += 1
                        for name, values in split.items():
                            total[1][name] = [a + b for a, b in zip(total[1].get(name, [0.0] * len(values)),
                                                                    values)]
            out.write(json.dumps({"video": f"v{index:04d}", "inside_until": inside_until,
                                  "frames": [probe.rows[frame] for frame in sorted(probe.rows)]}) + "\n")
            print(f"v{index:04d}: {len(probe.rows)} object frames", file=sys.stderr, flush=True)
        means = {key: {"frames": n, **{name: [round(v / n, 4) for v in values] for name, values in split.items()}}
                 for key, (n, split) in sorted(sums.items())}
        out.write(json.dumps({"means": means, "method": args.method, "layout": args.bounded_layout,
                              "model": args.model, "data": str(args.data), "recent": args.recent,
                              "range": args.range}) + "\n")
    for key, mean in means.items():
        print(f"{key:22s} n={mean['frames']:3d} " + "  ".join(
            f"{name} " + ",".join(f"{v:.2f}" for v in mean[name]) for name in (*PLACES, "entropy")))


if __name__ == "__main__":
    main()
