"""Shared memory, registers and spills of every candidate tile, compiled ahead of time (no GPU needed).

Each tile of both scored-attention passes is compiled with Triton for a GPU architecture (``--arch 80``:
A100, ``90``: H100) as a real call specialises it (`statekv.kernels.ahead_of_time.compile_tile`). The cubin's resource usage (``cuobjdump
-res-usage``, bundled with Triton) gives registers per thread and stack bytes (spills); Triton's metadata
gives the shared memory, printed beside `statekv.kernels.tuning.shared_memory_bytes`, the estimate the
pruning uses. Compiling takes seconds per tile (minutes in fp32); Triton caches the results.

    python benchmarks/kernel_resources.py --arch 90 --head-dims 64 128 --dtypes bf16 --out docs/kernel.md
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET"):
    raise SystemExit("unset TRITON_INTERPRET: this script compiles the kernels")

import triton  # noqa: E402

from statekv.kernels.ahead_of_time import compile_tile  # noqa: E402
from statekv.kernels.tuning import PASSES, registers_per_thread, shared_memory_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from report import write_section  # noqa: E402

ELEMENT = {"bf16": 2, "fp16": 2, "fp32": 4}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def resources(compiled) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        listing = subprocess.run([str(CUOBJDUMP), "-res-usage", cubin.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", listing))
    return {"registers": int(found.get("REG", -1)), "stack": int(found.get("STACK", -1)),
            "shared": int(compiled.metadata.shared)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="SM versions, e.g. 80 90")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(ELEMENT), default=["bf16"])
    parser.add_argument("--out", type=Path, help="markdown file whose section of this script to replace")
    args = parser.parse_args(argv)
    lines = ["| arch | dtype | D | pass | tile (M, N, warps, stages) | registers | spill stack B | shared B "
             "| estimate B | est. registers |", "|---|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for arch in args.arch:
        for dtype in args.dtypes:
            for head_dim in args.head_dims:
                for pass_name, tiles in PASSES.items():
                    for tile in tiles:
                        started = time.perf_counter()
                        used = resources(compile_tile(pass_name, tile, dtype, head_dim, arch))
                        size = ELEMENT[dtype]
                        lines.append(f"| sm_{arch} | {dtype} | {head_dim} | {pass_name} | {tuple(tile)} "
                                     f"| {used['registers']} | {used['stack']} | {used['shared']} "
                                     f"| {shared_memory_bytes(tile, pass_name, head_dim, size)} "
                                     f"| {registers_per_thread(tile, pass_name, head_dim, size)} |")
                        print(lines[-1], f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
    command = "python benchmarks/kernel_resources.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = "\n".join([
        f"Command: `{command.strip()}` (Triton {triton.__version__}, compiled on the CPU, specialised as a call "
        "with contiguous head dims).  ",
        "Registers per thread and spill stack from `cuobjdump -res-usage`; shared memory from Triton's metadata; "
        "the estimates are `shared_memory_bytes` and `registers_per_thread`, which the pruning compares with the "
        "device's shared memory and 255 registers.", "", *lines])
    print(report)
    if args.out:
        write_section(args.out, "Compiled resources per tile", report)


if __name__ == "__main__":
    main()
