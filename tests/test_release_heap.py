"""`release_heap` gives the C heap's free pages back to the OS (glibc `malloc_trim`), and
`tune_heap` makes buffers of 1 MiB and more their own mappings, freed to the OS at once.

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


MMAPPED_AFTER_FREE = """
import ctypes, ctypes.util, sys
from forgerl.controller import tune_heap

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "tuned":
    tune_heap()
libc.free(libc.malloc(2 << 20))  # an mmapped 2 MiB freed: glibc's own threshold rises past it
buffer = libc.malloc(2 << 20)
print(libc.mallinfo2().hblkhd)  # bytes in mmapped chunks now
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt / mallinfo2")
def test_tuned_heap_keeps_mmapping_large_buffers():
    """glibc's dynamic threshold serves a second 2 MiB buffer from the heap (0 bytes mmapped);
    after `tune_heap` it is its own mapping (>= 2 MiB mmapped), returned to the OS when freed."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    mmapped = {mode: int(subprocess.run([sys.executable, "-c", MMAPPED_AFTER_FREE, mode],
                                        env=env, capture_output=True, text=True,
                                        check=True).stdout)
               for mode in ("tuned", "default")}
    assert mmapped["tuned"] >= 2 << 20 and mmapped["default"] < 2 << 20, mmapped
