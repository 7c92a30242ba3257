"""Splitting a small CPU between the local engine's decode thread and the trainer's thread.

With one-step off-policy scheduling the local engine decodes the next step's rollouts while the
trainer runs the current step, in two threads of one process. Each thread runs torch's intra-op
pool, by default one OpenMP thread per core, so both together put 2x the cores' worth of threads
on the CPU, and each OpenMP barrier waits for a descheduled thread, so while both are busy each
gets half of the cores. `torch.set_num_threads` sets the calling thread's own OpenMP and MKL
thread counts, which is what makes a per-thread split possible.

One OpenMP team at a time. Every thread that runs a parallel region with more than one thread
gets its own libgomp pool, whose workers live as long as that thread. Once the pools' workers
plus the main thread outnumber the cores, libgomp stops spinning between regions (its
"throttled" wait: about 100 spins, then a futex sleep), so each of the thousand-odd parallel
regions of a decode step waits for a sleeping worker to wake. So a run that shares the CPU keeps
its main thread at one thread (`single_threaded_caller`, before the model is loaded), and the
two parts' largest teams fit the cores: the trainer gets at most half of them, the engine the
rest plus the main thread's core (2 cores: the engine 2 alone and 1 beside the trainer; the
trainer always 1).

Prefills run at the engine's count beside the trainer, alone or not. A prefill runs when new
requests arrive, which is when the gateway's event loop parses and renders them and agents
start, so it seldom has the cores to itself, and a team on all of them then waits at each
barrier for a descheduled thread. Decode steps, short and run while the agents wait, keep the
alone-count.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class CpuShare:
    """Who of ("engine", "trainer") is busy now, and how many intra-op threads each gets.

    cores: the CPU's threads (default `torch.get_num_threads()` at construction). The trainer
    gets T = max(1, cores // 2) threads; the engine gets cores + 1 - T alone and cores - T (at
    least 1) while the trainer is busy. So the two teams' workers plus the main thread never
    outnumber the cores (T + engine's most <= cores + 1) and libgomp keeps spinning between
    regions (module docstring); 2 cores: engine 2 alone, 1 beside the trainer; trainer 1.
    The engine's prefills ("prefill") always get cores - T (at least 1).
    """

    def __init__(self, cores: int | None = None) -> None:
        self.cores = cores or torch.get_num_threads()
        self.trainer_threads = max(1, self.cores // 2)
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def threads(self, who: str) -> int:
        """Intra-op threads for `who` now (class docstring): "trainer", "engine", or
        "prefill", the engine's prefills, always at its count beside the trainer."""
        if who == "trainer":
            return self.trainer_threads
        with self._lock:
            alone = who != "prefill" and not (self._busy - {who})
        return self.cores + 1 - self.trainer_threads if alone else max(
            1, self.cores - self.trainer_threads)

    def enter(self, who: str) -> int:
        """Mark `who` busy and set the calling thread's torch thread count for it; returns it."""
        with self._lock:
            self._busy.add(who)
        threads = self.threads(who)
        # torch sets a thread's count from the process-wide one at the thread's first parallel
        # op, after any set_num_threads of its own: get first, so that it happens now
        torch.get_num_threads()
        torch.set_num_threads(threads)
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


def single_threaded_caller() -> int:
    """Set the calling thread's torch intra-op threads to 1, before it runs any parallel op, so
    that it never starts an OpenMP team (module docstring); returns the count it had, the
    CPU's threads to give a `CpuShare`."""
    cores = torch.get_num_threads()
    torch.set_num_threads(1)
    return cores
