"""What the built-in model itself knows outside its training videos: accuracy against video length, frame anchors
and RoPE positions, from its own one-shot forward (full attention, every token at its own position: exactly what
``statekv`` streams under ``positions="stream"``), on held-out synthetic videos drawn as ``statekv synthetic make``
draws them (video ``i`` of seed ``S`` is the same video, with the same questions).

The built-in model was trained on videos of at most 96 frames (about 400 tokens: its curriculum's last stage), in
InternVL's ``chat`` layout, where each frame is ``Frame{i}: <img>…</img>`` and ``Frame{i}:`` is one token for
``i <= 512`` (`statekv.builtin.architecture.MAX_ANCHOR`), several after. Three knobs separate what a long video
changes:

* ``--frames``: the video's length (more clutter between the ten object appearances, larger distances);
* ``--anchors``: ``true`` (``Frame{i+1}``, as streamed), ``wrap`` (``Frame{(i mod 96)+1}``: only anchors the model
  was trained on), ``shift:O`` (``Frame{i+1+O}``: a 96-frame video with the anchors of frames ``O`` on);
* ``--offsets``: the RoPE position of the prompt's first token (every position shifted by it);
* ``--gaps``: empty positions left before each frame (distances grow, the content does not).

Each line of ``--json`` is one configuration: accuracy per family and overall with 95% Wilson intervals.

    python benchmarks/model_range.py --seed 4600 --videos 24 --frames 96,192,384,768 --anchors true,wrap \\
        --json runs/model_range/length.json
    python benchmarks/model_range.py --seed 4600 --videos 24 --frames 96 --offsets 0,512,1024,2048,3500 \\
        --anchors true,shift:400,shift:2300 --json runs/model_range/offsets.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy import wilson  # noqa: E402

TRAINED_FRAMES = 96  # the built-in recipe's longest videos (its curriculum's last stage)


def anchor_rule(name: str):
    """Frame index -> the 0-based index its ``Frame{…}`` anchor names."""
    if name == "true":
        return lambda index: index
    if name == "wrap":
        return lambda index: index % TRAINED_FRAMES
    if name.startswith("shift:"):
        offset = int(name.split(":", 1)[1])
        return lambda index: index + offset
    raise SystemExit(f"unknown anchor rule {name!r}: true, wrap or shift:O")


class Probe:
    """The built-in model, its adapter and the preprocessed stills (every picture a video can show)."""

    def __init__(self, checkpoint: str = "builtin"):
        import statekv
        from statekv.builtin.batches import FrameBank

        # a folder `statekv train-builtin` wrote loads with the built-in model's layout (`is_builtin_kind`)
        self.qa = statekv.VideoQA.from_pretrained(checkpoint, method="full", device="cpu")
        self.adapter = self.qa.adapter
        self.model = self.adapter.model
        self.bank = FrameBank(self.adapter)
        self.letters = self.adapter.tokenizer.convert_tokens_to_ids(list("ABCD"))

    def video_ids(self, frames: int, anchor) -> torch.Tensor:
        """``[1, L]`` the prompt up to the end of the video, each frame's anchor named by ``anchor``."""
        adapter = self.adapter
        pieces = [adapter.prefix(adapter.start(frames)).input_ids]
        block = adapter.image_block
        pieces += [adapter.tokenize(f"{chr(10) if i else ''}Frame{anchor(i) + 1}: {block}") for i in range(frames)]
        return torch.cat(pieces, dim=1).cpu()

    @torch.no_grad()
    def answers(self, plan, specs, anchor, offset: int, gap: int = 0) -> list[bool]:
        """Whether the model's first answer token is each question's letter."""
        from statekv.builtin.batches import FrameBank  # noqa: F401  (the bank is built in __init__)
        from statekv.models.base import LayoutState
        from statekv.synthetic.prompts import question_prompt
        from statekv.synthetic.scenes import still_id

        inner, config = self.model.model, self.model.config
        ids = self.video_ids(plan.num_frames, anchor)
        features = inner.get_image_features(
            pixel_values=self.bank[torch.tensor([still_id(s) for s in plan.stills])],
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy).pooler_output
        embeds = inner.get_input_embeddings()(ids)
        slots = (ids == config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(slots, features.reshape(-1, embeds.shape[-1]).to(embeds.dtype))
        length = ids.shape[1]
        anchors = torch.tensor([self.adapter.tokenize(f"{chr(10) if i else ''}Frame{anchor(i) + 1}: ").shape[1]
                                for i in range(plan.num_frames)])
        frame_of = torch.zeros(length, dtype=torch.long)  # frames started at or before each token
        starts = (ids[0] == config.image_token_id).nonzero().squeeze(1) - 1 - anchors  # each frame's first token
        frame_of.index_add_(0, starts, torch.ones_like(starts))
        placed = torch.arange(length) + gap * frame_of.cumsum(0) + offset
        video = inner.language_model(inputs_embeds=embeds, position_ids=placed[None], use_cache=True)
        rows = [self.adapter.question_ids(question_prompt(s.question, s.options), LayoutState())[0] for s in specs]
        width = max(r.shape[0] for r in rows)
        pad = self.adapter.tokenizer.pad_token_id
        batch = torch.full((len(rows), width), pad, dtype=torch.long)
        for i, row in enumerate(rows):
            batch[i, : row.shape[0]] = row
        cache = video.past_key_values
        cache.batch_repeat_interleave(len(rows))
        positions = torch.arange(width)[None].expand(len(rows), -1) + int(placed[-1]) + 1 + gap
        hidden = inner.language_model(input_ids=batch, past_key_values=cache, position_ids=positions,
                                      use_cache=False).last_hidden_state
        last = torch.tensor([r.shape[0] - 1 for r in rows])
        logits = self.model.lm_head(hidden[torch.arange(len(rows)), last])
        return [int(logits[i].argmax()) == self.letters[s.answer] for i, s in enumerate(specs)]


def run(probe: Probe, seed: int, videos: int, frames: int, anchors: str, offset: int, gap: int = 0) -> dict:
    from statekv.synthetic.plans import plan_video
    from statekv.synthetic.seeds import video_rng
    from statekv.synthetic.tasks import ask_all

    per_family: dict[str, list[int]] = {}
    for index in range(videos):
        rng = video_rng(seed, index)
        plan = plan_video(rng, frames)
        specs = ask_all(plan, rng)
        for spec, ok in zip(specs, probe.answers(plan, specs, anchor_rule(anchors), offset, gap)):
            per_family.setdefault(spec.family, []).append(int(ok))
    return summarise(per_family) | {"seed": seed, "videos": videos, "frames": frames, "anchors": anchors,
                                    "offset": offset, "gap": gap}


def summarise(per_family: dict[str, list[int]]) -> dict:
    """``{"families": {family: [correct, total, %, low, high]}, "overall": [...]}``."""
    def entry(values):
        low, high = wilson(sum(values), len(values))
        return [sum(values), len(values), 100 * sum(values) / len(values), low, high]

    everything = [v for values in per_family.values() for v in values]
    return {"families": {f: entry(v) for f, v in sorted(per_family.items())}, "overall": entry(everything)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True, help="held-out evaluation seed (0 to 999999)")
    parser.add_argument("--videos", type=int, default=24)
    parser.add_argument("--frames", default="96", help="comma-separated video lengths")
    parser.add_argument("--anchors", default="true", help="comma-separated anchor rules: true, wrap, shift:O")
    parser.add_argument("--offsets", default="0", help="comma-separated RoPE offsets of the prompt's first token")
    parser.add_argument("--gaps", default="0", help="comma-separated empty positions before each frame")
    parser.add_argument("--checkpoint", default="builtin", help="a checkpoint folder (default: the built-in model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, required=True, help="JSON lines, one per configuration (appended)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    probe = Probe(args.checkpoint)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for frames in (int(f) for f in args.frames.split(",")):
        for anchors in args.anchors.split(","):
            for offset, gap in ((int(o), int(g)) for o in args.offsets.split(",") for g in args.gaps.split(",")):
                started = time.monotonic()
                result = run(probe, args.seed, args.videos, frames, anchors, offset, gap)
                result["checkpoint"] = args.checkpoint
                with args.json.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(result) + "\n")
                fam = " ".join(f"{f} {v[2]:.0f}" for f, v in result["families"].items())
                print(f"frames {frames} anchors {anchors} offset {offset} gap {gap}: {result['overall'][2]:.1f} "
                      f"[{result['overall'][3]:.0f}, {result['overall'][4]:.0f}] ({fam}) "
                      f"{time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
