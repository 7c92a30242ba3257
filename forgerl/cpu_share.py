"""Splitting a small CPU between the local engine's decode thread and the trainer's thread.

With one-step off-policy scheduling the local engine decodes the next step's rollouts while the
trainer runs the current step, in two threads of one process. Each thread runs torch's intra-op
pool, by default one OpenMP thread per core, so both together put 2x the cores' worth of threads
on the CPU, and each OpenMP barrier waits for a descheduled thread. Measured on a 2-core AVX2
EPYC with SmolLM2-135M fp32 (16 rows x 96 tokens, 800-token train steps in a second thread):

    threads (engine, trainer)      decode tok/s    s per train step
    alone: 2 / alone: 2            95.7            7.2
    alone: 1 / alone: 1            82.8            11.0
    together, 2 + 2                56.7            11.3-12.9
    together, 1 + 1                68.5            10.7-12.6

so while both are busy each gets half of the cores, and a thread that runs alone gets all of
them. `torch.set_num_threads` sets the calling thread's own OpenMP and MKL thread counts, which
is what makes a per-thread split possible.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class CpuShare:
    """Who of ("engine", "trainer") is busy now, and how many intra-op threads each gets.

    cores: threads for a part that runs alone (default `torch.get_num_threads()` at
    construction); max(1, cores // 2) each while both are busy.
    """

    def __init__(self, cores: int | None = None) -> None:
        self.cores = cores or torch.get_num_threads()
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def threads(self, who: str) -> int:
        """Intra-op threads for `who` now: half of the cores while another part is busy."""
        with self._lock:
            alone = not (self._busy - {who})
        return self.cores if alone else max(1, self.cores // 2)

    def enter(self, who: str) -> int:
        """Mark `who` busy and set the calling thread's torch thread count for it; returns it."""
        with self._lock:
            self._busy.add(who)
        threads = self.threads(who)
        torch.set_num_threads(threads)  # always: a new thread may report the global count
        return threads

    def leave(self, who: str) -> None:
        """Mark `who` idle (the other part gets all cores at its next `enter`)."""
        with self._lock:
            self._busy.discard(who)

    @contextmanager
    def busy(self, who: str) -> Iterator[None]:
        """`enter(who)` for the duration of the block, then `leave(who)`."""
        self.enter(who)
        try:
            yield
        finally:
            self.leave(who)
