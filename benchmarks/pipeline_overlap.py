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
    python benchmarks/pipeline_overlap.py --model internvl3-1b --device cuda --dtype bfloat16 --frames 300 \
        --width 448 --height 448 --vision-batch 16 --budget 4096 --out docs/benchmarks.md      # the GPU target
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import statekv
from statekv.settings.methods import method_names
from statekv.testing import make_tiny_checkpoint, write_test_video
from statekv.video import open_video

sys.path.insert(0, str(Path(__file__).parent))
from report import (OneLineParser, output_file, positive_count, positive_number, run_script,  # noqa: E402
                    write_section)

TARGET = 1.15  # overlapped / slowest stage

# A tiny random InternVL: 64 visual tokens per frame, a 4-layer language model.
TINY_INTERNVL = dict(vision_config={"image_size": 224},
                     text_config={"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                                  "num_attention_heads": 4, "num_key_value_heads": 2})
# InternVL3-1B's shapes (InternViT-300M, Qwen2.5-0.5B), random weights: the GPU target (>= 100 frames/s)
INTERNVL3_1B = dict(std=0.02,
                    vision_config={"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                                   "intermediate_size": 4096, "image_size": 448, "patch_size": 14},
                    text_config={"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                                 "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 4864,
                                 "max_position_embeddings": 32768})
MODELS = {"tiny": TINY_INTERNVL, "internvl3-1b": INTERNVL3_1B}
MODEL_NAMES = {"tiny": "tiny random InternVL (224 px, 64 visual tokens per frame, 4-layer language model)",
               "internvl3-1b": "random InternVL3-1B shapes (448 px, 256 visual tokens per frame, 24 + 24 layers)"}


def _timed(run: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process) of ``run()``."""
    started, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - started, time.process_time() - cpu


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
        steps, state, per_step = [], self.adapter.start(self.frames), self.adapter.frames_per_step
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
        per_call = max(1, self.vision_batch // self.adapter.frames_per_step)
        features = []
        with torch.no_grad():
            for start in range(0, len(self.steps), per_call):
                features += self.adapter.encode_vision(self.steps[start:start + per_call])
        return features

    def language(self):
        encoded = self._empty()
        with torch.no_grad():
            for step, features in zip(self.steps, self.features):
                encoded.stream_chunk(self.adapter.features_chunk(step, features, encoded.state))
        return encoded

    def overlapped(self):
        return self.qa.encode(self.path, max_fps=1e9, max_frames=self.frames, vision_batch=self.vision_batch)

    def serial(self):
        """The per-frame loop before issue 18: decode, vision and language model one frame at a time."""
        encoded = self._empty()
        group = []
        for frame in self.sampled():
            group.append(frame)
            if len(group) == self.adapter.frames_per_step:
                encoded.append(group)
                group = []
        if group:
            encoded.append(group)
        return encoded

    def _empty(self) -> statekv.EncodedVideo:
        video = open_video(self.path)
        horizon = self.qa.horizon_for(self.frames, (video.height, video.width))
        return statekv.EncodedVideo(self.qa, horizon, num_frames=self.frames, name=video.name).start()


def measure(stages: Stages, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall seconds of each run, and median CPU seconds over wall seconds (cores it kept busy)."""
    runs = {"decode": stages.decode, "vision": stages.vision, "language": stages.language,
            "overlapped": stages.overlapped, "serial": stages.serial}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    cores: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            wall, cpu = _timed(run)
            seconds[name].append(wall)
            cores[name].append(cpu / wall)
            print(f"  {name}: {wall:.2f} s, {cpu / wall:.2f} cores", file=sys.stderr, flush=True)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return median, {name: statistics.median(values) for name, values in cores.items()}


def render(args, times: dict[str, float], cores: dict[str, float], stats: statekv.EncodingStats,
           command: str) -> str:
    slowest_name = max(("decode", "vision", "language"), key=times.get)
    slowest = times[slowest_name]
    ratio = times["overlapped"] / slowest
    frames = args.frames
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), "
               f"torch {torch.__version__}")
    rows = [("decode + preprocess alone", "decode", times["decode"]), ("vision alone", "vision", times["vision"]),
            ("language model alone", "language", times["language"]),
            ("sum of the stages", None, times["decode"] + times["vision"] + times["language"]),
            ("serial per-frame loop (before)", "serial", times["serial"]),
            ("overlapped `VideoQA.encode`", "overlapped", times["overlapped"])]
    lines = [
        f"Command: `{command.strip()}`  ",
        f"Machine: {machine}; device {args.device}; load average {os.getloadavg()[0]:.1f} at the end (shared machine).  ",
        f"Model: {MODEL_NAMES[args.model]}, {args.dtype}, method {args.method}; video {frames} frames at "
        f"{args.width}x{args.height} "
        f"({args.codec}), vision batch {args.vision_batch}; median of {args.repeats} interleaved runs.",
        "",
        "| what | seconds | ms per frame | cores busy |",
        "|---|---:|---:|---:|",
        *[f"| {name} | {seconds:.2f} | {1e3 * seconds / frames:.1f} | {cores[key]:.2f} |" if key else
          f"| {name} | {seconds:.2f} | {1e3 * seconds / frames:.1f} | |" for name, key, seconds in rows],
        "",
        f"Overlapped / slowest stage ({slowest_name}): **{ratio:.2f}** (target <= {TARGET:.2f}); "
        f"serial / overlapped: {times['serial'] / times['overlapped']:.2f}x. Cores busy: the process's CPU seconds "
        "over wall seconds (the overlapped run can only beat the sum of the stages by keeping more than one "
        "busy).  ",
        "The overlapped run's own stage timings (`EncodingStats`, ms per frame): "
        + ", ".join(f"{name} {1e3 * value:.1f}" for name, value in stats.stage_seconds().items())
        + f"; {stats.frames_per_second:.1f} frames/s.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny",
                        help="tiny (random weights; CPU) or internvl3-1b (real shapes, random weights; GPU)")
    parser.add_argument("--frames", type=positive_count, default=64)
    parser.add_argument("--width", type=positive_count, default=640)
    parser.add_argument("--height", type=positive_count, default=360)
    parser.add_argument("--codec", default="libx264", help="codec of the synthetic video")
    parser.add_argument("--vision-batch", type=positive_count, default=4)
    parser.add_argument("--method", choices=method_names(), default="statekv")
    parser.add_argument("--budget", type=positive_count, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=positive_count, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--repeats", type=positive_count, default=3)
    parser.add_argument("--switch-interval", type=positive_number, default=None,
                        help="sys.setswitchinterval for the run, seconds (default: Python's, 0.005)")
    parser.add_argument("--out", type=output_file("--out"),
                        help="markdown file to write (replaces this benchmark's section)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        dtype = getattr(torch, args.dtype)
        checkpoint = make_tiny_checkpoint("internvl", root / "model", dtype=dtype, **MODELS[args.model])
        video = write_test_video(root / "video.mp4", frames=args.frames, fps=1.0, size=(args.width, args.height),
                                 codec=args.codec)
        qa = statekv.VideoQA.from_pretrained(checkpoint, method=args.method, budget=args.budget, dtype=args.dtype,
                                             device=args.device, vision_batch=args.vision_batch)
        stages = Stages(qa, video, args.frames, args.vision_batch)
        stages.overlapped()  # warm-up: first calls allocate and pick kernels
        times, cores = measure(stages, args.repeats)
        stats = stages.overlapped().stats

    command = "python benchmarks/pipeline_overlap.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = render(args, times, cores, stats, command)
    print(report)
    if args.out:
        device = "CPU" if args.device == "cpu" else "GPU"
        write_section(args.out, f"Overlapped encoding pipeline ({device}, {args.model})", report)


if __name__ == "__main__":
    run_script(main)
