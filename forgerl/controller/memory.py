"""Process memory for the controller: glibc heap trimming and arena sharing, and the resident,
peak and CUDA-peak sizes that every step record carries (`Services.log`).

Nothing here imports torch at module level: `cli.main` calls `share_malloc_arena` before any
other import, since glibc fixes its arena limit once a second thread allocates.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import os
import resource
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def release_heap() -> None:
    """Hand the C heap's free pages back to the OS: glibc `malloc_trim(0)` over all arenas (a
    no-op without glibc). Freed tensor buffers otherwise stay resident: after large frees glibc
    raises its mmap threshold (up to 32 MiB), so later buffers come from heaps it never shrinks.
    """
    with contextlib.suppress(OSError, AttributeError, TypeError):
        _libc().malloc_trim(0)


def share_malloc_arena() -> bool:
    """Make threads that start allocating from now on share glibc's main malloc arena
    (`mallopt(M_ARENA_MAX, 1)`); True when glibc took it, False elsewhere (a no-op).

    By default glibc gives each busy thread its own arena, and one arena's free blocks never
    serve another: the trainer thread's freed activations could not hold the engine thread's
    KV caches, so peak RSS was near the sum of the threads' peaks. glibc fixes its arena limit
    at the first allocation of a second thread (importing torch starts one), so `cli.main`
    calls this before any import; the call at the start of `run()` only helps a process not
    yet past that point."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        return bool(_libc().mallopt(-8, 1))  # -8: M_ARENA_MAX in glibc's malloc.h
    return False


def _libc() -> ctypes.CDLL:
    """The C library (glibc on Linux); OSError where there is none to load."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def cuda_peak_gib(device: torch.device) -> dict[str, float]:
    """{"cuda_peak_gib": the most bytes torch's CUDA caching allocator held in tensors on
    `device` since the previous call (`max_memory_allocated`, GiB)}, then resets that peak;
    {} for a device that is not a GPU."""
    import torch  # lazy: torch after cli.main's share_malloc_arena

    if device.type != "cuda":
        return {}
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    torch.cuda.reset_peak_memory_stats(device)
    return {"cuda_peak_gib": peak}


def resident_gib() -> float:
    """This process's resident set size now, GiB; NaN where /proc is not there (not Linux)."""
    try:
        with open("/proc/self/statm") as f:  # Linux: size resident shared ... (pages)
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:  # not Linux
        return math.nan


def peak_rss_gib() -> float:
    """This process's peak resident set size so far, GiB (`ru_maxrss`, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
