"""How the GPU suite measures: timing on the device, memory, and what a step launches, copies and syncs
(`profile_counts`) or dispatches (`traced_ops`)."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any, Callable

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
COPIES = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TOP_NAMED = 8  # kernels and host ops named per profiled variant, in the JSON only


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
    busy time (the sum of its kernels' time), that time by `kernel_kind`, the kernels that took the most
    (``top_kernels``: name and ms per step) and the ops whose host time was the most (``top_host_ops``: name,
    calls and ms per step)."""
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
    top = sorted(kernels.items(), key=lambda item: -item[1])[:TOP_NAMED]
    result["top_kernels"] = [[name[:90], round(ms, 3)] for name, ms in top]
    # where the host's time goes (a step bound by launches and syncs, not kernels): op, calls and ms per step
    host = sorted(prof.key_averages(), key=lambda item: -item.self_cpu_time_total)[:TOP_NAMED]
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
