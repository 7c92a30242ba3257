"""Scheduling policies on a fake clock: throughput, trainer idle time, off-policy lag, bias.

Part 1 of issue 4 (Forge §3.1): a deterministic discrete-event simulation, no model. K rollout
slots run the G rollouts of admitted tasks; a rollout occupies a slot for its task's duration
(heavy-tailed); the trainer takes `scheduler.next_batch()` and spends `train_time` per step, then
the engines get the new weight_version at once. `max_in_flight` = K / G groups generate at once
(a finished group frees its slots even while it waits for the trainer). Each policy runs the same
task streams (5 seeds).

Columns: throughput = trained groups per unit time (and its ratio to FFFO); idle = fraction of time
the trainer waited for groups; lag mean/max = off-policy lag of trained groups (steps);
bias = mean duration of the first M trained tasks / mean duration of the first M admitted tasks
(1.00 = unbiased; < 1 = short tasks trained first), mean and min over seeds.

Run: `python benchmarks/scheduling.py` (about 10 s). `simulate` is reused by the C10 test.

Part 2 (`--real`): the same policies on the real asynchronous loop (`forgerl.controller.run`):
tiny model, gateway over HTTP, SQLite pool, CISPO trainer. The agent is a black-box-style async
callable: one or two chat calls through the gateway with the official `openai` client, and "tool
calls" that sleep for a heavy-tailed, seeded time per task (lognormal with median 0.3 s, or 90 %
U(0.15, 0.45) s and 10 % of tasks 20x that; times `--tool-scale`, default 10, so that tool time
dominates the engine's latency). It answers right on a seeded half of the rollouts, so group
advantages are non-zero. Every number comes from RUN_DIR/metrics.jsonl of the run, except
bias*, which is the part-1 bias on the planned tool seconds of the tasks the pool shows trained
vs the same number of tasks in admission order. `--real`: both workloads, about 15 minutes;
`--quick`: the 10 % x20 workload only.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import re
import sqlite3
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    name: str, durations: Callable[[int], Callable[[int], float]], *, seeds: int = 5,
    slots: int = 32, group_size: int = 4, batch_size: int = 4, train_time: float = 1.0,
    steps: int = 400, lag_bound: int = 8, bias_m: int = 200,
    windows: tuple[int, ...] = (8, 16, 24),
) -> list[dict[str, object]]:
    """Run every policy on one duration model, `seeds` task streams each; one row per policy.

    durations(seed) → duration(task_index). `max_in_flight` = slots // group_size (the groups
    the engines can run at once); finished groups wait outside that cap. Rows: each policy
    unbounded and with L = lag_bound, plus synchronous training (fifo, L = 0). Every column is
    the mean over seeds except lag max (max) and bias min (min); vs fffo is the mean of per-seed
    ratios to FFFO under the same bound (the synchronous row: to unbounded FFFO).
    """
    configs: list[tuple[str, Policy, int | None]] = [("sync (fifo L=0)", Fifo(), 0)]
    for lag in (None, lag_bound):
        suffix = "" if lag is None else f" L={lag}"
        configs += [("fffo" + suffix, Fffo(), lag), ("fifo" + suffix, Fifo(), lag)]
        configs += [(f"windowed W={w}{suffix}", WindowedFifo(w), lag) for w in windows]
    runs: dict[str, list[dict[str, float]]] = {}
    for seed in range(seeds):
        duration = durations(seed)
        for label, policy, lag in configs:
            sched = Scheduler(policy, batch_size, lag, max_in_flight=slots // group_size,
                              group_size=group_size)
            res = simulate(sched, duration, slots, train_time, steps)
            lags = list(res.lags.values())
            runs.setdefault(label, []).append({
                "throughput": len(res.trained) / res.end_time,
                "idle": res.idle_time / res.end_time,
                "lag_mean": sum(lags) / len(lags), "lag_max": max(lags),
                "bias": duration_bias(res, duration, min(bias_m, len(res.trained))),
            })
    rows = []
    for label, _, lag in configs:
        per_seed = runs[label]
        base = runs[f"fffo L={lag}" if lag else "fffo"]  # sync: vs unbounded FFFO
        mean = lambda key: sum(r[key] for r in per_seed) / seeds  # noqa: E731,B023
        rows.append({
            "workload": name, "policy": label, "bound": lag,
            **{key: mean(key) for key in ("throughput", "idle", "lag_mean", "bias")},
            "lag_max": max(r["lag_max"] for r in per_seed),
            "bias_min": min(r["bias"] for r in per_seed),
            "vs_fffo": sum(r["throughput"] / b["throughput"]
                           for r, b in zip(per_seed, base, strict=True)) / seeds,
        })
    return rows


def print_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """Print `rows` under a header and a rule; columns are (title, row key, format spec), where
    the spec starts with its alignment and width (e.g. ">8.3f", "<15")."""
    header = " ".join(f"{title:{re.match(r'[<>][0-9]+', spec)[0]}}" for title, _, spec in columns)
    print(header)
    print("-" * len(header))
    for r in rows:
        print(" ".join(f"{r[key]:{spec}}" for _, key, spec in columns))


def print_simulation() -> None:
    """Part 1: print the fake-clock table for both workloads."""
    rows = run_table("lognormal(0,1)", lognormal_durations)
    rows += run_table("10% x20 slow", mixed_durations)
    print_table(rows, [("workload", "workload", "<15"), ("policy", "policy", "<22"),
                       ("groups/t", "throughput", ">8.3f"), ("vs fffo", "vs_fffo", ">7.2f"),
                       ("idle", "idle", ">6.1%"), ("lag mean", "lag_mean", ">8.2f"),
                       ("lag max", "lag_max", ">7d"), ("bias", "bias", ">6.3f"),
                       ("bias min", "bias_min", ">8.3f")])


# ---- part 2: the real loop ------------------------------------------------------------------


ToolSeconds = Callable[[str], float]
"""question → planned tool seconds of one rollout of that task (before per-rollout jitter)."""


def lognormal_tool_seconds(seed: int, median: float = 0.3, sigma: float = 1.0) -> ToolSeconds:
    """Per-task tool time median * exp(N(0, sigma²)) seconds, fixed per question and seed."""
    return lambda q: median * random.Random(f"{seed}|{q}").lognormvariate(0.0, sigma)


def mixed_tool_seconds(
    seed: int, low: float = 0.15, high: float = 0.45, slow_fraction: float = 0.1,
    slowdown: float = 20.0,
) -> ToolSeconds:
    """Per-task tool time U(low, high) seconds; `slow_fraction` of tasks take `slowdown`x that."""

    def seconds(q: str) -> float:
        rng = random.Random(f"{seed}|{q}")
        base = rng.uniform(low, high)
        return base * (slowdown if rng.random() < slow_fraction else 1.0)

    return seconds


def chain_sum_answer(question: str) -> str:
    """The exact answer of a reasoning-gym chain_sum question ("... problem: 4 - 1 =").

    Raises ValueError if the text after the last ':' is not digits joined by + and -.
    """
    expr = question.rsplit(":", 1)[1].replace("=", "").replace(" ", "")
    if not re.fullmatch(r"[-+]?\d+([-+]\d+)*", expr):
        raise ValueError(f"not a chain_sum expression: {expr!r}")
    return str(sum(int(term) for term in re.findall(r"[-+]?\d+", expr)))


def make_tool_agent(tool_seconds: ToolSeconds, seed: int, correct: float = 0.5,
                    two_turns: float = 0.25, max_tokens: int = 4):
    """A black-box-style agent: chat → tool sleep (→ chat → tool sleep) → answer.

    Per rollout (seeded by question and the n-th rollout of that question): two chat turns with
    probability `two_turns`; total sleep = tool_seconds(question) * U(0.8, 1.2), split over the tool
    calls; the right answer with probability `correct`, else "wrong".
    """
    from openai import AsyncOpenAI

    seen: Counter[str] = Counter()

    async def agent(task: dict, base_url: str, api_key: str) -> str:
        question = task["question"]
        rng = random.Random(f"{seed}|{question}|{seen[question]}")
        seen[question] += 1  # before any await: rollouts of a group count in start order
        turns = 2 if rng.random() < two_turns else 1
        sleep = tool_seconds(question) * rng.uniform(0.8, 1.2) / turns
        answer = chain_sum_answer(question) if rng.random() < correct else "wrong"
        messages: list[dict[str, str]] = [{"role": "user", "content": question}]
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            for turn in range(turns):
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=max_tokens,  # type: ignore
                )
                await asyncio.sleep(sleep)  # the "tool call"
                content = reply.choices[0].message.content or ""
                messages += [{"role": "assistant", "content": content},
                             {"role": "user", "content": f"tool result {turn}: ok"}]
        return answer

    return agent


def real_config(run_dir: Path, policy: str, window: int | None, steps: int, lag_bound: int,
                in_flight: int, group_size: int, batch_size: int, seed: int, max_tokens: int = 4):
    """A tiny-model run config for one policy ("fifo" | "fffo" | "windowed_fifo" with window)."""
    from forgerl.config import load_config

    table = f'{{type = "{policy}"}}' if window is None else \
        f'{{type = "{policy}", window = {window}}}'
    return load_config(None, [
        "--run_dir", str(run_dir), "--seed", str(seed), "--max_steps", str(steps),
        "--model.path", "tiny", "--model.max_model_len", "512",
        "--rollout.group_size", str(group_size), "--rollout.tasks_per_step", str(batch_size),
        "--rollout.max_tokens", str(max_tokens), "--rollout.timeout_s", "120",
        "--tasks.params", "{min_terms = 2, max_terms = 2, max_digits = 1}",
        "--tasks.size", "512", "--tasks.seed", str(seed), "--tasks.eval_size", "0",
        "--trainer.lr", "1e-3", "--trainer.checkpoint_every", "1000000",
        "--scheduler.policy", table, "--scheduler.max_off_policy_steps", str(lag_bound),
        "--scheduler.max_in_flight", str(in_flight),
    ])


def true_bias(run_dir: Path, tool_seconds: ToolSeconds) -> float:
    """Planned tool seconds: mean over the trained tasks / mean over as many tasks in admission
    (index) order, from RUN_DIR/pool.sqlite (the part-1 bias on the real run)."""
    db = sqlite3.connect(run_dir / "pool.sqlite")
    try:
        rows = db.execute("SELECT task_index, payload, status FROM tasks "
                          "ORDER BY task_index").fetchall()
    finally:
        db.close()
    questions = [json.loads(payload)["question"] for _, payload, _ in rows]
    trained = [q for q, (_, _, status) in zip(questions, rows, strict=True) if status == "trained"]
    if not trained:
        return float("nan")
    mean = lambda qs: sum(tool_seconds(q) for q in qs) / len(qs)  # noqa: E731
    return mean(trained) / mean(questions[:len(trained)])


def summarize_run(run_dir: Path, batch_size: int) -> dict[str, float]:
    """Table columns from RUN_DIR/metrics.jsonl (forgerl.metrics.read_metrics) of one run.

    s_per_step = mean step_seconds (wall clock); throughput = trained groups / Σ step_seconds;
    idle = mean trainer_idle_fraction; lag = scheduler off-policy lag of trained groups (mean of
    per-step means, max of maxima); dur_trained / dur_admitted = the last step's
    rollout_seconds_trained_mean / rollout_seconds_admitted_mean (both cumulative: every trained
    task vs as many tasks in admission order, running rollouts at their elapsed time).
    """
    from forgerl.metrics import read_metrics

    steps = [r for r in read_metrics(run_dir) if "reward_mean" in r]
    if not steps:
        raise RuntimeError(f"{run_dir}: no training step in metrics.jsonl")
    mean = lambda key: sum(r[key] for r in steps) / len(steps)  # noqa: E731
    wall = sum(r["step_seconds"] for r in steps)
    trained = steps[-1]["rollout_seconds_trained_mean"]
    admitted = steps[-1]["rollout_seconds_admitted_mean"]
    return {
        "steps": len(steps), "s_per_step": wall / len(steps),
        "throughput": len(steps) * batch_size / wall, "idle": mean("trainer_idle_fraction"),
        "lag_mean": mean("scheduler_off_policy_lag_mean"),
        "lag_max": max(r["scheduler_off_policy_lag_max"] for r in steps),
        "dur_trained": trained, "dur_admitted": admitted, "bias": trained / admitted,
    }


def real_table(
    name: str, tool_seconds: ToolSeconds, *, steps: int, windows: tuple[int, ...],
    lag_bound: int, in_flight: int, group_size: int = 4, batch_size: int = 2, seed: int = 0,
) -> list[dict[str, Any]]:
    """Run fffo, fifo and windowed_fifo(W) for each W on the real loop; one row per policy."""
    from forgerl.controller import run

    policies: list[tuple[str, str, int | None]] = [("fffo", "fffo", None), ("fifo", "fifo", None)]
    policies += [(f"windowed W={w}", "windowed_fifo", w) for w in windows]
    rows: list[dict[str, Any]] = []
    for label, policy, window in policies:
        with tempfile.TemporaryDirectory(prefix=f"forgerl-sched-{policy}-") as tmp:
            run_dir = Path(tmp) / "run"
            config = real_config(run_dir, policy, window, steps, lag_bound, in_flight,
                                 group_size, batch_size, seed)
            start = time.time()
            asyncio.run(run(config, agent=make_tool_agent(tool_seconds, seed), progress=False))
            row = {"workload": name, "policy": label, "total_s": time.time() - start,
                   **summarize_run(run_dir, batch_size),
                   "bias_true": true_bias(run_dir, tool_seconds)}
        rows.append(row)
    base = rows[0]["throughput"]
    for row in rows:
        row["vs_fffo"] = row["throughput"] / base
    return rows


def print_real(rows: list[dict[str, Any]], lag_bound: int, in_flight: int,
               tool_scale: float) -> None:
    """Print the part-2 table (one line per workload x policy)."""
    print(f"real loop: tiny model, G=4, k=2 groups/step, max_off_policy_steps={lag_bound}, "
          f"max_in_flight={in_flight} groups generating, tool seconds x{tool_scale:g}")
    print_table(rows, [("workload", "workload", "<16"), ("policy", "policy", "<14"),
                       ("s/step", "s_per_step", ">6.2f"), ("groups/s", "throughput", ">8.3f"),
                       ("vs fffo", "vs_fffo", ">7.2f"), ("idle", "idle", ">6.1%"),
                       ("lag mean", "lag_mean", ">8.2f"), ("lag max", "lag_max", ">7d"),
                       ("dur trn", "dur_trained", ">7.2f"), ("dur adm", "dur_admitted", ">7.2f"),
                       ("bias", "bias", ">5.2f"), ("bias*", "bias_true", ">5.2f"),
                       ("run s", "total_s", ">6.1f")])
    print("s/step: wall clock per optimizer step; idle: mean trainer_idle_fraction; lag: "
          "scheduler off-policy lag (steps);\ndur trn/adm: mean rollout seconds of the trained "
          "tasks / of as many in admission order; bias = trn/adm;\nbias*: planned tool "
          "seconds of trained tasks / of as many tasks in admission order (part-1 definition).")


def main(argv: list[str] | None = None) -> None:
    """Part 1 (default) or part 2 (`--real`, `--quick`)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--real", action="store_true", help="run the real loop (tiny model)")
    parser.add_argument("--quick", action="store_true", help="with --real: the 10%% x20 mix only")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per policy")
    parser.add_argument("--lag", type=int, default=4, help="max_off_policy_steps")
    parser.add_argument("--in-flight", type=int, default=4, help="max_in_flight (groups)")
    parser.add_argument("--tool-scale", type=float, default=10.0,
                        help="multiplies every planned tool time (1: median 0.3 s)")
    args = parser.parse_args(argv)
    if not args.real:
        print_simulation()
        return
    scale = args.tool_scale
    workloads = [("10% x20 slow", mixed_tool_seconds(1))]
    if not args.quick:
        workloads.insert(0, ("lognormal", lognormal_tool_seconds(0)))
    rows = [row for name, fn in workloads
            for row in real_table(name, lambda q, fn=fn: scale * fn(q), steps=args.steps,
                                  windows=(2, 4), lag_bound=args.lag, in_flight=args.in_flight)]
    print_real(rows, args.lag, args.in_flight, scale)


if __name__ == "__main__":
    main()
