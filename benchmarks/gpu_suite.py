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

Each section has a time cap and the whole run a budget (``--budget-s``); a section that fails or does not fit is
reported with the reason, and the report (``gpu_suite.md``, ``gpu_suite.json`` under ``--out``) is rewritten
after every section, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_serving  # noqa: E402

DOCS_SECTION = "GPU suite"
PINNED = ("transformers", "av")  # what a CUDA machine's image may lack or hold at another version
SERVING = ("fastapi", "uvicorn", "starlette", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
           "python-multipart", "typing-extensions", "opentelemetry-api")  # `statekv serve` for the live-streams section, which images lack
CUDA_TEST_FILES = ("tests/test_cuda.py", "tests/test_static_step.py", "tests/test_kernel_triton.py",
                   "tests/test_cache_state.py")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
COPIES = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TOP_KERNELS = 8  # kernels named per profiled variant, in the JSON only
GOALS = {  # figure -> (goal, better when "lower"/"higher", what was measured before the static step)
    "statekv_graph_ms": (16.0, "lower", "59 ms (H100, eager Triton step)"),
    "statekv_graph_launches": (1, "lower", "~1,306 launches (H100)"),
    "prefill_ratio": (0.6, "lower", "2.95x one-shot (H100)"),
    "pipeline_fps": (100.0, "higher", "12.7 frames/s (H100)"),
}

VARIANT_OF = {"statekv_graph_ms": "statekv_graph_variant", "prefill_ratio": "prefill_variant",
              "pipeline_fps": "pipeline_variant"}  # a goal's figure -> the best variant's name, which it is


@dataclass(frozen=True)
class Shapes:
    """The sizes one run uses: the real ones, or tiny ones for ``--smoke``."""

    lm: dict  # Qwen2Config fields of the large decoder
    frame_tokens: int
    budget: int
    window_frames: int
    step_warmup: int
    step_timed: int
    prefill_frames: int
    vlm_text: dict | None  # the 1B InternVL's text and vision configs (None: make_tiny_checkpoint's)
    vlm_vision: dict | None
    image_size: int
    pipeline_frames: int
    stream_counts: tuple[int, ...]
    stream_frames: int
    tier_frames: int
    vlm_budget: int
    device: str
    ttft_frames: tuple[int, ...]  # frames seen when TTFT is measured
    ttft_frame_tokens: int  # tokens of a frame in the TTFT streams
    ttft_group_after: int  # frames streamed one per step; then ttft_group per step
    ttft_group: int
    ttft_prompt_tokens: int
    ttft_budget: int
    live_start: int  # the cameras the live-stream search starts at
    live_duration: float  # seconds of each run of that search
    live_warm_frames: int  # frames each camera streams before a run's clock starts (its carried state full)
    live_max: int  # the most cameras that search tries


REAL = Shapes(
    lm=dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
            intermediate_size=18944, vocab_size=151674, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    frame_tokens=259, budget=4096, window_frames=16, step_warmup=24, step_timed=16, prefill_frames=512,
    vlm_text=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                  intermediate_size=4864, max_position_embeddings=32768),
    vlm_vision=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                    image_size=448, patch_size=14),
    image_size=448, pipeline_frames=300, stream_counts=(1, 4, 16), stream_frames=8, tier_frames=48,
    vlm_budget=4096, device="cuda", ttft_frames=(16, 64, 256, 4096), ttft_frame_tokens=16, ttft_group_after=256,
    ttft_group=16, ttft_prompt_tokens=16, ttft_budget=1024, live_start=8, live_duration=6.0,
    live_warm_frames=16, live_max=256)
SMOKE = Shapes(
    lm=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=128, tie_word_embeddings=False),
    frame_tokens=12, budget=48, window_frames=4, step_warmup=6, step_timed=3, prefill_frames=16,
    vlm_text=None, vlm_vision=None, image_size=64, pipeline_frames=8, stream_counts=(1, 4, 16), stream_frames=2,
    tier_frames=6, vlm_budget=64, device="cpu", ttft_frames=(2, 4, 8, 32), ttft_frame_tokens=4, ttft_group_after=8,
    ttft_group=4, ttft_prompt_tokens=4, ttft_budget=16, live_start=1, live_duration=2.0,
    live_warm_frames=2, live_max=4)


# ----------------------------------------------------------------------------------------------------------------
# The run: sections, their deadlines, the report

@dataclass
class Section:
    name: str
    status: str = "not run"  # ok, failed, skipped, not run
    reason: str = ""
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)


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

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"environment": self.environment, "smoke": self.smoke, "budget_s": self.budget_s,
                  "elapsed_s": round(time.monotonic() - self.started, 1),
                  "sections": [section.__dict__ for section in self.sections]}
        (self.out / "gpu_suite.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        (self.out / "gpu_suite.md").write_text(markdown(record))
        if self.docs is not None:
            sys.path.insert(0, str(Path(__file__).parent))
            from report import write_section

            write_section(self.docs, DOCS_SECTION, markdown(record, embedded=True))


def release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, run: Callable[[], Any]) -> tuple[float, Any]:
    synchronize(device)
    started = time.perf_counter()
    result = run()
    synchronize(device)
    return time.perf_counter() - started, result


