"""A short fine-tune of the built-in model for the regime it is used in past its range, to show the direction a
retrained checkpoint would take (not a checkpoint to ship: see docs/accuracy.md, "Past the range: causes").

The shipped recipe (`statekv.builtin.training.Recipe`) ends on 1,000 steps of 96-frame videos whose frames sit at
consecutive positions with anchors ``Frame1`` to ``Frame96``; the model then reads every question as if the video
spanned about 400 positions (`model_range.py`). Here each step instead draws one of two regimes for its batch:

* ``video`` (share ``--video-share``): the shipped recipe's own batch (96 frames, consecutive), so that what the
  model knows inside its range is kept;
* ``stream``: ``n`` frames (``--frames``, drawn per step) of a stream ``T`` frames long (log-uniform up to
  ``--stream-frames``), at sorted random times, each named by its time (``Frame{t+1}``, several tokens past 512),
  laid out either one after another (as the engine packs retrieved frames) or spread over ``S`` positions by their
  time (``S`` uniform from ``4 n`` to ``--span``); every object appearance is among the ``n`` frames, as it is
  among a question's retrieved frames when retrieval finds the evidence. The position family and the frames'
  quarter targets are the quarter of ``t / T``.

Every other target and weight is the shipped recipe's (`statekv.builtin.batches`). AdamW, cosine from
``--learning-rate``; seeded from the training seed range.

    nice -n 10 python benchmarks/retrain_prototype.py --out runs/retrain --steps 400
    python benchmarks/model_range.py --checkpoint runs/retrain/model --seed 4600 --videos 48 --frames 96,192,384
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F


def load(checkpoint: str):
    """The model (train mode, eager attention), its adapter, the frame bank and a batch maker."""
    from transformers import AutoTokenizer, InternVLForConditionalGeneration

    from statekv.builtin import builtin_checkpoint
    from statekv.builtin.architecture import IMAGE_SIZE, LAYOUT
    from statekv.builtin.batches import BatchMaker, FrameBank
    from statekv.models import InternVLAdapter
    from statekv.video import IMAGENET_MEAN, IMAGENET_STD

    path = builtin_checkpoint() if checkpoint == "builtin" else checkpoint
    model = InternVLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    adapter = InternVLAdapter(model, tokenizer, layout=LAYOUT, image_size=IMAGE_SIZE, image_mean=IMAGENET_MEAN,
                              image_std=IMAGENET_STD)
    model.train()
    model.set_attn_implementation("eager")
    return model, tokenizer, adapter, FrameBank(adapter), BatchMaker(adapter)


def stream_ids(adapter, anchors: list[int]) -> tuple[torch.Tensor, list[int]]:
    """``[1, Lv]`` the chat prefix, then one ``Frame{a+1}: <img>…</img>`` per anchor; and each frame's first
    token."""
    pieces = [adapter.prefix(adapter.start(len(anchors))).input_ids]
    pieces += [adapter.tokenize(f"{chr(10) if j else ''}Frame{a + 1}: {adapter.image_block}")
               for j, a in enumerate(anchors)]
    starts = torch.tensor([p.shape[1] for p in pieces]).cumsum(0)[:-1].tolist()
    return torch.cat(pieces, dim=1).cpu(), starts


def spread_positions(length_ids: int, frame_starts: list[int], times: list[int], length: int, span: int
                     ) -> torch.Tensor:
    """``[1, Lv]``: the prefix at its own positions, each frame's tokens from where its time scales to in ``span``
    positions after the prefix (never overlapping)."""
    prefix = frame_starts[0]
    positions = torch.arange(length_ids)
    placed = prefix
    for j, first in enumerate(frame_starts):
        end = frame_starts[j + 1] if j + 1 < len(frame_starts) else length_ids
        placed = max(prefix + int(times[j] * (span - (end - first)) / max(length, 1)), placed)
        positions[first:end] = placed + torch.arange(end - first)
        placed += end - first
    return positions[None]


@contextmanager
def retimed(times: list[int], length: int):
    """Quarters (the position family's answer and the frames' quarter targets) of each shown frame's time in a
    stream of ``length`` frames."""
    from statekv.builtin import batches
    from statekv.synthetic import plans, tasks

    def quarter(frame, _frames):
        return plans.quarter_of(times[frame], length)

    saved = tasks.quarter_of, batches.quarter_of
    tasks.quarter_of = batches.quarter_of = quarter
    try:
        yield
    finally:
        tasks.quarter_of, batches.quarter_of = saved


def stream_batch(maker, adapter, rng: np.random.Generator, videos: int, args):
    """A batch of the ``stream`` regime (module docstring)."""
    frames = int(rng.choice(args.frames))
    length = int(math.exp(rng.uniform(math.log(2 * frames), math.log(args.stream_frames))))
    times = sorted(int(t) for t in rng.choice(length, size=frames, replace=False))
    ids, frame_starts = stream_ids(adapter, times)
    slots = (ids[0] == adapter.image_token_id).nonzero().squeeze(1)
    maker.video_ids = lambda _n: ids
    maker.frame_positions = lambda _n: torch.stack([slots, slots + 1], dim=-1)
    try:
        with retimed(times, length):
            batch = maker.make(rng, videos, frames)
    finally:
        del maker.video_ids, maker.frame_positions
    if rng.random() < args.spread_share:
        span = int(rng.uniform(4 * frames, args.span))
        batch.video_positions = spread_positions(ids.shape[1], frame_starts, times, length, span)
    return batch, {"frames": frames, "length": length}


def step_loss(model, bank, maker, batch, weights) -> tuple[torch.Tensor, dict]:
    """The shipped recipe's loss (`statekv.builtin.training`) on ``batch``."""
    from statekv.builtin.batches import forward_targets, still_logits

    words = still_logits(model, bank).flatten(0, 1).float()
    still = F.cross_entropy(words, maker.still_words[:, 0]) + F.cross_entropy(words, maker.still_words[:, 1])
    logits, frame_logits, word_logits, evidence_mass, counting = forward_targets(model, bank, batch)
    answer = F.cross_entropy(logits[:, 0].float(), batch.targets[:, 0])
    end = F.cross_entropy(logits[:, 1].float(), batch.targets[:, 1])
    frame = F.cross_entropy(frame_logits.unsqueeze(3).expand(*batch.frame_targets.shape, -1).flatten(0, 3).float(),
                            batch.frame_targets.flatten())
    word = F.cross_entropy(word_logits.float(), batch.word_targets)
    evidence = -torch.log(evidence_mass.float() + 1e-6).mean()
    loss = (answer + weights.end_token_weight * end + weights.frame_loss_weight * frame
            + weights.word_loss_weight * word + weights.evidence_loss_weight * (evidence + counting)
            + weights.still_loss_weight * still)
    correct = (logits[:, 0].argmax(-1) == batch.targets[:, 0]).float().mean()
    return loss, {"loss": float(answer), "accuracy": float(correct)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--init", default="builtin", help="checkpoint to start from (default: the shipped one)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--videos", type=int, default=16, help="videos per batch")
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--video-share", type=float, default=0.3)
    parser.add_argument("--spread-share", type=float, default=0.5, help="stream batches laid out spread")
    parser.add_argument("--frames", default="16,24,48,96", help="frames shown in a stream batch")
    parser.add_argument("--stream-frames", type=int, default=24000)
    parser.add_argument("--span", type=int, default=4000, help="the widest spread, in positions")
    parser.add_argument("--seed", type=int, default=1_000_045)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    args.frames = [int(f) for f in args.frames.split(",")]
    from statekv.builtin.checkpoint import save_checkpoint
    from statekv.builtin.training import Recipe
    from statekv.synthetic.seeds import training_rng

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    model, tokenizer, adapter, bank, maker = load(args.init)
    weights = Recipe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=weights.weight_decay)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "log.jsonl").open("w", encoding="utf-8")
    started = time.monotonic()
    window: list[dict] = []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = args.learning_rate * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        rng = training_rng(args.seed, step)
        if rng.random() < args.video_share:
            batch, regime = maker.make(rng, args.videos, 96), {"frames": 96, "length": 96}
        else:
            batch, regime = stream_batch(maker, adapter, rng, args.videos, args)
        loss, parts = step_loss(model, bank, maker, batch, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), weights.clip_norm)
        optimizer.step()
        window.append({**parts, **regime, "spread": batch.video_positions is not None})
        if (step + 1) % 25 == 0:
            line = {"step": step + 1, "seconds": round(time.monotonic() - started, 1),
                    "loss": sum(w["loss"] for w in window) / len(window),
                    "accuracy": sum(w["accuracy"] for w in window) / len(window)}
            log.write(json.dumps(line) + "\n")
            log.flush()
            print(line, flush=True)
            window = []
    recipe = {"prototype": "benchmarks/retrain_prototype.py", **{k: (str(v) if isinstance(v, Path) else v)
                                                                 for k, v in vars(args).items()}}
    save_checkpoint(model.eval(), tokenizer, args.out / "model", recipe=recipe)
    print(f"wrote {args.out / 'model'} after {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
