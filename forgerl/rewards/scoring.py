"""Run reward functions out of process, with a per-item timeout (CASES.md C13).

A verifier is user code: it can busy-loop in pure CPU (not awaitable, not interruptible by a
thread) or raise. `score_with_timeout` runs each item in its own short-lived process, at most
`os.cpu_count()` at once, forked by multiprocessing's fork server: a small process started at
first use that imports `fn`'s module once, so a child starts with it imported. The run's own
process is never forked: it holds gigabytes (policy, AdamW state, engine, KV caches), and each
fork of it copied its page tables and left every page write-protected, so the run's next write
to each page took a copy-on-write fault. As with any spawn or fork-server start, a script that
drives ForgeRL itself must keep its work under `if __name__ == "__main__":`.

An item that has not answered `timeout_s` after its process started is killed with its whole
process group and reaped; it and any item that raised or returned a non-finite value get the
fallback reward and a status, so the caller can count reward timeouts and errors. The call
blocks; from async code run it with `asyncio.to_thread`.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

ScoreStatus = Literal["ok", "timeout", "error"]
_CONTEXT = mp.get_context("forkserver")
# what the fork server imports once, when it starts (the first call of `score_with_timeout` or
# `submit`): the default verifier's package and the run's own entry point
PRELOAD = ["reasoning_gym", "forgerl.rewards.reasoning_gym", "forgerl.cli"]


@dataclass(frozen=True)
class ScoreResult:
    """One item's reward (a dict: one per policy). status "ok": `fn`'s value; "timeout" /
    "error": the fallback, with the reason in `error` (exception type and message, or the
    timeout)."""

    reward: float | dict[str, float]
    status: ScoreStatus
    error: str = ""


def score_with_timeout(
    fn: Callable[..., float],
    items: Sequence[tuple],
    timeout_s: float,
    fallback: float = 0.0,
    max_workers: int | None = None,
) -> list[ScoreResult]:
    """`fn(*item)` for every item, each in its own process, in input order.

    `fn` must be picklable by reference (a module-level function) and return a float. Each item
    may run for `timeout_s` seconds (wall clock, from its process start); with
    `len(items) <= max_workers` (default `os.cpu_count()`) the whole call returns in about
    `timeout_s` plus process start-up (a few ms per child; the fork server's own start, once
    per process, imports `fn`'s module) even if some items never return. Blocks the calling
    thread.
    """
    # read when the fork server starts (the first call); later calls' modules import per child.
    # Each child also runs the parent's main script as __mp_main__ (Python 3.11's fork server
    # never preloads it), as spawn does: cheap for `forgerl`, whose imports are preloaded here
    _CONTEXT.set_forkserver_preload([*PRELOAD, fn.__module__])
    workers = max(1, max_workers or os.cpu_count() or 1)
    results: list[ScoreResult | None] = [None] * len(items)
    queue = list(enumerate(items))
    running: dict[Connection, tuple[int, mp.process.BaseProcess, float]] = {}
    while queue or running:
        while queue and len(running) < workers:
            index, item = queue.pop(0)
            receiver, sender = _CONTEXT.Pipe(duplex=False)
            proc = _CONTEXT.Process(target=_child, args=(sender, fn, tuple(item)), daemon=True)
            proc.start()
            sender.close()
            running[receiver] = (index, proc, time.monotonic() + timeout_s)
        next_deadline = min(deadline for _, _, deadline in running.values())
        ready = wait(list(running), timeout=max(0.0, next_deadline - time.monotonic()))
        now = time.monotonic()
        for conn in list(running):
            index, proc, deadline = running[conn]
            if conn in ready:
                results[index] = _receive(conn, fallback)
            elif now >= deadline:
                results[index] = ScoreResult(fallback, "timeout", f"no reward in {timeout_s} s")
            else:
                continue
            del running[conn]
            conn.close()
            _kill(proc)
    return [r for r in results if r is not None]


def submit(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """`fn(*args)` in a daemon child of the fork server (started, with `PRELOAD`, if it is not
    running); returns at once: a helper thread waits out the server's start and the result.
    What `fn` raises is raised by `.result()`. The run submits its task generation this way
    before it imports torch: the server's import of reasoning-gym and the generation
    use the other core meanwhile, and the server is warm for the first reward. `fn` and `args`
    must be picklable (`fn` by reference). The child holds only the sending end of its pipe:
    once this process is gone (even by SIGKILL) it ends, with nothing left behind."""
    _CONTEXT.set_forkserver_preload(PRELOAD)
    future: Future[Any] = Future()

    def wait() -> None:
        try:
            receiver, sender = _CONTEXT.Pipe(duplex=False)
            proc = _CONTEXT.Process(target=_send_result, args=(sender, fn, args), daemon=True)
            proc.start()
            sender.close()
            try:
                kind, value = receiver.recv()
            except EOFError:
                kind, value = "error", RuntimeError(f"{fn.__name__}: its process died")
            proc.join()
            (future.set_result if kind == "ok" else future.set_exception)(value)
        except BaseException as exc:  # e.g. the fork server could not start
            future.set_exception(exc)

    threading.Thread(target=wait, name="forgerl-submit", daemon=True).start()
    return future


def _send_result(conn: Connection, fn: Callable[..., Any], args: tuple) -> None:
    """`submit`'s child: ("ok", value) or ("error", the exception) to the parent; nothing
    (no traceback on the run's stderr either) once the parent is gone."""
    try:
        message = ("ok", fn(*args))
    except BaseException as exc:
        message = ("error", exc)
    try:
        try:
            conn.send(message)
        except (TypeError, AttributeError, pickle.PicklingError) as exc:  # does not pickle
            conn.send(("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
    except OSError:  # BrokenPipeError: the run ended (or was killed) before the result
        pass


def status_counts(results: Sequence[ScoreResult]) -> dict[str, int]:
    """Counts for logging: {"reward_timeouts": n, "reward_errors": m}."""
    counts = Counter(r.status for r in results)
    return {"reward_timeouts": counts["timeout"], "reward_errors": counts["error"]}


def as_reward(value: Any) -> float | dict[str, float]:
    """A verifier's value as a reward: a float, or a dict of one float per policy name."""
    return ({str(k): float(v) for k, v in value.items()} if isinstance(value, dict)
            else float(value))


def _child(conn: Connection, fn: Callable[..., float], item: tuple) -> None:
    """Worker body: own process group (so a killed verifier takes its children along)."""
    os.setpgrp()
    try:
        reward = as_reward(fn(*item))
        finite = all(map(math.isfinite, reward.values() if isinstance(reward, dict) else [reward]))
        conn.send(("ok", reward) if finite else ("error", f"reward {reward}"))
    except BaseException as exc:  # the verifier's fault, reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _receive(conn: Connection, fallback: float) -> ScoreResult:
    """The child's message; a child that died without one (e.g. os._exit) counts as an error."""
    try:
        kind, value = conn.recv()
    except (EOFError, OSError):
        return ScoreResult(fallback, "error", "reward process died without a result")
    return ScoreResult(value, "ok") if kind == "ok" else ScoreResult(fallback, "error", value)


def _kill(proc: mp.process.BaseProcess) -> None:
    """SIGKILL the item's process group (a finished one may have left children) and reap it."""
    if proc.pid is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.join()
