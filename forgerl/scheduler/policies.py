"""Which finished groups the trainer takes, and when new tasks may start (Forge §3.1).

Three policies behind one method, `select(finished, trained, head, k)`:

- `Fifo`: train the queue head only, in order (with max_off_policy_steps=0: synchronous RL).
- `Fffo`: first finished first out: any finished group (highest throughput, biased towards quick
  tasks: slow, hard tasks are trained late and far off-policy).
- `WindowedFifo(W)`: any finished group among queue positions [i, i+W-1], i = the head (lowest
  untrained index); the window slides only when the head is consumed. Fifo is W = 1, Fffo is
  W = ∞ in finish order.

Admission control (`max_off_policy_steps` = L). Off-policy lag of a trained group = trainer
weight_version when it is trained - the weight_version that produced its oldest token. Let t be the
trainer version, k the groups per step, v_u the version at which task u was dispatched (its oldest
token is at least that new) and C_u the number of admitted, untrained tasks other than u that the
policy could train before u: those at positions ≤ u + W - 1 (all of them when W = ∞). Each step
trains k of them, so u is trained at version ≤ t + ⌊C_u / k⌋. A task is admitted only while
t + ⌊C_u / k⌋ - v_u ≤ L holds for every admitted task u, the new one included. A step lowers every
C_u by k and raises t by 1, so the invariant, and with it lag ≤ L, holds for every trained group;
finished work is never discarded, admission pauses instead (CASES.md C10). L = 0 admits one
step's k tasks at a time: synchronous training. The invariant, at the newest task, also caps the
admitted, untrained tasks at (L + 1) k.

Concurrency (`max_in_flight`) caps the groups still generating, like AReaL's
max_concurrent_rollouts: a finished group waiting to be trained (outside the window, or behind a
busy trainer) frees its slot at once and waits in the data pool. Only L bounds that backlog, so a
straggler at the head of a windowed FIFO idles the trainer, not the rollout engines.

`Scheduler` drives the queue (`forgerl.scheduler.queue.GenerationQueue`) with one policy; it is
pure, and `state()` / `from_state()` persist it (JSON) for resume (CASES.md C12).
"""

from __future__ import annotations

import logging
from bisect import bisect_right
from collections import Counter
from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import Any, Protocol

from forgerl.scheduler.queue import GenerationQueue

log = logging.getLogger(__name__)
_ENDED_OK = ("finished", "failed")  # trajectory statuses a resume keeps


class Policy(Protocol):
    """Chooses finished groups to train. `window`: W, or None for unbounded (FFFO)."""

    name: str
    window: int | None

    def select(
        self, finished: Sequence[int], trained: Set[int], head: int, k: int
    ) -> list[int]:
        """Up to k task indices to train now, in training order.

        finished: untrained finished task indices, in finish order. trained: trained indices
        above `head`. head: the lowest untrained index.
        """
        ...


@dataclass(frozen=True)
class WindowedFifo:
    """Forge windowed FIFO: the lowest-index finished groups inside [head, head+W-1].

    Picking the head slides the window before the next pick, so one call can take up to k groups
    even when W < k. Raises ValueError for W < 1.
    """

    window: int
    name: str = "windowed_fifo"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window ({self.window}) must be >= 1")

    def select(
        self, finished: Sequence[int], trained: Set[int], head: int, k: int
    ) -> list[int]:
        """See `Policy.select`."""
        available = sorted(finished)
        chosen: list[int] = []
        while len(chosen) < k and available and available[0] < head + self.window:
            chosen.append(available.pop(0))
            while head in trained or head in chosen:
                head += 1
        return chosen


@dataclass(frozen=True)
class Fifo(WindowedFifo):
    """Train the head only, in queue order (windowed FIFO with W = 1)."""

    window: int = 1
    name: str = "fifo"