def peak_gib(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def resident_gib() -> float | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return None


# ----------------------------------------------------------------------------------------------------------------
# 1. environment

def environment(smoke: bool) -> tuple[dict[str, Any], list[str]]:
    """What this machine has, and what the suite needs but is missing (empty when it can run)."""
    facts: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                             "cpu_cores": os.cpu_count(), "commit": commit()}
    missing = []
    try:
        import torch
    except ImportError:
        return facts, ["torch (install the CUDA build of the machine's image)"]
    facts["torch"] = torch.__version__
    facts["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        facts["device"] = torch.cuda.get_device_name(0)
        facts["device_memory_gib"] = round(properties.total_memory / 2**30, 1)
        facts["multiprocessors"] = properties.multi_processor_count
    elif not smoke:
        missing.append("a CUDA device (torch.cuda.is_available() is False; --smoke runs on CPU)")
    else:
        facts["device"] = "cpu (smoke)"
    wanted = pinned_versions()
    for name in ("transformers", "av", "triton", "accelerate", "safetensors", "tokenizers", "numpy", "pytest"):
        try:
            facts[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            facts[name] = None
        if name in PINNED and facts[name] != wanted.get(name):
            missing.append(f"{name}=={wanted.get(name)} (found {facts[name]}; `make gpu-wheels` here, then install "
                           f".whl/*.whl there)")
        elif facts[name] is None and name in ("triton", "pytest") and not smoke:
            missing.append(name)
    for name in ("fastapi", "uvicorn"):
        try:
            facts[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            facts[name] = None
            missing.append(f"{name} (the live-streams section's server; `make gpu-wheels` here, then install "
                           ".whl/*.whl there)")
    try:
        import statekv

        facts["statekv"] = statekv.__version__
    except Exception as error:  # the project itself must import: nothing else can run without it
        missing.append(f"statekv does not import ({type(error).__name__}: {error})"[:300])
    return facts, missing


def pinned_versions() -> dict[str, str]:
    pins = {}
    lock = ROOT / "constraints.txt"
    if lock.exists():
        for line in lock.read_text().splitlines():
            name, _, version = line.partition("==")
            name = re.sub(r"[-_.]+", "-", name.strip().lower())
            if version and name in PINNED + SERVING:
                pins[name] = version.strip()
    return pins


def commit() -> str | None:
    """The checkout's commit (``STATEKV_COMMIT`` where the copy on the CUDA machine has no git history)."""
    if os.environ.get("STATEKV_COMMIT"):
        return os.environ["STATEKV_COMMIT"]
    head = ROOT / ".git" / "HEAD"
    try:
        result = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10)
        if result.returncode == 0:
            return result.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return head.read_text().strip()[:12] if head.exists() else None


def prepare_wheels(folder: Path) -> None:
    """Download, here, the wheels a CUDA machine without network lacks (the pinned transformers and PyAV, and the
    service's FastAPI and uvicorn with what they need, for CPython 3.12 on x86-64 Linux) into ``folder``."""
    pins = pinned_versions()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
               "manylinux_2_17_x86_64", "-d", str(folder)] + [f"{name}=={pins[name]}" for name in PINNED + SERVING]
    subprocess.run(command, check=True)


# ----------------------------------------------------------------------------------------------------------------
# 2. the CUDA tests

def cuda_tests(section: Section, deadline: float, smoke: bool) -> None:
    """The tests marked ``cuda`` in a child pytest (on CPU, ``--smoke`` only collects them)."""
    command = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "-rfEs",
               *CUDA_TEST_FILES]
    if smoke:
        command.append("--collect-only")
    # one tile per kernel pass, in a tile cache of their own: checks need no tuning, and the measurements
    # below must not inherit untuned tiles
    scratch = tempfile.mkdtemp(prefix="statekv-cuda-tests-")
    environment = {**os.environ, "STATEKV_TILE_CANDIDATES": "1", "STATEKV_CACHE": scratch}
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=environment,
                                timeout=max(10.0, deadline - time.monotonic()))
        output = result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        section.status, section.reason = "failed", "cut at the section's time cap"
    print(output[-6000:], flush=True)
    summary = pytest_summary(output)
    section.figures.update(summary)
    section.rows = [{"test": line} for line in output.splitlines()
                    if line.startswith(("FAILED", "ERROR", "SKIPPED"))][:40]
    if smoke:
        if summary.get("collected", 0) == 0:
            section.status, section.reason = "failed", "no test is marked cuda"
    elif summary.get("failed", 0) or summary.get("errors", 0):
        section.status = "failed"
        section.reason = f"{summary.get('failed', 0)} failed, {summary.get('errors', 0)} errors"
    elif summary.get("passed", 0) == 0 and section.status != "failed":
        section.status, section.reason = "failed", "no CUDA test ran"


