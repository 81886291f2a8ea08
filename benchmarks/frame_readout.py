"""What each frame's encoding says, read back along a stream: the built-in model's frame targets, per method.

The built-in model is trained to write, after its second decoder layer, what each frame shows and where it lies
(`statekv.builtin.batches`, the frame targets): at a frame's visual token its colour and how many times its object
has been shown so far, at its ``</img>`` its shape and the quarter of the video. Questions read these back from the
detailed cache, so a frame encoded wrongly misleads every answer that retrieves it. This probe streams synthetic
videos (`statekv synthetic make`) through `VideoQA.stream()` as a camera would, reads those words from each object
frame's hidden states while its step runs (the final norm and the output embedding over the layer's output,
restricted to the words each target can be), and compares them with the video's plan, split at the frame where
the stream leaves the model's range.

    python benchmarks/frame_readout.py --data data/dev2400 --method full --json runs/readout/full.jsonl
    python benchmarks/frame_readout.py --data data/dev2400 --method statekv --bounded-layout cache \\
        --json runs/readout/statekv.jsonl

One JSON line per video; the last is the totals (correct / object frames, inside the range and past it: a frame
is past it when its step ends past the positions the model declares). A stream that hands over (the default
``handover`` layout past the range) is refused: its steps are encoded again by its successor, which this probe
does not read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from pathlib import Path

import torch

from statekv.synthetic.plans import COUNTS
from statekv.synthetic.scenes import COLOURS, SHAPES
from statekv.synthetic.tasks import QUARTERS

# the words each frame target can be, as `statekv.builtin.batches.frame_words` writes them
WORDS = {"colour": tuple(f" {colour}" for colour in COLOURS),
         "count": tuple(f" {times}" for times in range(1, max(COUNTS) + 1)),
         "shape": tuple(f" {shape}" for shape in SHAPES), "quarter": tuple(f" {q.split()[0]}" for q in QUARTERS)}


class Readout:
    """Hooks on a stream's model: each frame step's chunk ids (`features_chunk`) and the hidden states after
    `FRAME_TARGET_LAYER`, read as the frame targets' words."""

    def __init__(self, qa):
        from statekv.builtin.batches import FRAME_TARGET_LAYER
        from statekv.core.attention.switch import language_decoder

        adapter = qa.adapter
        self.adapter, self.chunks, self.frames, self.ends = adapter, deque(), [], []
        decoder = language_decoder(adapter.model)
        self.norm, self.head = decoder.norm, adapter.model.lm_head
        self.ids = {target: torch.tensor([self.word(word) for word in words]) for target, words in WORDS.items()}
        original = adapter.features_chunk

        def features_chunk(*args, **kwargs):
            chunk = original(*args, **kwargs)
            self.chunks.append((chunk.input_ids[0].cpu(), chunk.next_position))
            return chunk

        adapter.features_chunk = features_chunk
        decoder.layers[FRAME_TARGET_LAYER].register_forward_hook(self.read)

    def word(self, text: str) -> int:
        ids = self.adapter.tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) != 1:
            raise SystemExit(f"{text!r} is not one token of this model's vocabulary")
        return ids[0]

    def read(self, module, inputs, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if not self.chunks or hidden.shape[1] != self.chunks[0][0].shape[0]:
            return  # the prompt's prefix
        ids, end = self.chunks.popleft()
        self.ends.append(end)  # the first position after the step's tokens at their own positions
        visual = int((ids == self.adapter.image_token_id).nonzero()[0, 0])
        with torch.no_grad():
            logits = self.head(self.norm(hidden[0, [visual, visual + 1]])).float()
        self.frames.append({target: int(self.ids[target][logits[0 if target in ("colour", "count") else 1,
                                                                 self.ids[target]].argmax()])
                            for target in WORDS})


def truth(seed: int, index: int, frames: int) -> dict[int, dict[str, str]]:
    """The frame targets' words of every object frame of video ``index`` of the set made with ``seed``."""
    from statekv.builtin.batches import frame_words
    from statekv.synthetic.plans import plan_video
    from statekv.synthetic.seeds import video_rng

    plan = plan_video(video_rng(seed, index), frames)
    words = frame_words(plan)
    shown = {frame for appearances in plan.appearances for frame in appearances}
    return {frame: {"colour": words[frame][0][0], "count": words[frame][0][1], "shape": words[frame][1][0],
                    "quarter": words[frame][1][1]} for frame in sorted(shown)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_set_arguments(parser, method="statekv")
    parser.add_argument("--json", type=Path, required=True, help="JSON lines out, one per video, then the totals")
    args = parser.parse_args(argv)

    import statekv

    manifest, frames, count, options = read_set(args)
    totals = {place: {target: [0, 0] for target in WORDS} for place in ("inside", "past")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with args.json.open("w", encoding="utf-8") as out:
        for index in range(count):
            qa = open_model(statekv, args, options)
            readout = Readout(qa)
            stream = qa.stream()
            push_video(stream, args.data, index)
            expected = truth(manifest["seed"], index, frames)
            if len(readout.frames) != frames:
                raise SystemExit(f"v{index:04d}: read {len(readout.frames)} frame steps of {frames}")
            limit = stream.prefill.positions.limit
            inside_until = sum(end <= limit for end in readout.ends)  # steps in time order
            rows = []
            for frame, words in expected.items():
                read = {target: readout.adapter.tokenizer.decode([readout.frames[frame][target]])
                        for target in WORDS}
                place = "inside" if frame < inside_until else "past"
                for target in WORDS:
                    totals[place][target][0] += int(read[target] == words[target])
                    totals[place][target][1] += 1
                rows.append({"frame": frame, "truth": words, "read": read})
            stream.close()
            out.write(json.dumps({"video": f"v{index:04d}", "inside_until": inside_until,
                                  "frames": rows}) + "\n")
            print(f"v{index:04d}: " + ", ".join(
                f"{place} {target} {right}/{asked}" for place, targets in totals.items()
                for target, (right, asked) in targets.items()), file=sys.stderr, flush=True)
        out.write(json.dumps({"totals": totals, "method": args.method, "layout": args.bounded_layout,
                              "model": args.model, "data": str(args.data)}) + "\n")
    for place, targets in totals.items():
        print(place, {target: f"{right}/{asked}" for target, (right, asked) in targets.items()})


def add_set_arguments(parser: argparse.ArgumentParser, method: str,
                      methods: tuple[str, ...] = ("statekv", "full", "recency")) -> None:
    """The options of a probe streaming a synthetic set: the set, how many videos, the method, the model and the
    range it declares."""
    parser.add_argument("--data", type=Path, required=True, help="a set `statekv synthetic make` wrote")
    parser.add_argument("--videos", type=int, default=None, help="the first N videos (default: all)")
    parser.add_argument("--method", default=method, choices=methods)
    parser.add_argument("--bounded-layout", default=None, help="the layout of bounded positions (default: the "
                        "library's, which hands a stream over past the range: refused; use cache there)")
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--range", type=int, default=None,
                        help="declare this positional range instead of the checkpoint's max_position_embeddings")


def open_model(statekv, args: argparse.Namespace, options: dict):
    """A fresh `VideoQA` of ``args.model`` on the CPU, declaring ``args.range`` where given (what bounded positions
    keep inside)."""
    qa = statekv.VideoQA.from_pretrained(args.model, device="cpu", **options)
    if args.range is not None:
        qa.adapter.model.config.get_text_config().max_position_embeddings = args.range
    return qa


def read_set(args: argparse.Namespace) -> tuple[dict, int, int, dict]:
    """The set's manifest, its frames per video, the videos to stream, and `VideoQA`'s options (bounded)."""
    manifest = json.loads((args.data / "benchmark.json").read_text())
    count = manifest["videos"] if args.videos is None else args.videos
    options = {"method": args.method, "positions": "bounded"}
    if args.bounded_layout is not None:
        options["bounded_layout"] = args.bounded_layout
    return manifest, manifest["num_frames"], count, options


def push_video(stream, data: Path, index: int) -> None:
    """Push every frame of video ``index`` of the set in ``data`` into ``stream`` as a camera would, then flush."""
    from statekv.video import open_video

    for frame in open_video(str(data / "videos" / f"v{index:04d}.mp4")).sample(max_fps=1.0, max_frames=10 ** 7):
        stream.push(frame)
        refuse_handed_over(stream, index)
    stream.flush()
    refuse_handed_over(stream, index)


def refuse_handed_over(stream, index: int) -> None:
    if stream.handover == "handed over":
        raise SystemExit(f"v{index:04d}: the stream was handed over to a successor, which encoded its steps again; "
                         "this probe reads the first encoding only: use --bounded-layout cache")


if __name__ == "__main__":
    main()
