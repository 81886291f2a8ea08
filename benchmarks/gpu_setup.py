"""What the GPU suite needs of its machine: the environment it reports, the wheels a machine without network
lacks (`make gpu-wheels`), and the tests marked ``cuda``."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_shapes import Section

ROOT = Path(__file__).resolve().parents[1]
PINNED = ("transformers", "av")  # what a CUDA machine's image may lack or hold at another version
# the live-streams section's `statekv serve` and `statekv bench serve` with everything they need (pip's
# resolution of fastapi, uvicorn, prometheus-client, httpx and python-multipart): a CUDA image may lack any
SERVING = ("fastapi", "uvicorn", "starlette", "pydantic", "pydantic-core", "annotated-types", "annotated-doc",
           "typing-inspection", "typing-extensions", "python-multipart", "opentelemetry-api", "anyio", "idna",
           "click", "h11", "prometheus-client", "httpx", "httpcore", "certifi")
CUDA_TEST_FILES = ("tests/test_cuda.py", "tests/test_static_step.py", "tests/test_kernel_triton.py",
                   "tests/test_cache_state.py")


def environment(smoke: bool, serving: bool = True) -> tuple[dict[str, Any], list[str]]:
    """What this machine has, and what the suite needs but is missing (empty when it can run); ``serving``: the
    live-streams section runs, so `SERVING` is needed too."""
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
    absent = []
    for name in SERVING:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = None
            absent.append(name)
        if name in ("fastapi", "uvicorn"):
            facts[name] = version
    if serving and absent:
        missing.append(f"{', '.join(absent)} (the live-streams section's server; `make gpu-wheels` here, then "
                       "install .whl/*.whl there)")
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


def cuda_tests(section: Section, deadline: float, smoke: bool) -> None:
    """The tests marked ``cuda`` in a child pytest (on CPU, ``--smoke`` only collects them, in this process: a
    child's start, torch and transformers imported again, would be nearly all of its time)."""
    options = ["-m", "cuda", "-q", "-p", "no:cacheprovider", "-rfEs", *CUDA_TEST_FILES]
    if smoke:
        summary, rows = collected_here(options)
        section.figures.update(summary)
        section.rows = rows
        if summary.get("errors", 0):
            section.status, section.reason = "failed", f"{summary['errors']} collection errors: {rows[0]['test']}"
        elif summary.get("collected", 0) == 0:
            section.status, section.reason = "failed", "no test is marked cuda"
        return
    command = [sys.executable, "-m", "pytest", *options]
    # one tile per kernel pass, in a tile cache of their own: checks need no tuning, and the measurements
    # below must not inherit untuned tiles
    with tempfile.TemporaryDirectory(prefix="statekv-cuda-tests-") as scratch:
        environment = {**os.environ, "STATEKV_TILE_CANDIDATES": "1", "STATEKV_CACHE": scratch}
        output = run_child(command, environment, deadline, section)
    print(output[-6000:], flush=True)
    summary = pytest_summary(output)
    section.figures.update(summary)
    section.rows = [{"test": line} for line in output.splitlines()
                    if line.startswith(("FAILED", "ERROR", "SKIPPED"))][:40]
    if summary.get("failed", 0) or summary.get("errors", 0):
        section.status = "failed"
        section.reason = f"{summary.get('failed', 0)} failed, {summary.get('errors', 0)} errors"
    elif summary.get("passed", 0) == 0 and section.status != "failed":
        section.status, section.reason = "failed", "no CUDA test ran"


def collected_here(options: list[str]) -> tuple[dict[str, int], list[dict[str, str]]]:
    """``pytest --collect-only`` with ``options`` in this process: the counts its summary line would give
    (collected, deselected, errors) and a row per file that could not be collected. The environment, the import
    path and the working folder are put back as they were."""
    import pytest

    class Counts:
        def __init__(self):
            self.counts = {"collected": 0, "deselected": 0}
            self.rows: list[dict[str, str]] = []

        def pytest_deselected(self, items):
            self.counts["deselected"] += len(items)

        def pytest_collectreport(self, report):
            if report.failed:
                self.counts["errors"] = self.counts.get("errors", 0) + 1
                self.rows.append({"test": f"ERROR {report.nodeid}"})

        def pytest_collection_finish(self, session):
            self.counts["collected"] = len(session.items)

    counts, environment, path, folder = Counts(), dict(os.environ), list(sys.path), os.getcwd()
    try:
        os.chdir(ROOT)
        status = pytest.main([*options, "--collect-only"], plugins=[counts])
    finally:
        os.chdir(folder)
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(environment)
    sys.stdout.flush()
    if status in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.INTERNAL_ERROR):  # not "no test is marked cuda"
        counts.counts["errors"] = counts.counts.get("errors", 0) + 1
        counts.rows.append({"test": f"ERROR pytest could not collect ({status.name.lower()})"})
    return counts.counts, counts.rows[:40]


def run_child(command: list[str], environment: dict[str, str], deadline: float, section: Section) -> str:
    """The child pytest's output; cut at the section's time cap, what it printed so far."""
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=environment,
                                timeout=max(10.0, deadline - time.monotonic()))
        return result.stdout + result.stderr
    except subprocess.TimeoutExpired as expired:
        section.status, section.reason = "failed", "cut at the section's time cap"
        return (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")


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