def pytest_summary(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line (``3 passed, 1 skipped in 2.0s``; with ``--collect-only``,
    ``24/68 tests collected (44 deselected)``)."""
    counts: dict[str, int] = {}
    for line in output.splitlines()[::-1]:
        collected = re.search(r"(\d+)(?:/\d+)? tests? collected", line)
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b", line)
        if collected or found:
            for number, kind in found:
                counts["errors" if kind.startswith("error") else kind] = int(number)
            if collected:
                counts["collected"] = int(collected.group(1))
            break
    return counts


# ----------------------------------------------------------------------------------------------------------------
# 3 and 4: the 8B decoder's step and the 512-frame prefill

class LanguageModel:
    """A random decoder of the large shape and its frames' embeddings ``[1, T, D]``."""

    def __init__(self, shapes: Shapes, frames: int):
        import torch
        from transformers import AutoModelForCausalLM, Qwen2Config

        self.shapes, self.device = shapes, shapes.device
        self.dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        config = Qwen2Config(**shapes.lm, max_position_embeddings=(frames + 8) * shapes.frame_tokens)
        with torch.device(self.device):
            self.model = AutoModelForCausalLM.from_config(config, dtype=self.dtype, attn_implementation="sdpa").eval()
        generator = torch.Generator(device=self.device).manual_seed(0)
        self.frames = [0.02 * torch.randn(1, shapes.frame_tokens, config.hidden_size, device=self.device,
                                          dtype=self.dtype, generator=generator) for _ in range(frames)]
        self.config = config


def step_variants(shapes: Shapes) -> list[tuple[str, Callable[[], Any], dict[str, Any]]]:
    """(label, policy factory, engine settings) of the measured streamed steps. A label without ``graph`` steps
    eagerly (``cuda_graph`` off, so its launches are the eager step's); ``compiled``: the decoder of steady steps
    compiled by torch.compile (`statekv.core.step.compiled`)."""
    import statekv

    budget, window = shapes.budget, shapes.window_frames
    eager, graph, compiled = dict(cuda_graph=False), dict(cuda_graph=True), dict(cuda_graph=True, compile_step=True)
    return [
        (f"StateKV B={budget} eager", lambda: statekv.StateKV(budget=budget), dict(attention="eager", **eager)),
        (f"StateKV B={budget} triton", lambda: statekv.StateKV(budget=budget), dict(attention="triton", **eager)),
        (f"StateKV B={budget} triton + graph", lambda: statekv.StateKV(budget=budget), dict(attention="triton",
                                                                                          **graph)),
        (f"StateKV B={budget} triton + graph + compiled", lambda: statekv.StateKV(budget=budget),
         dict(attention="triton", **compiled)),
        (f"recency R={window}", lambda: statekv.Recency(frames=window), eager),
        (f"recency R={window} + graph", lambda: statekv.Recency(frames=window), graph),
        (f"recency R={window} + graph + compiled", lambda: statekv.Recency(frames=window), compiled),
    ]


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (what a timed part must not add to)."""
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


# What a kernel does, from its name (first match wins): the GPU time of a step is summed per kind.
KERNEL_KINDS = (
    ("scoring_ms", ("flash_forward_kernel", "key_mass_kernel")),  # statekv.kernels: attention with key mass
    ("attention_ms", ("flash", "fmha", "attention", "attn")),
    ("matmul_ms", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("fused_ms", ("triton_",)),  # Inductor's kernels (whatever they fused: an index among them)
    ("selection_ms", ("sort", "topk", "radix", "gather", "scatter", "index", "scan", "bucketize", "searchsorted")),
    ("copy_ms", ("memcpy", "memset", "copy")),
)


def kernel_kind(name: str) -> str:
    """The `KERNEL_KINDS` column of a kernel's GPU time (``other_ms``: elementwise and reductions)."""
    lowered = name.lower()
    for kind, parts in KERNEL_KINDS:
        if any(part in lowered for part in parts):
            return kind
    return "other_ms"


def profile_counts(device: str, run: Callable[[], Any], steps: int) -> dict[str, Any]:
    """Per step, from torch.profiler: kernel launches, graph launches, copies and host syncs issued, the GPU's
    busy time (the sum of its kernels' time), that time by `kernel_kind`, and the kernels that took the most
    (``top_kernels``: name and ms per step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not device.startswith("cuda"):
        return {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    counts = {"launches": 0, "graph_launches": 0, "copies": 0, "syncs": 0}
    busy_us = 0.0
    kinds = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other_ms"], 0.0)
    kernels: dict[str, float] = {}
    for event in prof.events():
        name = event.name
        if name in LAUNCHES:
            counts["launches"] += 1
        elif name == "cudaGraphLaunch":
            counts["graph_launches"] += 1
        elif name in COPIES:
            counts["copies"] += 1
        elif name in SYNCS:
            counts["syncs"] += 1
        if event.device_type == torch.autograd.DeviceType.CUDA:
            busy_us += event.device_time
            kinds[kernel_kind(name)] += event.device_time / 1e3 / steps
            kernels[name] = kernels.get(name, 0.0) + event.device_time / 1e3 / steps
    result: dict[str, Any] = {key: value / steps for key, value in counts.items()}
    result["gpu_busy_ms"] = busy_us / 1e3 / steps
    result.update(kinds)
    top = sorted(kernels.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    result["top_kernels"] = [[name[:90], round(ms, 3)] for name, ms in top]
    # where the host's time goes (a step bound by launches and syncs, not kernels): op, calls and ms per step
    host = sorted(prof.key_averages(), key=lambda item: -item.self_cpu_time_total)[:TOP_KERNELS]
    result["top_host_ops"] = [[item.key[:90], item.count / steps, round(item.self_cpu_time_total / 1e3 / steps, 3)]
                              for item in host]
    return result


def traced_ops(run: Callable[[], Any], steps: int) -> dict[str, Any]:
    """ATen ops and host syncs per step, as dispatched (`statekv.testing.op_trace`): a graph replay dispatches
    only the copies of its inputs. SDPA's causal-bias tensor subclass cannot be traced: then it says so."""
    from statekv.testing.op_trace import OpTrace

    try:
        with OpTrace() as trace:
            run()
    except RuntimeError as error:
        if "Tensor subclass" not in str(error):
            raise
        run()  # the steps the trace was to see, untraced, so every variant takes as many
        return {"aten_ops": "not traced (a tensor subclass)"}
    return {"aten_ops": len(trace.compute) / steps, "host_syncs": len(trace.syncs) / steps}


def hf_cache(lm: LanguageModel, cached_frames: int):
    """Hugging Face's own cache of the first ``cached_frames`` frames (a ``DynamicCache``)."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.config)
    with torch.no_grad():
        for start in range(0, cached_frames, 64):
            lm.model.model(inputs_embeds=torch.cat(lm.frames[start:min(start + 64, cached_frames)], 1),
                           past_key_values=cache, use_cache=True)
    return cache


def hf_one_frame(lm: LanguageModel, cache, repeats: int) -> float:
    """Hugging Face's own forward of one more frame over ``cache`` (SDPA), seconds per frame; the cache is
    cropped back after each."""
    import torch

    frame, tokens = lm.frames[-1], lm.shapes.frame_tokens

    def one():
        lm.model.model(inputs_embeds=frame, past_key_values=cache, use_cache=True)
        cache.crop(-tokens)

    with torch.no_grad():
        one()
        seconds, _ = timed(lm.device, lambda: [one() for _ in range(repeats)])
    return seconds / repeats


def lm_step(section: Section, deadline: float, lm: LanguageModel) -> None:
    import statekv
    import torch

    shapes, device = lm.shapes, lm.device
    warm, count = shapes.step_warmup, shapes.step_timed
    with torch.no_grad():
        for label, policy, settings in step_variants(shapes):
            row: dict[str, Any] = {"variant": label}
            section.rows.append(row)
            if time.monotonic() > deadline:
                row["error"] = "not run: the section's time cap was reached"
                continue
            if settings.get("attention") == "triton" and not device.startswith("cuda"):
                settings = dict(settings, attention="chunked")
                row["note"] = "CPU run: chunked scoring in place of the Triton kernels"
            try:
                reset_peak(device)
                with statekv.StreamingPrefill(lm.model, policy(), horizon=(warm + 3 * count + 2) * shapes.frame_tokens,
                                              **settings) as prefill:
                    frames = iter(lm.frames)
                    warmed, _ = timed(device, lambda: [prefill.step(inputs_embeds=next(frames)) for _ in range(warm)])
                    row["warmup_s"] = warmed  # a compiled step compiles in its first steady step
                    graphs = compiled_graphs()
                    seconds, _ = timed(device, lambda: [prefill.step(inputs_embeds=next(frames))
                                                        for _ in range(count)])
                    row["ms_per_frame"] = 1e3 * seconds / count
                    row["compiled_while_timed"] = compiled_graphs() - graphs  # 0: nothing compiled in the timing
                    row.update(profile_counts(device, lambda: [prefill.step(inputs_embeds=next(frames))
                                                               for _ in range(2)], 2))
                    row.update(traced_ops(lambda: [prefill.step(inputs_embeds=next(frames)) for _ in range(2)], 2))
                    stats = prefill.stats
                    row["graph_replays"] = stats.graph_replays
                    row["carried_tokens"] = stats.max_carried_tokens
                    row["peak_gib"] = peak_gib(device)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
            print(f"   {row}", flush=True)
        if time.monotonic() < deadline:
            context = -(-shapes.budget // shapes.frame_tokens)
            row = {"variant": f"Hugging Face one frame over {context} cached frames"}
            cache = hf_cache(lm, context)
            row["ms_per_frame"] = 1e3 * hf_one_frame(lm, cache, max(2, count // 2))
            row.update(profile_counts(device, lambda: hf_one_frame(lm, cache, 1), 2))
            del cache
            section.rows.append(row)
    graphed = [row for row in section.rows if "graph" in row["variant"] and "StateKV" in row["variant"]
               and "ms_per_frame" in row]
    if graphed:
        best = min(graphed, key=lambda row: row["ms_per_frame"])
        section.figures["statekv_graph_ms"] = best["ms_per_frame"]
        section.figures["statekv_graph_variant"] = best["variant"]
        if "launches" in best:
            section.figures["statekv_graph_launches"] = best["launches"] + best["graph_launches"]
    eager = [row for row in section.rows if row["variant"].endswith("eager") and "launches" in row]
    if eager:
        section.figures["statekv_eager_launches"] = eager[0]["launches"]


def prefill(section: Section, deadline: float, lm: LanguageModel) -> None:
    import statekv
    import torch

    shapes, device = lm.shapes, lm.device
    count = shapes.prefill_frames
    frames = lm.frames[:count]
    backend = "triton" if device.startswith("cuda") else "eager"
    with torch.no_grad():
        reset_peak(device)
        whole = torch.cat(frames, 1)
        seconds, output = timed(device, lambda: lm.model(inputs_embeds=whole, logits_to_keep=1, use_cache=True))
        one_shot = {"variant": f"one-shot Hugging Face SDPA forward, {count} frames", "seconds": seconds,
                    "frames": count, "peak_gib": peak_gib(device)}
        section.rows.append(one_shot)
        del whole
        print(f"   {one_shot}", flush=True)
        full_frame = hf_one_frame(lm, output.past_key_values, 2)
        section.rows.append({"variant": f"Hugging Face one frame over {count} cached frames (full attention's "
                                        "cost there)", "ms_per_frame": 1e3 * full_frame})
        del output
        release_memory()
        for label, policy, compile_step in [
                (f"StateKV B={shapes.budget} {backend} + graph", statekv.StateKV(budget=shapes.budget), False),
                (f"StateKV B={shapes.budget} {backend} + graph + compiled", statekv.StateKV(budget=shapes.budget),
                 True),
                (f"recency R={shapes.window_frames} + graph", statekv.Recency(frames=shapes.window_frames), False)]:
            if time.monotonic() > deadline:
                section.rows.append({"variant": label, "error": "not run: the section's time cap was reached"})
                continue
            reset_peak(device)
            blocks = []  # (frames, seconds) per block of 32 frames, synchronized at its end only
            # compiled: the step section compiled this shape (the cache's state is no guard), else in the loop
            graphs = compiled_graphs()
            with statekv.StreamingPrefill(lm.model, policy, attention=backend, cuda_graph=True,
                                          compile_step=compile_step, horizon=count * shapes.frame_tokens) as streamed:
                synchronize(device)
                started = block_started = time.perf_counter()
                for index, frame in enumerate(frames, start=1):
                    streamed.step(inputs_embeds=frame)
                    if index % 32 == 0 or index == count or time.monotonic() > deadline:
                        synchronize(device)
                        now = time.perf_counter()
                        blocks.append((index - sum(n for n, _ in blocks), now - block_started))
                        block_started = now
                        if time.monotonic() > deadline:
                            break
                total = time.perf_counter() - started
            done = sum(n for n, _ in blocks)
            tail = 1e3 * blocks[-1][1] / blocks[-1][0]
            row = {"variant": label, "seconds": total, "frames": done, "peak_gib": peak_gib(device),
                   "ms_per_frame_last_block": tail, "compiled_while_timed": compiled_graphs() - graphs}
            if done < count:  # the rest at the last block's pace, said so
                row["seconds_for_all_estimated"] = total + (count - done) * tail / 1e3
            section.rows.append(row)
            print(f"   {row}", flush=True)
    streamed_rows = [row for row in section.rows if row["variant"].startswith("StateKV") and "seconds" in row]
    if streamed_rows:
        best = min(streamed_rows, key=lambda row: row.get("seconds_for_all_estimated", row["seconds"]))
        section.figures["prefill_ratio"] = best.get("seconds_for_all_estimated", best["seconds"]) / one_shot["seconds"]
        section.figures["prefill_ratio_estimated"] = "seconds_for_all_estimated" in best
        section.figures["prefill_variant"] = best["variant"]


# ----------------------------------------------------------------------------------------------------------------
# 5, 6 and 7: the whole pipeline of a 1B VLM, batched streams, cache tiers

def make_vlm(folder: Path, shapes: Shapes) -> Path:
    import torch
    from statekv import testing

    overrides = {}
    if shapes.vlm_text is not None:
        overrides = dict(dtype=torch.bfloat16, std=0.02, text_config=shapes.vlm_text, vision_config=shapes.vlm_vision)
    return testing.make_tiny_checkpoint("internvl", folder / "vlm", **overrides)


def vlm_options(shapes: Shapes, **more) -> dict:
    dtype = "bfloat16" if shapes.device.startswith("cuda") else "float32"
    return {**dict(method="statekv", budget=shapes.vlm_budget, dtype=dtype, device=shapes.device), **more}


def pipeline(section: Section, deadline: float, shapes: Shapes, checkpoint: Path, folder: Path) -> None:
    import statekv
    from statekv import testing

    count = shapes.pipeline_frames
    video = testing.write_test_video(folder / "video.mp4", frames=count, fps=1.0,
                                     size=(shapes.image_size, shapes.image_size))
    for variant, more in (("graph", {}), ("graph + compiled", {"compile_step": True})):
        if time.monotonic() > deadline:
            section.rows.append({"variant": variant, "error": "not run: the section's time cap was reached"})
            continue
        qa = statekv.VideoQA.from_pretrained(str(checkpoint), **vlm_options(shapes, **more))
        warmed, _ = timed(shapes.device, lambda: qa.encode(video, max_fps=1, max_frames=min(count, 24)))  # kernels
        reset_peak(shapes.device)  # tuned and compiled, graphs recorded: once per process, not per video
        graphs = compiled_graphs()
        seconds, encoded = timed(shapes.device, lambda: qa.encode(video, max_fps=1, max_frames=count))
        graphs = compiled_graphs() - graphs
        stats = encoded.stats
        encoded.ask("Warm up?", max_new_tokens=2)
        ask_seconds, _ = timed(shapes.device, lambda: encoded.ask("What colour is the square?", max_new_tokens=16))
        head, tail = stats.frame_seconds[1:33], stats.frame_seconds[-64:]
        section.rows.append({
            "variant": variant, "warmup_s": warmed, "compiled_while_timed": graphs, "frames": stats.frames,
            "tokens": stats.tokens,
            "seconds": seconds, "frames_per_s": stats.frames / seconds,
            "frames_per_s_last_64": len(tail) / sum(tail), "ms_per_frame_steady": 1e3 * statistics.median(tail),
            # where a video's start-up goes: before its first frame is streamed, its first frame, frames 2-33
            "seconds_outside_frames": seconds - sum(stats.frame_seconds),
            "first_frame_ms": 1e3 * stats.frame_seconds[0],
            "ms_per_frame_2_to_33": 1e3 * statistics.mean(head) if head else None,
            "language_ms_2_to_33": 1e3 * statistics.mean(stats.language_seconds[1:33]) if head else None,
            "vision_ms_per_frame": 1e3 * statistics.mean(stats.vision_seconds),
            "language_ms_per_frame": 1e3 * statistics.mean(stats.language_seconds),
            "decode_ms_per_frame": 1e3 * statistics.mean(stats.decode_seconds),
            "peak_gib": peak_gib(shapes.device), "ask_s": ask_seconds,
            "frame_ms_1_to_40": [round(1e3 * value, 2) for value in stats.frame_seconds[:40]],
            "language_ms_1_to_40": [round(1e3 * value, 2) for value in stats.language_seconds[:40]]})
        print(f"   {section.rows[-1]}", flush=True)
        del qa, encoded
        release_memory()
    measured = [row for row in section.rows if "frames_per_s" in row]
    if measured:
        best = max(measured, key=lambda row: row["frames_per_s"])
        section.figures["pipeline_fps"] = best["frames_per_s"]
        section.figures["pipeline_variant"] = best["variant"]
    if time.monotonic() < deadline:
        section.rows.append(fresh_stream(shapes, checkpoint))
        print(f"   {section.rows[-1]}", flush=True)


def allocations(device: str) -> int | None:
    """Device allocations the caching allocator has made so far (cudaMalloc calls), on CUDA."""
    import torch

    return torch.cuda.memory_stats().get("num_device_alloc") if device.startswith("cuda") else None


def fresh_stream(shapes: Shapes, checkpoint: Path, frames: int = 24) -> dict[str, Any]:
    """A fresh stream's start-up, one push at a time, once the pipeline's runs have warmed the process up (kernels
    tuned and compiled): the stream's creation (its prompt prefix streamed), then each of its first ``frames``
    frames, in milliseconds and in device allocations, to tell a first frame's costs from the filling state's."""
    import statekv

    frames = min(frames, shapes.pipeline_frames)
    qa = statekv.VideoQA.from_pretrained(str(checkpoint), **vlm_options(shapes, compile_step=True))
    images = frames_of(shapes, frames, seed=1)
    before = allocations(shapes.device)
    created, stream = timed(shapes.device, lambda: qa.stream(horizon_frames=shapes.pipeline_frames))
    push_ms, allocs = [], []
    for image in images:
        counted = allocations(shapes.device)
        seconds, _ = timed(shapes.device, lambda: stream.push(image))
        push_ms.append(round(1e3 * seconds, 2))
        allocs.append(None if counted is None else allocations(shapes.device) - counted)
    stream.close()
    del stream, qa
    release_memory()
    total = None if before is None else allocations(shapes.device) - before
    return {"variant": f"a fresh stream, pushed frame by frame (graph + compiled, {frames} frames)",
            "create_ms": 1e3 * created, "first_frame_ms": push_ms[0], "mean_push_ms_after_first": statistics.mean(
                push_ms[1:]), "device_allocs": total, "push_ms": push_ms, "device_allocs_per_push": allocs}


def frames_of(shapes: Shapes, count: int, seed: int):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, (count, shapes.image_size, shapes.image_size, 3),
                                                dtype=np.uint8)


def batched_streams(section: Section, deadline: float, shapes: Shapes, checkpoint: Path) -> None:
    import statekv

    qa = statekv.VideoQA.from_pretrained(str(checkpoint), **vlm_options(shapes, budget=1024 if shapes.device
                                                                                 .startswith("cuda") else 32))
    warm = 8 if shapes.device.startswith("cuda") else 3
    video = frames_of(shapes, warm + shapes.stream_frames, 1)
    baseline = None
    for count in shapes.stream_counts:
        if time.monotonic() > deadline:
            section.rows.append({"streams": count, "error": "not run: the section's time cap was reached"})
            continue
        streams = [qa.stream(horizon_frames=len(video) + 1, name=f"s{index}") for index in range(count)]
        for tick in range(warm):
            qa.push_many([(stream, video[tick], float(tick)) for stream in streams])
        rounds = video[warm:]
        seconds, _ = timed(shapes.device, lambda: [qa.push_many([(stream, image, float(warm + tick))
                                                                 for stream in streams])
                                                   for tick, image in enumerate(rounds)])
        fps = count * len(rounds) / seconds
        baseline = baseline or fps
        row = {"streams": count, "frames_per_s": fps, "ms_per_round": 1e3 * seconds / len(rounds),
               "speedup_over_one": fps / baseline, "peak_gib": peak_gib(shapes.device)}
        # per round: decoding and the vision call are each stream's share (summed), a batched language step is
        # the whole step's time in every stream's record (its mean over streams)
        for stage, whole in (("decode", sum), ("vision", sum), ("language", statistics.fmean)):
            per_stream = [sum(getattr(stream.stats, f"{stage}_seconds")[-len(rounds):]) for stream in streams]
            row[f"{stage}_ms_per_round"] = 1e3 * whole(per_stream) / len(rounds)
        section.rows.append(row)
        print(f"   {section.rows[-1]}", flush=True)
        for stream in streams:
            stream.close()
    rows = [row for row in section.rows if "frames_per_s" in row]
    if rows:
        section.figures["streams_speedup"] = {row["streams"]: round(row["speedup_over_one"], 2) for row in rows}


def batched_steps(section: Section, deadline: float, shapes: Shapes) -> None:
    """The engine alone: S streams of the 1B decoder stepped together (`StepBatcher`, StateKV, one frame of
    random embeddings per stream and step, steady, replayed as graphs on CUDA): ms per batched step, frames/s
    against one stream, and per step the launches, GPU busy time and the ATen ops the host dispatched."""
    import statekv
    import torch
    from statekv.core.step.batching import StepBatcher, StepRequest
    from transformers import AutoModelForCausalLM, Qwen2Config

    device = shapes.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    fields = {key: (shapes.vlm_text or shapes.lm)[key] for key in ("hidden_size", "num_hidden_layers",
                                                                    "num_attention_heads", "num_key_value_heads",
                                                                    "head_dim", "intermediate_size")}
    tokens, budget = shapes.frame_tokens if shapes.vlm_text is None else 256, shapes.vlm_budget // 4
    warm, timed_steps = -(-budget // tokens) + 4, 8 if device.startswith("cuda") else 2
    config = Qwen2Config(**fields, vocab_size=1024, max_position_embeddings=(warm + 3 * timed_steps + 4) * tokens)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    generator = torch.Generator(device=device).manual_seed(0)
    frame = 0.02 * torch.randn(1, tokens, config.hidden_size, device=device, dtype=dtype, generator=generator)
    backend = "triton" if device.startswith("cuda") else "chunked"
    baselines: dict[str, float] = {}
    counts = (1, 2, 4, 8, 16, 32) if device.startswith("cuda") else (1, 4, 16)
    # compiled (the decoder's small kernels fused; `statekv.core.step.compiled`): one stream and 16, on CUDA only
    # (Inductor's CPU compile would take a smoke run's time)
    runs = [("graph", count) for count in counts] + (
        [("graph + compiled", count) for count in (1, 16)] if device.startswith("cuda") else [])
    with torch.no_grad():
        for variant, count in runs:
            if time.monotonic() > deadline:
                section.rows.append({"variant": variant, "streams": count,
                                     "error": "not run: the section's time cap was reached"})
                continue
            prefills = [statekv.StreamingPrefill(model, statekv.StateKV(budget=budget), attention=backend,
                                                 cuda_graph=True, horizon=(warm + 3 * timed_steps + 2) * tokens,
                                                 compile_step=variant.endswith("compiled"))
                        for _ in range(count)]
            batcher = StepBatcher()

            def steps(n: int) -> None:
                for _ in range(n):
                    for outcome in batcher.step([StepRequest(prefill, frame) for prefill in prefills]):
                        if isinstance(outcome, Exception):
                            raise outcome

            steps(warm)
            seconds, _ = timed(device, lambda: steps(timed_steps))
            fps = count * timed_steps / seconds
            baseline = baselines.setdefault(variant, fps)
            row = {"variant": variant, "streams": count, "ms_per_step": 1e3 * seconds / timed_steps,
                   "frames_per_s": fps, "speedup_over_one": fps / baseline, "batched_rows": batcher.batched_rows}
            row.update({key: value for key, value in profile_counts(device, lambda: steps(2), 2).items()
                        if key != "top_kernels"})
            row.update(traced_ops(lambda: steps(1), 1))
            row["peak_gib"] = peak_gib(device)
            section.rows.append(row)
            print(f"   {row}", flush=True)
            for prefill in prefills:
                prefill.close()
            del prefills, batcher
            release_memory()
    for variant, name in (("graph", "steps_speedup"), ("graph + compiled", "compiled_steps_speedup")):
        rows = [row for row in section.rows if "frames_per_s" in row and row["variant"] == variant]
        if rows:
            section.figures[name] = {row["streams"]: round(row["speedup_over_one"], 2) for row in rows}


def cache_tiers(section: Section, deadline: float, shapes: Shapes, checkpoint: Path, folder: Path) -> None:
    import statekv

    video = frames_of(shapes, shapes.tier_frames, 2)
    half = len(video) // 2
    memory = "model dtype, on the GPU" if shapes.device.startswith("cuda") else "model dtype"
    places = [({}, [(memory, None), ("int4", "int4")]),
              ({"offload": "disk", "offload_dir": str(folder / "tiers")}, [("disk", None), ("disk int4", "int4")])]
    for options, tiers in places:
        qa = statekv.VideoQA.from_pretrained(str(checkpoint), **vlm_options(shapes, **options))
        for label, kv_cache_dtype in tiers:
            if time.monotonic() > deadline:
                section.rows.append({"tier": label, "error": "not run: the section's time cap was reached"})
                continue
            reset_peak(shapes.device)
            stream = qa.stream(horizon_frames=len(video), kv_cache_dtype=kv_cache_dtype, name=label.replace(" ", "-"))
            for image in video[:half]:
                stream.push(image)
            seconds, _ = timed(shapes.device, lambda: [stream.push(image) for image in video[half:]])
            ask_seconds, _ = timed(shapes.device, lambda: stream.ask("What happened?", max_new_tokens=4))
            stats = stream.stats
            section.rows.append({"tier": label, "ms_per_frame": 1e3 * seconds / (len(video) - half),
                                 "cache_mib": stats.cache_bytes / 2**20, "peak_gib": peak_gib(shapes.device),
                                 "peak_cache_device_mib": stats.peak_cache_device_bytes / 2**20,
                                 "resident_gib": resident_gib(), "ask_s": ask_seconds})
            print(f"   {section.rows[-1]}", flush=True)
            stream.close()
            del stream
        del qa
        release_memory()


# ----------------------------------------------------------------------------------------------------------------
# The report

def markdown(record: dict, embedded: bool = False) -> str:
    """The report; ``embedded``: as the body of a docs section (no title, sub-headings one level down)."""
    environment = record["environment"]
    sub = "###" if embedded else "##"
    lines = [] if embedded else ["# statekv GPU suite", ""]
    lines += [("Smoke run on CPU: tiny shapes, no figure is a GPU figure." if record["smoke"] else
               "Command: `python benchmarks/gpu_suite.py` on the device below, from a bare machine."), "",
             f"Device: {environment.get('device')}" + ("" if environment.get("device_memory_gib") is None else
                                                        f" ({environment['device_memory_gib']} GiB)") + "  ",
             "Versions: " + ", ".join(f"{name} {environment.get(name)}" for name in
                                      ("python", "torch", "cuda", "triton", "transformers", "av", "statekv"))
             + f", commit {environment.get('commit')}  ",
             f"Elapsed: {record['elapsed_s']} s of a {record['budget_s']:.0f} s budget.", ""]
    if environment.get("missing"):
        lines += [f"Missing: {'; '.join(environment['missing'])}", ""]
    lines += [f"{sub} Against the goals", "", "| figure | measured | goal | before |", "|---|---:|---:|---|"]
    figures = {key: value for section in record["sections"] for key, value in section["figures"].items()}
    names = {"statekv_graph_ms": "8B StateKV B=4096 step, ms per frame",
             "statekv_graph_launches": "8B StateKV step, kernel + graph launches per step",
             "prefill_ratio": "512-frame prefill, StateKV / one-shot SDPA time",
             "pipeline_fps": "1B whole pipeline, frames/s"}
    for key, (goal, better, before) in GOALS.items():
        value = figures.get(key)
        shown = "not measured" if value is None else f"{value:.3g}"
        if value is not None:
            met = value <= goal if better == "lower" else value >= goal
            # a smoke figure is tiny shapes on a CPU: set against a GPU goal, met or short would mean nothing
            shown += " (smoke figure, not comparable)" if record["smoke"] else " (met)" if met else " (short)"
            if key == "prefill_ratio" and figures.get("prefill_ratio_estimated"):
                shown += ", StateKV's time partly estimated"
            if figures.get(VARIANT_OF.get(key)):
                shown += f": {figures[VARIANT_OF[key]]}"
        lines.append(f"| {names[key]} | {shown} | {'<=' if better == 'lower' else '>='} {goal:g} | {before} |")
    lines.append("")
    for section in record["sections"]:
        lines += [f"{sub} {section['name']}", "", f"Status: {section['status']}"
                  + (f" ({section['reason']})" if section["reason"] else "") + f"; {section['seconds']:.0f} s.", ""]
        if section["rows"]:
            # list-valued columns (kernels named, per-frame times) are in the JSON only
            columns = list(dict.fromkeys(key for row in section["rows"] for key, value in row.items()
                                         if not isinstance(value, list)))
            lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            for row in section["rows"]:
                lines.append("| " + " | ".join(shown_value(row.get(column)) for column in columns) + " |")
            lines.append("")
        other = {key: value for key, value in section["figures"].items() if key not in GOALS}
        if other:
            lines += ["Figures: " + ", ".join(f"{key} {shown_value(value)}" for key, value in other.items()), ""]
    return "\n".join(lines)


def shown_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value).replace("|", "/")


# ----------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu_suite", help="folder for gpu_suite.md and gpu_suite.json")
    parser.add_argument("--smoke", action="store_true", help="run on CPU with tiny shapes (what the tests do)")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds for the whole run (default 480; "
                                                                     "smoke 300)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("tests", "step", "prefill", "pipeline", "streams",
                                                                   "steps", "tiers", "ttft", "live"), help="sections not to run")
    parser.add_argument("--live-s", type=float, default=50.0, help="seconds for the live-streams search (its cap)")
    parser.add_argument("--docs", default=None, help=f"markdown file whose '{DOCS_SECTION}' section is replaced by "
                                                      "the report (docs/benchmarks.md)")
    parser.add_argument("--prepare-wheels", metavar="FOLDER", help="download the wheels a CUDA machine without "
                                                                    "network lacks into FOLDER, then stop")
    args = parser.parse_args(argv)
    if args.prepare_wheels:
        prepare_wheels(Path(args.prepare_wheels))
        return 0
    run = Run(Path(args.out), args.budget_s or (300.0 if args.smoke else 480.0), args.smoke,
              Path(args.docs) if args.docs else None)
    facts, missing = environment(args.smoke)
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
    if args.smoke:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    if "tests" not in args.skip:
        run.section("cuda tests", lambda s, d: cuda_tests(s, d, args.smoke), cap_s=60 if args.smoke else 120,
                    needs_s=20)
    with tempfile.TemporaryDirectory(prefix="statekv-gpu-suite-") as scratch:
        folder = Path(scratch)
        if {"step", "prefill", "ttft"} - set(args.skip):
            lm = LanguageModel(shapes, shapes.prefill_frames + 1)
            if "step" not in args.skip:
                run.section("8B step", lambda s, d: lm_step(s, d, lm), cap_s=200, needs_s=30)
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
    run.write()
    print((run.out / "gpu_suite.md").read_text())
    return 1 if any(section.status == "failed" for section in run.sections) else 0


if __name__ == "__main__":
    sys.exit(main())