@dataclass(frozen=True)
class Fffo:
    """First finished, first out: the k earliest-finished groups, anywhere in the queue."""

    window: None = None
    name: str = "fffo"

    def select(
        self, finished: Sequence[int], trained: Set[int], head: int, k: int
    ) -> list[int]:
        """See `Policy.select`."""
        return list(finished[:k])


def make_policy(name: str, window: int | None = None) -> Policy:
    """The policy of config `type` `name`: "fifo", "fffo" or "windowed_fifo" (W = `window`).
    Raises ValueError for another name."""
    if name == "windowed_fifo" and window is not None:
        return WindowedFifo(window)
    if name not in ("fifo", "fffo"):
        raise ValueError(f"unknown scheduler policy {name!r} (fifo | fffo | windowed_fifo W)")
    return Fifo() if name == "fifo" else Fffo()


def resolve_window(window: float, tasks_per_step: int) -> int:
    """W as a count: `window` itself when >= 1, else max(1, round(window * tasks_per_step))."""
    if window <= 0:
        raise ValueError(f"window ({window}) must be > 0")
    return int(window) if window >= 1 else max(1, round(window * tasks_per_step))


def admissible(
    admitted: dict[int, int], candidate: int, version: int, trainer_version: int,
    batch_size: int, window: int | None, max_off_policy_steps: int,
) -> bool:
    """Whether dispatching `candidate` at `version` keeps every admitted task's lag ≤ L.

    admitted: untrained admitted index → dispatch version. See the module docstring for the
    bound t + ⌊C_u / k⌋ - v_u ≤ L. Cost O(A log A) for A admitted tasks.
    """
    versions = {**admitted, candidate: version}
    order = sorted(versions)
    for u in order:
        if window is not None and u + window - 1 < candidate:
            continue  # u's bound does not count the candidate; it held before
        others = len(order) - 1 if window is None else bisect_right(order, u + window - 1) - 1
        if trainer_version + others // batch_size - versions[u] > max_off_policy_steps:
            return False
    return True


