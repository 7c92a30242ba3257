"""A discrete-event model of the ForgeRL loop, driven by costs measured here (sim_costs.py).

The scenarios and their tables: benchmarks/scale_runs.py (commands in docs/simulation.md).
One heapq event loop, seconds of
simulated time; every component is a queue with the measured service cost:

- controllers: `controllers` FIFO servers (rollout id mod count); `rollout_writes_s` per
  rollout start + end (create and finish the trajectory), `controller_s_per_rollout` more.
- scheduler: the real `forgerl.scheduler.policies.Scheduler` decides (policy, k, L, W,
  max_in_flight); it is one FIFO server charged `scheduler_admit_s + A * per_admitted` per
  admitted group (A: the admitted, untrained groups, over which `admissible` checks the lag).
- gateways: `gateways` FIFO servers, sessions sticky (rollout id mod count); a call costs
  `gateway_cpu_s_per_call`, half before the engine (parse, render) and half after (record,
  answer).
- pool: `pool_shards` group-commit servers (rollout id mod shards): an idle shard commits a
  call at once (`pool_tx_s + pool_call_s`); calls that arrive meanwhile wait and commit
  together in the next transaction (`pool_tx_s + n * pool_call_s`). The answer leaves after
  the commit.
- engines: `engines` instances, a rollout's calls on one (id mod count), up to `max_batch`
  calls decoding, more queue. Aggregated: decoding is processor sharing in continuous time
  (every running call gains one token per decode step of step_s(b) = a + b' * b seconds at
  batch b), not one event per step; a prefill stalls the engine's decoding for
  a + new_tokens / prefill tokens/s.
  `shared_cpu`: the engine's steps take the 1-thread coefficients while the trainer runs
  (one CPU split between them, `forgerl.cpu_share`), else the 2-thread ones.
- trainer: takes `scheduler.next_batch()` when idle; a step is trainer_step_s + tree tokens *
  s_per_token (the shared-CPU one when `shared_cpu` and an engine has calls at its start; tree
  tokens of a group: `group_tree_tokens`, else its prompt once, then every rollout's new prompt
  and completion tokens); then a weight sync of `weight_sync_s` that pauses every engine.
- agents: a rollout is `calls` model calls with environment seconds before each and after the
  last (lognormal around the medians; sigma 0 = fixed). `rollout_timeout_s` (`[rollout]
  timeout_s`): a rollout still running then ends as aborted, its group is finalised without
  it and its tokens are not trained; a call of it already at the engine still decodes.

Not modelled: network latency, the engine's prefix-cache misses beyond `new_prompt_tokens`,
evaluation, checkpoints, failures, the gateway's and agents' share of a small machine's CPU.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forgerl.scheduler.policies import Scheduler, make_policy


@dataclass(frozen=True)
class Costs:
    """Service costs in seconds (sim_costs.py's JSON names them the same)."""

    gateway_cpu_s_per_call: float = 1e-3
    pool_tx_s: float = 2e-3
    pool_call_s: float = 1e-4
    rollout_writes_s: float = 4e-3
    controller_s_per_rollout: float = 0.0
    scheduler_admit_s: float = 1e-5
    scheduler_admit_s_per_admitted: float = 3e-7
    step_a: float = 0.02           # decode step seconds at batch 0, engine alone
    step_b: float = 0.001          # more per running call, engine alone
    shared_step_a: float = 0.03    # the same beside the trainer (shared_cpu)
    shared_step_b: float = 0.0015
    prefill_tokens_per_s: float = 2000.0
    trainer_step_s: float = 1.0
    trainer_s_per_token: float = 1e-3
    trainer_s_per_token_shared: float | None = None  # beside a decoding engine (shared_cpu)
    weight_sync_s: float = 0.2

    @classmethod
    def load(cls, path: Path) -> Costs:
        """From sim_costs.py's JSON (engine coefficients from engine_t2 / engine_t1)."""
        raw = json.loads(path.read_text())
        names = {f for f in cls.__dataclass_fields__ if f in raw}
        return cls(**{f: raw[f] for f in names},
                   step_a=raw["engine_t2"]["step_s"], step_b=raw["engine_t2"]["step_s_per_seq"],
                   shared_step_a=raw["engine_t1"]["step_s"],
                   shared_step_b=raw["engine_t1"]["step_s_per_seq"],
                   prefill_tokens_per_s=raw["engine_prefill_tokens_per_s"])


@dataclass(frozen=True)
class Workload:
    """Rollout shape: medians and lognormal sigmas (0 = every rollout the same)."""

    group_size: int = 8
    calls: float = 1.0
    calls_sigma: float = 0.0
    env_s: float = 1.0              # before each call, and after the last
    env_sigma: float = 0.0
    completion_tokens: float = 16.0
    completion_sigma: float = 0.0
    prompt_tokens: float = 100.0    # the first call's prompt (shared by the group)
    new_prompt_tokens: float = 10.0  # each later call's prompt beyond the last context
    group_tree_tokens: float | None = None  # trained tree tokens per group, if measured


@dataclass(frozen=True)
class Layout:
    """What runs: counts, scheduler settings, speed factors on the measured engine/trainer."""

    engines: int = 1
    max_batch: int = 48
    gateways: int = 1
    pool_shards: int = 1
    controllers: int = 1            # rollout ids split over them (id mod count)
    k: int = 2
    max_off_policy_steps: int | None = 2
    policy: str = "fifo"            # fifo | fffo | windowed_fifo
    window: int = 1
    max_in_flight: int | None = None
    shared_cpu: bool = False
    engine_speed: float = 1.0       # engine throughput / the measured one
    trainer_speed: float = 1.0      # trainer throughput / the measured one
    rollout_timeout_s: float = math.inf


@dataclass
class Server:
    """A FIFO single server: jobs arrive in time order (events pop in order)."""

    free: float = 0.0
    busy: float = 0.0

    def serve(self, now: float, cost: float) -> float:
        """Queue a job of `cost` seconds at `now`; returns when it is done."""
        self.free = max(now, self.free) + cost
        self.busy += cost
        return self.free


@dataclass
class Engine:
    """Processor-sharing decode in virtual tokens (module docstring)."""

    v: float = 0.0                  # tokens every running call has gained so far
    t: float = 0.0
    paused: float = 0.0             # decoding stalls until then (prefill, weight sync)
    running: list = field(default_factory=list)  # heap of (finish v, call id)
    waiting: deque = field(default_factory=deque)
    epoch: int = 0                  # invalidates stale finish events
    busy: float = 0.0


class Sim:
    """The event loop; `run(steps)` returns the metrics dict (see `summary`)."""

    def __init__(self, costs: Costs, work: Workload, layout: Layout, seed: int = 0) -> None:
        self.c, self.w, self.l = costs, work, layout
        self.rng = random.Random(seed)
        self.sched = Scheduler(make_policy(layout.policy, layout.window), layout.k,
                               layout.max_off_policy_steps, layout.max_in_flight,
                               group_size=work.group_size)
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.controllers = [Server() for _ in range(layout.controllers)]
        self.scheduler_cpu = Server()
        self.gateways = [Server() for _ in range(layout.gateways)]
        self.shards = [{"busy": False, "batch": [], "waiting": [], "n": 0}
                       for _ in range(layout.pool_shards)]
        self.pool_busy = [0.0] * layout.pool_shards
        self.engines = [Engine() for _ in range(layout.engines)]
        self.rollouts: dict[int, dict] = {}
        self.calls: dict[int, tuple] = {}
        self.group_tokens: dict[int, float] = {}
        self.version, self.training, self.train_busy = 0, False, 0.0
        self.step_times: list[float] = []
        self.train_costs: list[float] = []
        self.lags: list[int] = []
        self.n_calls = self.n_rollouts = self.n_timed_out = 0
        self.ids = 0

    # ---- plumbing ---------------------------------------------------------------------------

    def at(self, t: float, kind: str, *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, args))

    def draw(self, median: float, sigma: float) -> float:
        return median * math.exp(self.rng.gauss(0, sigma)) if sigma else median

    # ---- scheduler and controller -----------------------------------------------------------

    def admit(self) -> None:
        """The real scheduler admits; each lag check (one per admitted group, one more that
        stops the admission) costs a + b * A on the scheduler's server."""
        tasks = self.sched.admit(self.version)
        per_check = (self.c.scheduler_admit_s
                     + self.c.scheduler_admit_s_per_admitted * len(self.sched.queue.admitted))
        done = self.scheduler_cpu.serve(self.now, per_check * (len(tasks) + 1))
        for task in tasks:
            self.group_tokens[task] = self.w.prompt_tokens
            for r in range(self.w.group_size):
                self.at(done, "rollout_start", task, r)

    def rollout_start(self, task: int, r: int) -> None:
        rid, self.ids = self.ids, self.ids + 1
        calls = max(1, round(self.draw(self.w.calls, self.w.calls_sigma)))
        self.rollouts[rid] = {"task": task, "left": calls, "version": self.version, "tokens": 0}
        if self.l.rollout_timeout_s < math.inf:
            self.at(self.now + self.l.rollout_timeout_s, "timeout", rid)
        done = self.controllers[rid % len(self.controllers)].serve(
            self.now, self.c.rollout_writes_s / 2 + self.c.controller_s_per_rollout / 2)
        self.at(done + self.draw(self.w.env_s, self.w.env_sigma), "call", rid)

    def timeout(self, rid: int) -> None:
        if (ro := self.rollouts.get(rid)) is not None:
            self.n_timed_out += 1
            self.group_tokens[ro["task"]] -= ro["tokens"]
            self.rollout_end(rid)

    def rollout_end(self, rid: int) -> None:
        if (ro := self.rollouts.pop(rid, None)) is None:  # it timed out before
            return
        self.n_rollouts += 1
        done = self.controllers[rid % len(self.controllers)].serve(
            self.now, self.c.rollout_writes_s / 2 + self.c.controller_s_per_rollout / 2)
        self.at(done, "ended", ro["task"], ro["version"])

    def ended(self, task: int, version: int) -> None:
        if self.sched.on_rollout_ended(task, version):
            self.admit()
            self.try_train()

    # ---- calls: gateway → engine → gateway → pool → agent -----------------------------------

    def call(self, rid: int) -> None:
        if (ro := self.rollouts.get(rid)) is None:  # it timed out
            return
        first = ro.get("calls", 0) == 0
        ro["calls"] = ro.get("calls", 0) + 1
        tokens = max(1, round(self.draw(self.w.completion_tokens, self.w.completion_sigma)))
        new = self.w.new_prompt_tokens  # the engine's prefix cache holds the rest
        added = tokens + (0 if first else new)
        self.group_tokens[ro["task"]] += added
        ro["tokens"] += added
        cid, self.ids = self.ids, self.ids + 1
        self.calls[cid] = (rid, tokens, new)
        g = self.gateways[rid % len(self.gateways)]
        self.at(g.serve(self.now, self.c.gateway_cpu_s_per_call / 2), "engine_in", cid)

    def step_s(self, e: Engine) -> float:
        a, b = ((self.c.shared_step_a, self.c.shared_step_b)
                if self.l.shared_cpu and self.training else (self.c.step_a, self.c.step_b))
        return max(1e-12, (a + b * len(e.running)) / self.l.engine_speed)  # 0: instant

    def advance(self, e: Engine) -> None:
        start = max(e.t, e.paused)
        if e.running and self.now > start:
            e.v += (self.now - start) / self.step_s(e)
            e.busy += self.now - start
        e.t = self.now

    def reschedule(self, i: int) -> None:
        e = self.engines[i]
        e.epoch += 1
        if e.running:
            t = max(self.now, e.paused) + (e.running[0][0] - e.v) * self.step_s(e)
            self.at(t, "engine_out", i, e.epoch)

    def engine_in(self, cid: int) -> None:
        i = self.calls[cid][0] % len(self.engines)  # session affinity (prefix cache)
        e = self.engines[i]
        self.advance(e)
        e.waiting.append(cid)
        self.fill(i)

    def fill(self, i: int) -> None:
        e = self.engines[i]
        while e.waiting and len(e.running) < self.l.max_batch:
            cid = e.waiting.popleft()
            _, tokens, new = self.calls[cid]
            prefill = (self.c.step_a + new / self.c.prefill_tokens_per_s) / self.l.engine_speed
            e.paused = max(self.now, e.paused) + prefill
            e.busy += prefill
            heapq.heappush(e.running, (e.v + tokens, cid))
        self.reschedule(i)

    def engine_out(self, i: int, epoch: int) -> None:
        e = self.engines[i]
        if epoch != e.epoch:
            return
        self.advance(e)
        while e.running and (e.running[0][0] - e.v) * self.step_s(e) <= 1e-9:  # float error
            _, cid = heapq.heappop(e.running)
            rid = self.calls[cid][0]
            g = self.gateways[rid % len(self.gateways)]
            self.at(g.serve(self.now, self.c.gateway_cpu_s_per_call / 2), "pool_in", cid)
        self.fill(i)

    def pool_in(self, cid: int) -> None:
        s = self.calls[cid][0] % len(self.shards)
        shard = self.shards[s]
        if shard["busy"]:
            shard["waiting"].append(cid)
        else:
            self.commit(s, [cid])

    def commit(self, s: int, batch: list[int]) -> None:
        cost = self.c.pool_tx_s + self.c.pool_call_s * len(batch)
        self.shards[s] |= {"busy": True, "batch": batch, "waiting": []}
        self.pool_busy[s] += cost
        self.at(self.now + cost, "committed", s)

    def committed(self, s: int) -> None:
        shard = self.shards[s]
        for cid in shard["batch"]:
            rid, _, _ = self.calls.pop(cid)
            self.n_calls += 1
            if (ro := self.rollouts.get(rid)) is None:  # it timed out
                continue
            ro["left"] -= 1
            wait = self.draw(self.w.env_s, self.w.env_sigma)
            self.at(self.now + wait, "call" if ro["left"] else "rollout_end", rid)
        shard["busy"] = False
        if shard["waiting"]:
            self.commit(s, shard["waiting"])

    # ---- trainer ----------------------------------------------------------------------------

    def try_train(self) -> None:
        if self.training or (batch := self.sched.next_batch()) is None:
            return
        for e in self.engines:
            self.advance(e)
        self.training = True
        tokens = sum(self.group_tokens.pop(t) for t in batch)
        if self.w.group_tree_tokens is not None:
            tokens = self.w.group_tree_tokens * len(batch)
        per_token = self.c.trainer_s_per_token
        if self.l.shared_cpu and any(e.running or e.waiting for e in self.engines):
            per_token = self.c.trainer_s_per_token_shared or per_token
        cost = (self.c.trainer_step_s + tokens * per_token) / self.l.trainer_speed
        self.train_busy += cost
        self.train_costs.append(cost)
        for i in range(len(self.engines)):
            self.reschedule(i)
        self.at(self.now + cost, "trained", batch)

    def trained(self, batch: list[int]) -> None:
        for e in self.engines:
            self.advance(e)
            e.paused = max(self.now, e.paused) + self.c.weight_sync_s
        self.training = False
        self.version += 1
        self.sched.on_trained(batch, self.version)
        self.lags.extend(self.sched.last_lags.values())
        self.step_times.append(self.now + self.c.weight_sync_s)
        for i in range(len(self.engines)):
            self.reschedule(i)
        self.at(self.now + self.c.weight_sync_s, "synced")

    def synced(self) -> None:
        self.admit()
        self.try_train()

    # ---- run --------------------------------------------------------------------------------

    def run(self, steps: int, max_seconds: float = math.inf) -> dict[str, float]:
        """Simulate until `steps` optimizer steps (or `max_seconds` simulated); metrics."""
        self.admit()
        while self.events and len(self.step_times) < steps:
            t, _, kind, args = heapq.heappop(self.events)
            if t > max_seconds:
                break
            self.now = t
            getattr(self, kind)(*args)
        return self.summary()

    def summary(self) -> dict[str, float]:
        """Steady-state step seconds (mean over the second half of the steps) and the trainer's
        busy fraction over them, the first step's end (seconds from the start, weight sync
        included), busy fractions of every component over the whole run, calls/s, rollouts/s,
        the fraction of ended rollouts that timed out, and off-policy lag."""
        t = self.now or 1.0
        n = len(self.step_times) // 2
        half = self.step_times[n:]
        step_s = ((half[-1] - half[0]) / (len(half) - 1) if len(half) > 1
                  else (self.step_times[0] if self.step_times else math.nan))
        steady_busy = (sum(self.train_costs[n + 1:len(self.step_times)]) / (half[-1] - half[0])
                       if len(half) > 1 else math.nan)
        return {
            "steps": len(self.step_times), "seconds": t, "step_s": step_s,
            "first_step_s": self.step_times[0] if self.step_times else math.nan,
            "trainer_busy": self.train_busy / t, "trainer_busy_steady": steady_busy,
            "calls_per_s": self.n_calls / t,
            "rollouts_per_s": self.n_rollouts / t,
            "timed_out": self.n_timed_out / max(self.n_rollouts, 1),
            "controller_busy": max(c.busy for c in self.controllers) / t,
            "scheduler_busy": self.scheduler_cpu.busy / t,
            "gateway_busy_max": max(g.busy for g in self.gateways) / t,
            "pool_busy_max": max(self.pool_busy) / t,
            "engine_busy_mean": sum(e.busy for e in self.engines) / len(self.engines) / t,
            "lag_mean": sum(self.lags) / len(self.lags) if self.lags else 0.0,
            "lag_max": max(self.lags, default=0),
        }


def simulate(costs: Costs, work: Workload, layout: Layout, steps: int,
             max_seconds: float = math.inf, seed: int = 0) -> dict[str, float]:
    """One run of the model; see `Sim.summary` for the metrics."""
    return Sim(costs, work, layout, seed).run(steps, max_seconds)


