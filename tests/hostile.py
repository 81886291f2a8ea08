"""What the hostile suites share: a small StateKV engine over a tiny checkpoint's adapter, frames of noise, and a
child process that sees a folder read-only or a disk full (`run_child`)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

import statekv


def small_qa(adapter, **kwargs) -> statekv.VideoQA:
    """StateKV B=12 with eager attention and room for 40 tokens of prompt, over ``adapter``."""
    return statekv.VideoQA(adapter, statekv.StateKV(budget=12), attention="eager", reserve_tokens=40, **kwargs)


def noise_frames(count: int, seed: int = 0) -> np.ndarray:
    """``count`` random RGB frames ``[count, 24, 32, 3]``."""
    return np.random.default_rng(seed).integers(0, 256, (count, 24, 32, 3), dtype=np.uint8)


def fill_disk_beside(monkeypatch, target: Path) -> None:
    """A stream saved to ``target`` finds the disk full (in its partial folder beside it); saves elsewhere (a
    rescue) are written."""
    import statekv.api.stream_file as stream_file

    real_save = stream_file.save_file

    def disk_full_there(tensors, filename, metadata=None):
        if Path(filename).parent.parent == target.parent:  # in the save's partial folder beside the target
            raise OSError(28, "No space left on device")
        return real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(stream_file, "save_file", disk_full_there)


# -- a child process on a read-only folder or a full disk ----------------------------------------------------------
CHILD_PRELUDE = """
import errno, os, sys, json, traceback
READ_ONLY, MAX_FILE_BYTES = sys.argv[1] or None, int(sys.argv[2])
if MAX_FILE_BYTES:  # writes past this size fail as on a full disk (EFBIG), without root or a mount
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
if READ_ONLY and os.environ.get("STATEKV_TEST_READ_ONLY") == "shim":
    import builtins, io
    def _under(path):
        try:
            return os.path.abspath(os.fspath(path)).startswith(READ_ONLY.rstrip("/") + "/") or \\
                os.path.abspath(os.fspath(path)) == READ_ONLY
        except TypeError:
            return False
    def _refuse(path):
        raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
    def _wrap(real, writes):
        def call(path, *args, **kwargs):
            if writes(args, kwargs) and _under(path):
                _refuse(path)
            return real(path, *args, **kwargs)
        return call
    WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    os.open = _wrap(os.open, lambda a, k: bool((a[0] if a else k.get("flags", 0)) & WRITING))
    for name in ("mkdir", "unlink", "remove", "rmdir", "truncate"):
        setattr(os, name, _wrap(getattr(os, name), lambda a, k: True))
    for name in ("replace", "rename", "link"):
        real = getattr(os, name)
        setattr(os, name, lambda src, dst, *a, _real=real, **k: _refuse(dst) if _under(dst) or _under(src)
                else _real(src, dst, *a, **k))
    _mode = lambda a, k: any(c in (a[0] if a else k.get("mode", "r")) for c in "wax+")
    builtins.open = io.open = _wrap(builtins.open, _mode)
sys.argv = sys.argv[2:]
def report(**fields):
    print("RESULT " + json.dumps(fields), flush=True)
def attempt(call):
    from statekv.errors import StateKVError
    try:
        return report(ok=True, value=call())
    except StateKVError as error:
        return report(ok=False, kind=type(error).__name__, message=str(error))
    except BaseException as error:
        return report(ok=False, kind=type(error).__name__, message=str(error), raw=traceback.format_exc())
"""


@functools.cache
def read_only_way() -> str:
    """How a child sees a folder read-only: a read-only bind mount in a mount namespace of its own (root, where
    namespaces are allowed), the folder's permissions (anyone but root), or, where neither holds, a shim failing
    the child's own writes under it as the system would (EROFS). ``STATEKV_TEST_READ_ONLY`` chooses one."""
    if os.environ.get("STATEKV_TEST_READ_ONLY") in ("namespace", "chmod", "shim"):
        return os.environ["STATEKV_TEST_READ_ONLY"]
    if os.geteuid() != 0:
        return "chmod"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "mount", "--bind", "/", "/"],
                           capture_output=True) if shutil.which("unshare") else None
    return "namespace" if probe is not None and probe.returncode == 0 else "shim"


def run_child(script: str, *args, read_only: Path | None = None, max_file_bytes: int = 0,
              timeout: float = 300) -> tuple[dict, subprocess.CompletedProcess]:
    """Run ``script`` (after `CHILD_PRELUDE`, with ``args`` as ``sys.argv[1:]``) in a child process that sees
    ``read_only`` read-only (`read_only_way`) and whose files cannot grow past ``max_file_bytes`` (0: no limit);
    return what it `report`-ed last, and the process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         str(Path(__file__).resolve().parent)]),
           "STATEKV_TEST_READ_ONLY": read_only_way()}
    command = [sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(script), str(read_only or ""),
               str(max_file_bytes), *map(str, args)]
    if read_only is not None and read_only_way() == "namespace":
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"', str(read_only),
                   *command]
    modes = {}
    if read_only is not None and read_only_way() == "chmod":
        for path in [read_only, *read_only.rglob("*")]:
            modes[path] = path.stat().st_mode
            path.chmod(modes[path] & ~0o222)
    try:
        child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    results = [line[len("RESULT "):] for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, (child.stdout[-2000:], child.stderr[-4000:])
    return json.loads(results[-1]), child
