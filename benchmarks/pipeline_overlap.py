"""Encoding a video with decoding, vision and the language model overlapped, against each stage alone.

One run, one machine: the same sampled frames are

* decoded and preprocessed alone (``adapter.prepare_frames`` over the sampled frames, one thread);
* vision-encoded alone (``adapter.encode_vision`` on batches of ``--vision-batch`` frames, from pixels made
  beforehand);
* streamed through the language model alone (``features_chunk`` + ``StreamingPrefill.step`` from features
  made beforehand);
* encoded by ``VideoQA.encode`` (the three stages overlapped on three threads), and by the serial per-frame
  loop the pipeline had before (decode, vision and language model one frame at a time on one thread).

Each is repeated ``--repeats`` times in interleaved order and the median kept. The target of issue 18:
overlapped <= slowest stage alone + 15%.

    python benchmarks/pipeline_overlap.py --out docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import statekv
from statekv.testing import make_tiny_checkpoint, write_test_video
from statekv.video import open_video

sys.path.insert(0, str(Path(__file__).parent))
from report import write_section  # noqa: E402

TARGET = 1.15  # overlapped / slowest stage

# The demo's tiny InternVL (statekv demo): 64 visual tokens per frame, a 4-layer language model.
TINY_INTERNVL = dict(vision_config={"image_size": 224},
                     text_config={"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                                  "num_attention_heads": 4, "num_key_value_heads": 2})


def _timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


class Stages:
    """Each stage of one video's encoding, runnable alone; inputs of the later stages made once up front."""

    def __init__(self, qa: statekv.VideoQA, video_path: Path, frames: int, vision_batch: int):
        self.qa, self.adapter, self.path = qa, qa.adapter, video_path
        self.frames, self.vision_batch = frames, vision_batch
        self.steps = self.decode()
        self.features = self.vision()

    def sampled(self):
        return open_video(self.path).sample(max_fps=1e9, max_frames=self.frames)

    def decode(self):
        steps, state, per_step = [], self.adapter.start(self.frames), self.adapter.frames_per_chunk
        group = []
        for frame in self.sampled():
            group.append(frame)
            if len(group) == per_step:
                steps.append(self.adapter.prepare_frames(group, state))
                state = state.updated(steps[-1].state_update)
                group = []
        if group:
            steps.append(self.adapter.prepare_frames(group, state))
        return steps

    def vision(self):
        per_call = max(1, self.vision_batch // self.adapter.frames_per_chunk)
        features = []
        with torch.no_grad():
            for start in range(0, len(self.steps), per_call):
                features += self.adapter.encode_vision(self.steps[start:start + per_call])
        return features

    def language(self):
        encoded = self._empty()
        with torch.no_grad():
            for step, features in zip(self.steps, self.features):
                encoded._stream_chunk(self.adapter.features_chunk(step, features, encoded.state))
        return encoded

    def overlapped(self):
        return self.qa.encode(self.path, max_fps=1e9, max_frames=self.frames, vision_batch=self.vision_batch)

    def serial(self):
        """The per-frame loop before issue 18: decode, vision and language model one frame at a time."""
        encoded = self._empty()
        group = []
        for frame in self.sampled():
            group.append(frame)
            if len(group) == self.adapter.frames_per_chunk:
                encoded._append(group)
                group = []
        if group:
            encoded._append(group)
        return encoded

    def _empty(self) -> statekv.EncodedVideo:
        video = open_video(self.path)
        horizon = self.qa.horizon_for(self.frames, (video.height, video.width))
        return statekv.EncodedVideo(self.qa, horizon, num_frames=self.frames, name=video.name)


def measure(stages: Stages, repeats: int) -> dict[str, float]:
    runs = {"decode": stages.decode, "vision": stages.vision, "language": stages.language,
            "overlapped": stages.overlapped, "serial": stages.serial}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            seconds[name].append(_timed(run))
            print(f"  {name}: {seconds[name][-1]:.2f} s", file=sys.stderr, flush=True)
    return {name: statistics.median(values) for name, values in seconds.items()}


def render(args, times: dict[str, float], stats: statekv.EncodingStats, command: str) -> str:
    slowest_name = max(("decode", "vision", "language"), key=times.get)
    slowest = times[slowest_name]
    ratio = times["overlapped"] / slowest
    frames = args.frames
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), "
               f"torch {torch.__version__}")
    rows = [("decode + preprocess alone", times["decode"]), ("vision alone", times["vision"]),
            ("language model alone", times["language"]),
            ("sum of the stages", times["decode"] + times["vision"] + times["language"]),
            ("serial per-frame loop (before)", times["serial"]), ("overlapped `VideoQA.encode`", times["overlapped"])]
    lines = [
        f"Command: `{command.strip()}`  ",
        f"Machine: {machine}; device {args.device}; load average {os.getloadavg()[0]:.1f} at the end (shared machine).  ",
        f"Model: tiny random InternVL (the demo's: 224 px, 64 visual tokens per frame, 4-layer language model, "
        f"{args.dtype}), method {args.method}; video {frames} frames at {args.width}x{args.height} "
        f"({args.codec}), vision batch {args.vision_batch}; median of {args.repeats} interleaved runs.",
        "",
        "| what | seconds | ms per frame |",
        "|---|---:|---:|",
        *[f"| {name} | {seconds:.2f} | {1e3 * seconds / frames:.1f} |" for name, seconds in rows],
        "",
        f"Overlapped / slowest stage ({slowest_name}): **{ratio:.2f}** (target <= {TARGET:.2f}); "
        f"serial / overlapped: {times['serial'] / times['overlapped']:.2f}x.  ",
        "The overlapped run's own stage timings (`EncodingStats`, ms per frame): "
        + ", ".join(f"{name} {1e3 * value:.1f}" for name, value in stats.stage_seconds().items())
        + f"; {stats.frames_per_second:.1f} frames/s.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--height", type=int, default=360)
    parser.add_argument("--codec", default="libx264", help="codec of the synthetic video")
    parser.add_argument("--vision-batch", type=int, default=4)
    parser.add_argument("--method", choices=statekv.pipeline.METHODS, default="statekv")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for the run, seconds (default: Python's, 0.005)")
    parser.add_argument("--out", type=Path, help="markdown file to write (replaces this benchmark's section)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        checkpoint = make_tiny_checkpoint("internvl", root / "tiny", **TINY_INTERNVL)
        video = write_test_video(root / "video.mp4", frames=args.frames, fps=1.0, size=(args.width, args.height),
                                 codec=args.codec)
        qa = statekv.VideoQA.from_pretrained(checkpoint, method=args.method, budget=args.budget, dtype=args.dtype,
                                             device=args.device, vision_batch=args.vision_batch)
        stages = Stages(qa, video, args.frames, args.vision_batch)
        stages.overlapped()  # warm-up: first calls allocate and pick kernels
        times = measure(stages, args.repeats)
        stats = stages.overlapped().stats

    command = "python benchmarks/pipeline_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = render(args, times, stats, command)
    print(report)
    if args.out:
        write_section(args.out, "Overlapped encoding pipeline (CPU)", report)


if __name__ == "__main__":
    main()
