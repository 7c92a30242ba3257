"""Scheduling policies on a fake clock: throughput, trainer idle time, off-policy lag, bias.

Part 1 of issue 4 (Forge §3.1): a deterministic discrete-event simulation, no model. K rollout
slots run the G rollouts of admitted tasks; a rollout occupies a slot for its task's duration
(heavy-tailed); the trainer takes `scheduler.next_batch()` and spends `train_time` per step, then
the engines get the new weight_version at once. Each policy runs the same task stream.

Columns: throughput = trained groups per unit time (and its ratio to FFFO); idle = fraction of time
the trainer waited for groups; lag mean/max = off-policy lag of trained groups (steps);
bias = mean duration of the first M trained tasks / mean duration of the first M admitted tasks
(1.00 = unbiased; < 1 = short tasks trained first).

Run: `python benchmarks/scheduling.py` (a few seconds). `simulate` is reused by the C10 test.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from forgerl.scheduler.policies import Fffo, Fifo, Policy, Scheduler, WindowedFifo


@dataclass
class SimResult:
    """What one simulated run produced (times in fake-clock units)."""

    batches: list[list[int]] = field(default_factory=list)
    """Trained task indices per step, in step order."""
    trained_at: list[float] = field(default_factory=list)
    """Fake-clock time at which each step ended."""
    admitted: list[int] = field(default_factory=list)
    """Task indices in dispatch order (re-dispatches excluded)."""
    finished_at: dict[int, float] = field(default_factory=dict)
    lags: dict[int, int] = field(default_factory=dict)
    """Task index → off-policy lag when trained."""
    end_time: float = 0.0
    idle_time: float = 0.0
    max_in_flight_seen: int = 0

    @property
    def trained(self) -> list[int]:
        return [i for batch in self.batches for i in batch]


def simulate(
    scheduler: Scheduler, duration: Callable[[int], float], slots: int, train_time: float,
    steps: int,
) -> SimResult:
    """Run `steps` optimizer steps on a fake clock; returns the trace.

    duration(task_index): seconds each of the task's G rollouts takes. Raises RuntimeError if
    the scheduler stalls (nothing running, nothing to train).
    """
    res = SimResult()
    g = scheduler.queue.group_size
    waiting: deque[int] = deque()  # task index per rollout not yet started
    events: list[tuple[float, int, str, object]] = []  # (time, seq, kind, payload)
    now, seq, free, training = 0.0, 0, slots, False
    while len(res.batches) < steps:
        for i in scheduler.admit(scheduler.version):
            res.admitted.append(i)
            waiting.extend([i] * g)
        res.max_in_flight_seen = max(res.max_in_flight_seen, len(scheduler.queue.in_flight()))
        while free and waiting:
            i = waiting.popleft()
            free -= 1
            seq += 1
            heapq.heappush(events, (now + duration(i), seq, "rollout", (i, scheduler.version)))
        if not training and (batch := scheduler.next_batch()) is not None:
            training = True
            seq += 1
            heapq.heappush(events, (now + train_time, seq, "train", batch))
        if not events:
            raise RuntimeError(f"stalled at t={now} after {len(res.batches)} steps")
        t, _, kind, payload = heapq.heappop(events)
        if not training:
            res.idle_time += t - now
        now = t
        if kind == "rollout":
            free += 1
            i, version = payload  # type: ignore[misc]
            if scheduler.on_rollout_ended(i, version):
                res.finished_at[i] = now
        else:
            training = False
            batch = list(payload)  # type: ignore[call-overload]
            scheduler.on_trained(batch, scheduler.version + 1)
            res.lags.update(scheduler.last_lags)
            res.batches.append(batch)
            res.trained_at.append(now)
    res.end_time = now
    return res


def duration_bias(res: SimResult, duration: Callable[[int], float], m: int) -> float:
    """mean duration of the first m trained tasks / mean duration of the first m admitted."""
    trained, admitted = res.trained[:m], res.admitted[:m]
    mean = lambda xs: sum(duration(i) for i in xs) / len(xs)  # noqa: E731
    return mean(trained) / mean(admitted)


def lognormal_durations(seed: int, sigma: float = 1.0) -> Callable[[int], float]:
    """Per-task duration exp(N(0, sigma²)) (heavy tail), fixed per task index."""
    rng = random.Random(seed)
    cache: dict[int, float] = {}

    def duration(i: int) -> float:
        while len(cache) <= i:
            cache[len(cache)] = rng.lognormvariate(0.0, sigma)
        return cache[i]

    return duration


def mixed_durations(seed: int, slow_fraction: float = 0.1, slowdown: float = 20.0):
    """90 % of tasks take U(0.5, 1.5); 10 % take 20x that."""
    rng = random.Random(seed)
    cache: dict[int, float] = {}

    def duration(i: int) -> float:
        while len(cache) <= i:
            base = rng.uniform(0.5, 1.5)
            cache[len(cache)] = base * (slowdown if rng.random() < slow_fraction else 1.0)
        return cache[i]

    return duration


def run_table(
    name: str, duration: Callable[[int], float], *, slots: int = 32, group_size: int = 4,
    batch_size: int = 4, train_time: float = 1.0, steps: int = 400, lag_bound: int = 8,
    max_in_flight: int = 32, bias_m: int = 200, windows: tuple[int, ...] = (8, 16, 24),
) -> list[dict[str, object]]:
    """Run every policy on one duration model; returns one row per policy."""
    configs: list[tuple[str, Policy, int | None]] = []
    for lag in (None, lag_bound):
        suffix = "" if lag is None else f" L={lag}"
        configs += [("fffo" + suffix, Fffo(), lag), ("fifo" + suffix, Fifo(), lag)]
        configs += [(f"windowed W={w}{suffix}", WindowedFifo(w), lag) for w in windows]
    rows = []
    for label, policy, lag in configs:
        sched = Scheduler(policy, batch_size, lag, max_in_flight=max_in_flight,
                          group_size=group_size)
        res = simulate(sched, duration, slots, train_time, steps)
        lags = list(res.lags.values())
        rows.append({
            "workload": name, "policy": label, "bound": lag,
            "throughput": len(res.trained) / res.end_time,
            "idle": res.idle_time / res.end_time,
            "lag_mean": sum(lags) / len(lags), "lag_max": max(lags),
            "bias": duration_bias(res, duration, min(bias_m, len(res.trained))),
        })
    for row in rows:  # ratio to FFFO under the same lag bound
        base = next(r for r in rows if r["policy"].startswith("fffo")
                    and r["bound"] == row["bound"])
        row["vs_fffo"] = row["throughput"] / base["throughput"]  # type: ignore[operator]
    return rows


def main() -> None:
    """Print the table for both workloads."""
    rows = run_table("lognormal(0,1)", lognormal_durations(0))
    rows += run_table("10% x20 slow", mixed_durations(1))
    header = (f"{'workload':<15} {'policy':<22} {'groups/t':>8} {'vs fffo':>7} {'idle':>6} "
              f"{'lag mean':>8} {'lag max':>7} {'bias':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['workload']:<15} {r['policy']:<22} {r['throughput']:>8.3f} "
              f"{r['vs_fffo']:>7.2f} {r['idle']:>6.1%} {r['lag_mean']:>8.2f} "
              f"{r['lag_max']:>7d} {r['bias']:>6.3f}")


if __name__ == "__main__":
    main()
