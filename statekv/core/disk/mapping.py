"""The disk tier's files mapped into memory with libc: copy-on-write, without reserving memory for them
(``MAP_NORESERVE``), several block files side by side in one run of addresses (`anonymous`, then `mapped` at a part
of it), and holes punched in them (`punch_hole`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import platform
import sys
import weakref
from pathlib import Path

_FALLOC_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
# named from Python 3.14; Linux's value on x86 and Arm (0: reserved, where it is not known)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" and platform.machine() in (
    "x86_64", "aarch64", "i686", "armv7l") else 0)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED, _MAP_ANONYMOUS = 0x10, 0x20  # Linux's values
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Give bytes ``[offset, offset + length)`` of ``fd`` back to the file system (they read as zeros); False where
    it cannot punch holes."""
    return length <= 0 or _libc.fallocate(fd, _FALLOC_PUNCH_HOLE, ctypes.c_long(offset), ctypes.c_long(length)) == 0


def anonymous(size: int) -> ctypes.Array:
    """``size`` bytes of zeros mapped copy-on-write without reserving memory, unmapped once nothing refers to them
    (files are mapped over parts of it, `mapped`'s ``region``, and unmapped with it)."""
    address = _libc.mmap(None, ctypes.c_size_t(size), mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, ctypes.c_long(0))
    if address in (None, _MAP_FAILED):
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    view = (ctypes.c_char * size).from_address(address)
    weakref.finalize(view, _libc.munmap, ctypes.c_void_p(address), ctypes.c_size_t(size)).atexit = False
    return view


def mapped(path: Path, size: int, region: ctypes.Array | None = None, offset: int = 0) -> ctypes.Array | None:
    """The first ``size`` bytes of ``path`` mapped copy-on-write without reserving memory for them, unmapped once
    nothing refers to them; ``region``: mapped ``offset`` bytes into it instead, over a part of that `anonymous`
    mapping (which unmaps it). Mapped with libc: Python's `mmap` holds a duplicate of the file's descriptor while a
    mapping lives, and a save reads a buffer through as many views as it has runs of kept rows."""
    at = None if region is None else ctypes.addressof(region) + offset
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"{path} is shorter than {size} bytes")
        address = _libc.mmap(None if at is None else ctypes.c_void_p(at), ctypes.c_size_t(size),
                             mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | _MAP_NORESERVE | (0 if at is None else _MAP_FIXED), fd,
                             ctypes.c_long(0))
    finally:
        os.close(fd)  # the mapping outlives it
    if address in (None, _MAP_FAILED):
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    if at is not None:
        return None
    view = (ctypes.c_char * size).from_address(address)
    weakref.finalize(view, _libc.munmap, ctypes.c_void_p(address), ctypes.c_size_t(size)).atexit = False
    return view
