"""Every GPU figure of statekv in one command, for the day a GPU is lent: run it first, on a bare CUDA machine.

    python benchmarks/gpu_suite.py --out runs/gpu            # on the CUDA machine (a report in at most 8 minutes)
    python benchmarks/gpu_suite.py --smoke --out runs/smoke  # the same code on CPU, tiny shapes (the test suite)
    make gpu-wheels                                          # here, with network: what the CUDA machine lacks

With random weights of the real shapes (a forward's cost does not depend on the weights), in this order:

1. ``environment``: device, versions, and what is missing, in one line (the suite stops only without torch).
2. ``cuda tests``: the tests marked ``cuda`` (static step and its graph replay, batched graph steps, the Triton
   kernels against a float64 reference, quantized, offloaded and disk-tier caches on CUDA) in a child pytest.
3. ``8B step``: one frame of InternVL3-8B's decoder (259 tokens) under StateKV B=4096 (eager scores, Triton
   scores, Triton + CUDA graph), recency R=16 and Hugging Face's own one-frame forward over as many cached
   tokens: ms per frame and, from the profiler, kernel launches, copies and host syncs per step.
   ``8B positions``: its graphed StateKV steps with bounded positions past the range against stream positions.
4. ``512-frame prefill``: one-shot SDPA forward of the whole video against StateKV streamed (best variant),
   and Hugging Face's one-frame forward over the 512 frames (what full attention pays per frame there).
5. ``1B pipeline``: `VideoQA.encode` of a 448x448 video on a real-size random InternVL3-1B, frames/s; one ask.
6. ``batched streams``: 1, 4 and 16 streams of that model pushed together (`VideoQA.push_many`), with what
   decoding, the vision tower and the language model took per round.
   ``batched steps``: the engine alone, 1 to 32 streams of the 1B decoder stepped together (`StepBatcher`), with
   launches and host-dispatched ops per step.
7. ``cache tiers``: the same stream with its detailed cache in GPU memory, int4, on disk, and on disk int4:
   ms per frame, GPU and host memory.
8. ``8B TTFT`` and ``1B TTFT``: time to the first answer token at 16, 64, 256 and 4,096 frames seen, and
   ``live streams``: the most live 1-fps cameras of a random InternVL3-8B held with p95 TTFT <= 0.5 s, found by
   ``statekv bench serve --find-max`` (`gpu_serving`: what they measure and on what frames).

The sections live in ``gpu_setup`` (environment, wheels, CUDA tests), ``gpu_decoder`` (8B step, prefill),
``gpu_vlm`` (the 1B pipeline, batched streams and steps, cache tiers) and ``gpu_serving`` (TTFT, live streams);
``gpu_measure`` times and profiles, ``gpu_shapes`` holds the sizes, ``gpu_report`` writes the report.

Each section has a time cap and the whole run a budget (``--budget-s``); a section that fails or does not fit is
reported with the reason, and the report (``gpu_suite.md``, ``gpu_suite.json`` under ``--out``) is rewritten
after every section, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_serving  # noqa: E402
from gpu_decoder import LanguageModel, lm_step, positions, prefill  # noqa: E402
from gpu_measure import kernel_kind, profile_counts, release_memory, timed  # noqa: E402,F401 (kernel_kind: the tests')
from gpu_report import GOALS, markdown  # noqa: E402,F401 (GOALS: the tests')
from gpu_setup import cuda_tests, environment, prepare_wheels  # noqa: E402
from gpu_shapes import REAL, SMOKE, Section  # noqa: E402
from gpu_vlm import batched_steps, batched_streams, cache_tiers, make_vlm, pipeline  # noqa: E402

DOCS_SECTION = "GPU suite"


class Run:
    """The sections run so far and the time left; writes the report after each section."""

    def __init__(self, out: Path, budget_s: float, smoke: bool, docs: Path | None = None):
        self.out, self.budget_s, self.smoke, self.docs = out, budget_s, smoke, docs
        self.started = time.monotonic()
        self.sections: list[Section] = []
        self.environment: dict[str, Any] = {}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def section(self, name: str, body: Callable[[Section, float], None], *, cap_s: float, needs_s: float) -> Section:
        """Run ``body(section, deadline)`` if ``needs_s`` seconds are left; catch and report what it raises."""
        section = Section(name)
        self.sections.append(section)
        if self.left() < needs_s:
            section.status, section.reason = "skipped", (f"{self.left():.0f} s left of the budget, it needs about "
                                                         f"{needs_s:.0f} s")
        else:
            deadline = time.monotonic() + min(cap_s, self.left())
            started = time.monotonic()
            print(f"== {name} (up to {min(cap_s, self.left()):.0f} s)", flush=True)
            try:
                body(section, deadline)
                section.status = section.status if section.status != "not run" else "ok"
            except Exception as error:  # one section's failure is a finding, not the end of the run
                section.status = "failed"
                section.reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:400]
                traceback.print_exc()
            section.seconds = time.monotonic() - started
            release_memory()
        print(f"-- {name}: {section.status} {section.reason} {json.dumps(section.figures, default=str)}", flush=True)
        self.write()
        return section

    def write(self, final: bool = False) -> None:
        """The report in ``out`` (after each section); the docs' section only at the end of a whole run, so a run
        stopped midway (Ctrl-C, a crash) leaves the results recorded there as they were."""
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"environment": self.environment, "smoke": self.smoke, "budget_s": self.budget_s,
                  "elapsed_s": round(time.monotonic() - self.started, 1),
                  "sections": [section.__dict__ for section in self.sections]}
        (self.out / "gpu_suite.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        (self.out / "gpu_suite.md").write_text(markdown(record))
        if final and self.docs is not None:
            sys.path.insert(0, str(Path(__file__).parent))
            from report import write_section

            write_section(self.docs, DOCS_SECTION, markdown(record, embedded=True))


# ----------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    from report import OneLineParser, output_dir, output_file, positive_number

    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_dir("--out"), default="runs/gpu_suite",
                        help="folder for gpu_suite.md and gpu_suite.json")
    parser.add_argument("--smoke", action="store_true", help="run on CPU with tiny shapes (what the tests do)")
    parser.add_argument("--budget-s", type=positive_number, default=None,
                        help="seconds for the whole run (default 480; smoke 300)")
    parser.add_argument("--skip", nargs="*", default=[], help="sections not to run",
                        choices=("tests", "step", "positions", "prefill", "pipeline", "streams", "steps", "tiers",
                                 "ttft", "live"))
    parser.add_argument("--live-s", type=positive_number, default=50.0,
                        help="seconds for the live-streams search (its cap)")
    parser.add_argument("--docs", type=output_file("--docs"), default=None,
                        help=f"markdown file whose '{DOCS_SECTION}' section is replaced by the report "
                             "(docs/benchmarks.md), once the whole run is done")
    parser.add_argument("--prepare-wheels", metavar="FOLDER", help="download the wheels a CUDA machine without "
                                                                    "network lacks into FOLDER, then stop")
    args = parser.parse_args(argv)
    if args.prepare_wheels:
        prepare_wheels(Path(args.prepare_wheels))
        return 0
    run = Run(Path(args.out), args.budget_s or (300.0 if args.smoke else 480.0), args.smoke,
              Path(args.docs) if args.docs else None)
    facts, missing = environment(args.smoke, serving="live" not in args.skip)
    run.environment = dict(facts, missing=missing)
    print("environment: " + json.dumps(facts), flush=True)
    if missing:
        print("missing: " + "; ".join(missing), flush=True)
    run.write()
    if any(item.startswith(("torch", "a CUDA device", "statekv does not import")) for item in missing):
        return 2
    import torch

    torch.manual_seed(0)
    shapes = SMOKE if args.smoke else REAL
    if args.smoke and "OMP_NUM_THREADS" not in os.environ:  # the test suite's workers run a thread each
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    if "tests" not in args.skip:
        run.section("cuda tests", lambda s, d: cuda_tests(s, d, args.smoke), cap_s=60 if args.smoke else 120,
                    needs_s=20)
    with tempfile.TemporaryDirectory(prefix="statekv-gpu-suite-") as scratch:
        folder = Path(scratch)
        if {"step", "positions", "prefill", "ttft"} - set(args.skip):
            lm = LanguageModel(shapes, shapes.prefill_frames + 1)
            if "step" not in args.skip:
                run.section("8B step", lambda s, d: lm_step(s, d, lm), cap_s=200, needs_s=30)
            if "positions" not in args.skip:
                run.section("8B positions", lambda s, d: positions(s, d, lm), cap_s=90, needs_s=30)
            if "prefill" not in args.skip:
                run.section("512-frame prefill", lambda s, d: prefill(s, d, lm), cap_s=120, needs_s=30)
            if "ttft" not in args.skip:
                run.section("8B TTFT", lambda s, d: gpu_serving.ttft(s, d, lm.model, shapes, "8B", profile_counts),
                            cap_s=25, needs_s=10)
            del lm
            release_memory()
        if "ttft" not in args.skip:
            def ttft_1b(section: Section, deadline: float) -> None:
                horizon = shapes.ttft_frames[-1] * shapes.ttft_frame_tokens + 4096
                gpu_serving.ttft(section, deadline, gpu_serving.decoder(gpu_serving.ttft_lm(shapes), horizon,
                                                                        shapes.device), shapes, "1B",
                                profile_counts)

            run.section("1B TTFT", ttft_1b, cap_s=15, needs_s=8)
            release_memory()
        if {"pipeline", "streams", "steps", "tiers", "live"} - set(args.skip):
            built, checkpoint = timed("cpu", lambda: make_vlm(folder, shapes))
            print(f"1B checkpoint built in {built:.0f} s", flush=True)
            if "pipeline" not in args.skip:
                run.section("1B pipeline", lambda s, d: pipeline(s, d, shapes, checkpoint, folder), cap_s=150,
                            needs_s=20)
            if "streams" not in args.skip:
                run.section("batched streams", lambda s, d: batched_streams(s, d, shapes, checkpoint), cap_s=60,
                            needs_s=15)
            if "steps" not in args.skip:
                run.section("batched steps", lambda s, d: batched_steps(s, d, shapes), cap_s=60, needs_s=15)
            if "tiers" not in args.skip:
                run.section("cache tiers", lambda s, d: cache_tiers(s, d, shapes, checkpoint, folder), cap_s=60,
                            needs_s=15)
            if "live" not in args.skip:
                run.section("live streams", lambda s, d: gpu_serving.live_streams(s, d, shapes, checkpoint, folder),
                            cap_s=args.live_s, needs_s=25)
    run.write(final=True)
    print((run.out / "gpu_suite.md").read_text())
    return 1 if any(section.status == "failed" for section in run.sections) else 0


if __name__ == "__main__":
    from report import run_script

    run_script(main)
