"""`release_heap` gives the C heap's free pages back to the OS (glibc `malloc_trim`).

Pins (issue 14 item 4): 96 MiB of 64 KiB heap blocks freed around survivors that pin the heap
(so glibc cannot shrink it from the top on its own) stay resident until `release_heap`, which
returns most of them. Linux/glibc only; elsewhere it must be a no-op that never raises.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import pytest

from forgerl.controller import release_heap


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_freed_heap_blocks_go_back_to_the_os():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 * 1024) for _ in range(1536)]  # 96 MiB below the mmap threshold
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)  # touch: resident
    for i, b in enumerate(blocks):
        if i % 64:
            libc.free(b)  # 63 of 64 freed; the survivors pin the heap
    before = _rss_mib()
    release_heap()
    after = _rss_mib()
    for b in blocks[::64]:
        libc.free(b)
    assert before - after > 48, (before, after)  # most of the ~94 MiB freed came back
