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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="not Linux: glibc malloc_trim")
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


_TWO_THREADS = """
import ctypes, ctypes.util, sys, threading
from forgerl.controller import share_malloc_arena
if sys.argv[1] == "shared":
    assert share_malloc_arena()
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def fill(n):
    blocks = [libc.malloc(64 * 1024) for _ in range(n)]
    for b in blocks:
        ctypes.memset(b, 1, 64 * 1024)
    return blocks
freed, done = threading.Event(), threading.Event()
def first():  # 96 MiB, all freed but the newest block (it pins the heap's top), then stays alive
    blocks = fill(1536)
    for b in blocks[:-1]:
        libc.free(b)
    freed.set()
    done.wait()
t = threading.Thread(target=first)
t.start()
freed.wait()
before = rss()
out = {}
second = threading.Thread(target=lambda: out.setdefault("blocks", fill(1536)))
second.start()
second.join()
print(rss() - before)
done.set()
t.join()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="not Linux: glibc mallopt")
def test_one_shared_arena_lets_a_thread_reuse_another_threads_freed_blocks():
    import subprocess

    def growth(mode: str) -> float:
        run = subprocess.run([sys.executable, "-c", _TWO_THREADS, mode], capture_output=True,
                             text=True, check=True, timeout=60)
        return float(run.stdout.split()[-1])

    # per-thread arenas: the second thread's 96 MiB come on top of the first one's free blocks;
    # one arena: it reuses them
    assert growth("own") > 80
    assert growth("shared") < 16