class Scheduler:
    """The pure scheduling state machine the controller drives (see the module docstring).

    Call order per step: `admit(v)` → dispatch those tasks; `on_group_finished(i, v_min)` as
    groups complete; `next_batch()` (None = wait for more groups); train; `on_trained(batch, v')`.

    Args:
        policy: Fifo(), Fffo() or WindowedFifo(W).
        batch_size: k, groups per optimizer step (fixed: the lag bound counts steps of k).
        max_off_policy_steps: L, or None for no admission bound.
        max_in_flight: cap on groups still generating (admitted, not finished); finished groups
            wait for the trainer outside this cap. Default (L + 1) * k (2k when L is None).
        group_size: G (for `on_rollout_ended`). num_tasks: total indices (None: unbounded).
        version: the trainer's weight_version at start.
    """

    def __init__(
        self, policy: Policy, batch_size: int, max_off_policy_steps: int | None = None,
        max_in_flight: int | None = None, group_size: int = 1, num_tasks: int | None = None,
        version: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be >= 1")
        self.policy = policy
        self.batch_size = batch_size
        self.max_off_policy_steps = max_off_policy_steps
        lag_steps = 1 if max_off_policy_steps is None else max_off_policy_steps
        self.max_in_flight = max_in_flight or (lag_steps + 1) * batch_size
        self.queue = GenerationQueue(group_size=group_size, num_tasks=num_tasks)
        self.version = version
        self.lag_counts: Counter[int] = Counter()
        """Off-policy lag (steps) → number of trained groups with it."""
        self.last_lags: dict[int, int] = {}
        """Task index → off-policy lag, for the last trained batch."""
        self.kept_versions: dict[int, int] = {}
        """Re-queued task index → oldest weight_version of its kept rollouts (`resume`)."""

    @classmethod
    def build(
        cls, config: Any, rollout: Any, pool: Any = None, state: dict[str, Any] | None = None
    ) -> Scheduler:
        """From `config.SchedulerConfig` + `RolloutConfig`; with `state`, resume against `pool`.

        Resume keeps the queue, version and lag counts of `state`, and takes policy, window,
        k, L and max_in_flight from the config (a warning names the ones that changed; tasks
        admitted under the old settings may exceed a lowered bound, and `admit` keeps the run
        live even when the bound would admit nothing). With a `pool`, the pool is then
        reconciled with the state (`resume`), also when `state` is None (a run stopped before
        its first checkpoint restarts from a fresh scheduler).
        """
        k = rollout.tasks_per_step
        window = getattr(config.policy, "window", None)
        policy = make_policy(config.policy.type,
                             None if window is None else resolve_window(window, k))
        scheduler = cls(policy, k, config.max_off_policy_steps, config.max_in_flight,
                        group_size=rollout.group_size)
        if state is None:
            if pool is not None:
                scheduler.resume(pool)
            return scheduler
        restored = cls.from_state(state)
        settings = ("policy", "window", "batch_size", "max_off_policy_steps", "max_in_flight")
        now = scheduler.state()
        if changed := {key: (state[key], now[key]) for key in settings if state[key] != now[key]}:
            log.warning("resuming with new scheduler settings (checkpoint → config): %s", changed)
        scheduler.queue, scheduler.version = restored.queue, restored.version
        scheduler.queue.group_size = rollout.group_size
        scheduler.lag_counts = restored.lag_counts
        if pool is not None:
            scheduler.resume(pool)
        return scheduler

    # ---- the loop -----------------------------------------------------------------------------

    def admit(self, now_version: int, max_untrained: int | None = None) -> list[int]:
        """Task indices to dispatch now at engine weight_version `now_version` (ascending).

        Stops at `max_in_flight` generating groups, the end of the stream, the lag bound, or
        `max_untrained` admitted, untrained tasks (the controller passes what its remaining
        steps can train, so no group is generated only to be dropped at the end of a run).
        Call it again whenever a group finishes or a step is trained. A re-run task (resume)
        is stamped no newer than the oldest token of the rollouts it keeps. Liveness: when
        nothing is generating and no batch can form, the next task is admitted even beyond the
        lag bound, with a warning; in a run whose settings never changed the bound always
        admits it, so this only happens after a resume with a new k, L or policy.
        """
        out: list[int] = []
        q = self.queue
        while len(q.admitted) - len(q.finished) < self.max_in_flight:
            if max_untrained is not None and len(q.admitted) >= max_untrained:
                break
            candidate = q.next_to_dispatch()
            if candidate is None:
                break
            version = min(now_version, self.kept_versions.get(candidate, now_version))
            if self.max_off_policy_steps is not None and not admissible(
                q.admitted, candidate, version, self.version, self.batch_size,
                self.policy.window, self.max_off_policy_steps,
            ):
                if out or len(q.admitted) > len(q.finished) or self.next_batch() is not None:
                    break
                log.warning("task %d admitted beyond max_off_policy_steps: nothing else can "
                            "run (scheduler settings changed on resume?)", candidate)
            self.kept_versions.pop(candidate, None)
            out.append(q.dispatch(version))
        return out

    def on_rollout_ended(self, task_index: int, oldest_version: int) -> bool:
        """One rollout of the group ended; returns True when that completes the group."""
        return self.queue.rollout_ended(task_index, oldest_version)

    def on_group_finished(self, task_index: int, min_weight_version: int) -> None:
        """The group is complete (or finalised by timeout); idempotent.

        min_weight_version: the oldest weight_version among the group's tokens.
        """
        self.queue.finish(task_index, min_weight_version)

    def next_batch(self, k: int | None = None) -> list[int] | None:
        """Exactly `batch_size` task indices to train now, or None (wait for more groups).

        A query: nothing changes until `on_trained`. Raises ValueError if k != batch_size.
        """
        if k is not None and k != self.batch_size:
            raise ValueError(f"k ({k}) must equal the scheduler's batch_size ({self.batch_size})")
        q = self.queue
        chosen = self.policy.select(list(q.finished), q.trained_above_head, q.head,
                                    self.batch_size)
        return chosen if len(chosen) == self.batch_size else None

    def on_trained(self, task_indices: list[int], new_version: int) -> None:
        """The step from `self.version` to `new_version` consumed these groups; records lags.

        Raises ValueError (nothing changes) if a group is not finished or already trained.
        """
        oldest = self.queue.train(task_indices)
        self.last_lags = {i: self.version - v for i, v in oldest.items()}
        self.lag_counts.update(self.last_lags.values())
        self.version = new_version

    def metrics(self) -> dict[str, float]:
        """Lag of the last batch (mean, max), lifetime max lag, head, in-flight and ready counts."""
        lags = list(self.last_lags.values()) or [0]
        return {
            "off_policy_lag_mean": sum(lags) / len(lags), "off_policy_lag_max": max(lags),
            "off_policy_lag_max_ever": max(self.lag_counts, default=0),
            "queue_head": self.queue.head, "groups_in_flight": len(self.queue.in_flight()),
            "groups_ready": len(self.queue.finished),
        }

    # ---- persistence and resume ---------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """JSON-serialisable state: policy, limits, version, queue and lag counts."""
        return {
            "policy": self.policy.name, "window": self.policy.window,
            "batch_size": self.batch_size, "max_off_policy_steps": self.max_off_policy_steps,
            "max_in_flight": self.max_in_flight, "version": self.version,
            "queue": self.queue.state(), "lag_counts": sorted(self.lag_counts.items()),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Scheduler:
        """Inverse of `state()`."""
        scheduler = cls(make_policy(state["policy"], state["window"]), state["batch_size"],
                        state["max_off_policy_steps"], state["max_in_flight"],
                        version=state["version"])
        scheduler.queue = GenerationQueue.from_state(state["queue"])
        scheduler.lag_counts = Counter(dict(state["lag_counts"]))
        return scheduler

    def resume(self, pool: Any) -> list[int]:
        """Reconcile the pool with this (restored) state after a crash (CASES.md C12); returns
        the re-queued indices.

        pool: a `SQLitePool`. Afterwards the pool agrees with the state: groups the pool marked
        trained but this state does not (consumed after it was saved) go back to "finished";
        ended rollouts with a token sampled by weights newer than `version` (lost with the
        crash) are discarded and run again; every task that was in flight (the pool's "running"
        tasks and this state's unfinished admitted ones) has its running trajectories aborted
        and is dispatched again, first. Finished-but-untrained groups stay finished and are
        trained next; a task whose kept rollouts are older than the engine is stamped with
        their oldest version when it is (re-)admitted.
        """
        pool.untrain([i for i in pool.task_indices("trained") if not self.queue.is_trained(i)])
        requeued = set(pool.reset_in_flight()) | set(self.queue.in_flight())
        for i in set(pool.task_indices()) - set(pool.task_indices("trained")):
            ended = [t for t in pool.get_group(i).trajectories if t.status in _ENDED_OK]
            stale = {t.id for t in ended
                     if any(v > self.version for c in t.completions for v in c.weight_versions)}
            if stale and i in self.queue.finished:  # a state saved by this loop never has it
                raise ValueError(f"task {i} is finished at version {self.version} but has newer "
                                 "tokens: the data pool belongs to another run")
            pool.discard(sorted(stale), "sampled by weights newer than the restored version "
                                        f"{self.version} (lost in a crash)")
            kept = [v for t in ended if t.id not in stale and t.status == "finished"
                    for c in t.completions for v in c.weight_versions]
            if kept and i not in self.queue.finished:
                self.kept_versions[i] = min(kept)
        for i in sorted(requeued):
            if i in self.queue.admitted and i not in self.queue.finished:
                self.queue.requeue(i)
        return sorted(requeued)
