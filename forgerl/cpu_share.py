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

so while both are busy each gets half of the cores. `torch.set_num_threads` sets the calling
thread's own OpenMP and MKL thread counts, which is what makes a per-thread split possible.

One OpenMP team at a time. Every thread that runs a parallel region with more than one thread
gets its own libgomp pool, whose workers live as long as that thread. Once the pools' workers
plus the main thread outnumber the cores, libgomp stops spinning between regions (its
"throttled" wait: about 100 spins, then a futex sleep), so each of the thousand-odd parallel
regions of a decode step waits for a sleeping worker to wake. Measured on a 2-core Xeon with
AMX, SmolLM2-135M bf16, one decode step at 32 rows x 250 cached tokens: 65 ms from the main
thread; 98 ms from a second thread once the main thread had loaded the model with two threads
(its pool has a worker), so the same as one thread (101 ms); 67 ms from the second thread when
the main thread never ran a team. A SmolLM2 train step (1,254-token tree): 3.07 s unthrottled,
3.88 s throttled, 4.94 s at one thread. So a run that shares the CPU keeps its main thread at
one thread (`single_threaded_caller`, before the model is loaded), and the two parts' largest
teams fit the cores: the trainer gets at most half of them, the engine the rest plus the main
thread's core (2 cores: the engine 2 alone and 1 beside the trainer; the trainer always 1).

Prefills run at the engine's count beside the trainer, alone or not. A prefill runs when new
requests arrive, which is when the gateway's event loop parses and renders them and agents
start, so it seldom has the cores to itself, and a team on all of them then waits at each
barrier for a descheduled thread. `perf sched` in the main job caught a 248-token prefill that
took 5.5 s (0.3 s with the cores to itself), on 2 cores beside the trainer's thread (which had
started during it) and then 8 starting agents. Decode steps, short and run while the agents
wait, keep the alone-count. TRL-shaped main job, 2-core Xeon, 2026-12-05: the engine's prefill
seconds per run 28.6-31.2 (5 runs) -> 22.9-23.2 (3 runs); 11.43 -> 10.90 s/step on average,
within the runs' spread (10.4-11.7).
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
