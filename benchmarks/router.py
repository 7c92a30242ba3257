"""Router policies on multi-turn agent traffic: prefix-cache hit rate, latency, throughput.

Issue 12 (Forge §3.3). Part 1 measures a real LocalEngine (tiny model, one thread) in this run:
prefill tokens/s (a 512-token prompt, cache off) and the decode step time at batch 1 and 8
(fitted as t_step(B) = a + b·B). Part 2 is a discrete-event simulation with those costs: N
instances (2-64), each a continuous-batching engine like LocalEngine (max_batch_size 16, FIFO
queue beyond it, a step = one decode token per running row + the prefill of the rows admitted
at it, LRU prefix cache of 8192 tokens in BLOCK-token blocks: the config default). Routing is
`forgerl.gateway.router.RouterState`, the router's own code, on the simulation's clock: it
estimates cached prefixes and measures token rates exactly as `Router` does.

Traffic: groups of G = 8 agent sessions arrive as a Poisson process sized to 60 % of the fleet's
batch-16 decode capacity; every prompt starts with one 256-token system prompt, then the task's
own 64-192 tokens; each turn's completion (lognormal, median 32 tokens) and a 16-48-token tool
result extend the next turn's prompt, after a tool time (exponential, mean 30 decode steps);
4-6 turns. Skewed load: 20 % of tasks are heavy, 4x longer completions and 8 turns.

Columns: hit = prompt tokens served from an instance's prefix cache / all prompt tokens;
achievable = the hits of one unbounded cache that saw every earlier request (no routing loss,
no eviction); of achv = hit / achievable; p50 / p99 = request latency (arrival → last token,
seconds); tok/s = completion tokens / makespan; ratios vs round robin. Part 3 (`--real`, about
a minute): the same traffic, scaled down, through a real `Router` over 2 LocalEngines.

Run: `.venv/bin/python benchmarks/router.py [--instances 2 4 8 16 32 64] [--groups-per-instance
3] [--real]`.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from forgerl.engines.local import LocalEngine
from forgerl.gateway.router import (
    BLOCK,
    POLICIES,
    Flight,
    PrefixIndex,
    Router,
    RouterState,
    block_hashes,
)
from forgerl.models import build_tiny_model
from forgerl.types import SamplingParams

G, SYSTEM, MAX_BATCH, CACHE_TOKENS = 8, 256, 16, 8192
NAMES = ("round_robin", "affinity", "cost_aware")


@dataclass
class Costs:
    """Measured engine costs: prefill_tok_s (tokens/s), t_step(B) = a + b·B seconds."""

    prefill_tok_s: float
    a: float
    b: float

    def step(self, batch: int) -> float:
        return self.a + self.b * batch


def measure_costs() -> Costs:
    """Time a real LocalEngine on the tiny model (cache off): prefill and decode steps."""
    model = build_tiny_model()

    async def main() -> Costs:
        engine = LocalEngine(model, max_model_len=1024, max_batch_size=16, prefix_cache_tokens=0)
        prompt = [random.Random(0).randrange(3, 250) for _ in range(512)]
        one = SamplingParams(0.0, max_tokens=1)
        await engine.generate(prompt[:32], one)  # warm-up
        pf = []
        for _ in range(5):
            t0 = time.perf_counter()
            await engine.generate(prompt, one)
            pf.append(time.perf_counter() - t0)
        steps = {}
        for b in (1, 8):
            params = SamplingParams(0.0, max_tokens=64)
            t0 = time.perf_counter()
            await asyncio.gather(*(engine.generate([5 + i, 6, 7, 8], params) for i in range(b)))
            steps[b] = (time.perf_counter() - t0) / 64
        await engine.close()
        slope = max((steps[8] - steps[1]) / 7, 1e-6)
        return Costs(512 / min(pf), max(steps[1] - slope, 1e-5), slope)

    return asyncio.run(main())


@dataclass
class Session:
    prompt: list[int]
    turns_left: int
    heavy: bool


@dataclass
class Request:
    session: Session
    prompt: list[int]
    hashes: list[int]
    target: int
    arrived: float
    flight: Flight | None = None
    completion: list[int] = field(default_factory=list)
    hit: int = 0
    completion_at: float = 0.0


def make_traffic(n_groups: int, rate: float, seed: int) -> list[tuple[float, list[Session]]]:
    """(arrival time, G sessions) per group; token ids are random, so only real prefixes match."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 1 << 30) for _ in range(SYSTEM)]
    t, out = 0.0, []
    for _ in range(n_groups):
        t += rng.expovariate(rate)
        heavy = rng.random() < 0.2
        task = system + [rng.randrange(3, 1 << 30) for _ in range(rng.randint(64, 192))]
        turns = 8 if heavy else rng.randint(4, 6)
        out.append((t, [Session(list(task), turns, heavy) for _ in range(G)]))
    return out


def completion_len(rng: random.Random, heavy: bool) -> int:
    return max(4, min(512, int(rng.lognormvariate(math.log(32), 0.6) * (4 if heavy else 1))))


class Sim:
    """N simulated engines behind RouterState(policy); see the module docstring."""

    def __init__(self, n: int, policy: str, costs: Costs, seed: int) -> None:
        self.n, self.costs, self.rng = n, costs, random.Random(seed + 1)
        self.router = RouterState(n, POLICIES[policy], CACHE_TOKENS, MAX_BATCH)
        self.cache = [PrefixIndex(1, CACHE_TOKENS // BLOCK) for _ in range(n)]
        self.oracle = PrefixIndex(1, 1 << 62)
        self.running: list[list[Request]] = [[] for _ in range(n)]
        self.queue: list[deque[Request]] = [deque() for _ in range(n)]
        self.busy = [False] * n
        self.parked: deque[Request] = deque()  # cost_aware: every instance at its bound
        self.events: list = []
        self.seq = 0
        self.done: list[Request] = []
        self.achievable = 0

    def push(self, t: float, kind: str, item: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, item))

    def run(self, traffic) -> dict[str, float]:
        for t, sessions in traffic:
            for s in sessions:  # a copy: sessions grow as they run
                self.push(t, "arrive", Session(list(s.prompt), s.turns_left, s.heavy))
        now = 0.0
        while self.events:
            now, _, kind, item = heapq.heappop(self.events)
            if kind == "arrive":
                self.arrive(item, now)
            else:
                self.step_end(item, now)
        lat = sorted(r.completion_at - r.arrived for r in self.done)
        prompt = sum(len(r.prompt) for r in self.done)
        hit = sum(r.hit for r in self.done)
        start = min(t for t, _ in traffic)
        return {"hit": hit / prompt, "achievable": self.achievable / prompt,
                "p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99)],
                "tok_s": sum(len(r.completion) for r in self.done) / (now - start),
                "requests": len(self.done)}

    def arrive(self, s: Session, now: float) -> None:
        hashes = block_hashes(s.prompt)
        req = Request(s, list(s.prompt), hashes, completion_len(self.rng, s.heavy), now)
        self.achievable += min(self.oracle.matched(hashes)[0], len(s.prompt) - 1)
        self.oracle.add(0, hashes)
        self.route(req, now)

    def route(self, req: Request, now: float) -> None:
        i, cached = self.router.choose(req.prompt, req.hashes, 512)
        if i is None:
            self.parked.append(req)
            return
        req.flight = self.router.dispatch(i, req.prompt, req.hashes, cached, 512, now)
        self.queue[i].append(req)
        if not self.busy[i]:
            self.start_step(i, now)

    def start_step(self, i: int, now: float) -> None:
        rows, queue, cost = self.running[i], self.queue[i], 0.0
        while queue and len(rows) < MAX_BATCH:
            req = queue.popleft()
            req.hit = min(self.cache[i].matched(req.hashes)[0], len(req.prompt) - 1)
            cost += (len(req.prompt) - req.hit) / self.costs.prefill_tok_s
            self.cache[i].add(0, req.hashes)
            rows.append(req)
        if not rows:
            self.busy[i] = False
            return
        self.busy[i] = True
        self.push(now + cost + self.costs.step(len(rows)), "step", i)

    def step_end(self, i: int, now: float) -> None:
        keep = []
        for req in self.running[i]:
            req.completion.append(self.rng.randrange(3, 1 << 30))
            self.router.token(req.flight, now)
            if len(req.completion) < req.target:
                keep.append(req)
                continue
            self.finish(i, req, now)
        self.running[i] = keep
        while self.parked and self.router.choose(
                self.parked[0].prompt, self.parked[0].hashes, 512)[0] is not None:
            self.route(self.parked.popleft(), now)
        self.start_step(i, now)

    def finish(self, i: int, req: Request, now: float) -> None:
        req.completion_at = now
        self.done.append(req)
        seq_hashes = block_hashes(req.prompt + req.completion[:-1])
        self.cache[i].add(0, seq_hashes)
        self.oracle.add(0, seq_hashes)
        self.router.land(req.flight, req.completion, now)
        s = req.session
        s.turns_left -= 1
        if s.turns_left > 0:
            tool = [self.rng.randrange(3, 1 << 30) for _ in range(self.rng.randint(16, 48))]
            s.prompt = req.prompt + req.completion + tool
            self.push(now + self.rng.expovariate(1 / (30 * self.costs.step(1))), "arrive", s)


def simulate(costs: Costs, instances: list[int], groups_per_instance: int) -> list[dict]:
    rows = []
    mean_tokens = G * (0.8 * 5 * 32 * 1.2 + 0.2 * 8 * 128 * 1.2)  # decode tokens per group
    for n in instances:
        capacity = n * MAX_BATCH / costs.step(MAX_BATCH)  # tokens/s at full batches
        rate = 0.6 * capacity / mean_tokens
        traffic = make_traffic(max(8, groups_per_instance * n), rate, seed=n)
        for name in NAMES:
            t0 = time.perf_counter()
            r = Sim(n, name, costs, seed=n).run(traffic)
            rows.append({"n": n, "policy": name, "wall": time.perf_counter() - t0, **r})
    return rows


def print_table(rows: list[dict], title: str) -> None:
    print(title)
    print(f"{'N':>3} {'router':<12} {'hit':>6} {'achv':>6} {'of achv':>7} {'p50 s':>7} "
          f"{'p99 s':>7} {'tok/s':>8} {'p99 vs rr':>9} {'tok/s vs rr':>11} {'reqs':>6}")
    base = {}
    for r in rows:
        key = r["n"]
        if r["policy"] == "round_robin":
            base[key] = r
        b = base.get(key, r)
        print(f"{r['n']:>3} {r['policy']:<12} {r['hit']:>6.1%} {r['achievable']:>6.1%} "
              f"{r['hit'] / r['achievable']:>7.1%} {r['p50']:>7.3f} {r['p99']:>7.3f} "
              f"{r['tok_s']:>8.0f} {r['p99'] / b['p99']:>8.2f}x {r['tok_s'] / b['tok_s']:>10.2f}x "
              f"{r['requests']:>6}")


def real_run(n_groups: int = 6, turns: int = 4) -> list[dict]:
    """The traffic shape, scaled down (tiny model: 64-token system prompt, 16-64-token tasks,
    sampled 8-24-token completions), through a real Router over 2 LocalEngines per policy."""
    model = build_tiny_model()
    rng = random.Random(0)
    system = [rng.randrange(3, 250) for _ in range(64)]
    tasks = [system + [rng.randrange(3, 250) for _ in range(rng.randint(16, 64))]
             for _ in range(n_groups)]
    rows = []

    tokens: list[int] = []

    async def session(router: Router, prompt: list[int], seed: int, heavy: bool, lat: list):
        for k in range(turns * (2 if heavy else 1)):
            await asyncio.sleep(0.002 * ((seed * 7 + k) % 5))  # tool time
            t0 = time.perf_counter()
            out = await router.generate(prompt, SamplingParams(1.0, max_tokens=(
                48 if heavy else 12), seed=seed * 100 + k))
            lat.append(time.perf_counter() - t0)
            tokens.append(len(out.completion_ids))
            prompt = prompt + out.completion_ids + [rng.randrange(3, 250) for _ in range(8)]

    async def main(policy: str) -> dict:
        engines = [LocalEngine(model, max_model_len=2048, max_batch_size=MAX_BATCH,
                               prefix_cache_tokens=CACHE_TOKENS) for _ in range(2)]
        router = Router(engines, policy, CACHE_TOKENS, MAX_BATCH)
        lat: list[float] = []
        tokens.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(session(router, tasks[g], g * G + j, g % 5 == 0, lat)
                               for g in range(n_groups) for j in range(G)))
        wall = time.perf_counter() - t0
        st = router.stats
        await router.close()
        prompt = st["instance0_prompt_tokens"] + st["instance1_prompt_tokens"]
        lat.sort()
        return {"policy": policy, "hit": st["prefix_hit_tokens"] / prompt,
                "p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99)],
                "tok_s": sum(tokens) / wall, "wall": wall,
                "split": f"{st['instance0_requests']}/{st['instance1_requests']}"}

    for policy in NAMES:
        rows.append(asyncio.run(main(policy)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--groups-per-instance", type=int, default=3)
    ap.add_argument("--real", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    costs = measure_costs()
    print(f"measured (tiny model, LocalEngine, 1 thread): prefill {costs.prefill_tok_s:,.0f} "
          f"tok/s; decode step {costs.step(1) * 1e3:.2f} ms at batch 1, "
          f"{costs.step(MAX_BATCH) * 1e3:.2f} ms at batch {MAX_BATCH}")
    rows = simulate(costs, args.instances, args.groups_per_instance)
    print_table(rows, "simulation (same code as Router's bookkeeping, simulated clock):")
    print(f"simulated in {sum(r['wall'] for r in rows):.0f} s")
    if args.real:
        print("real: Router over 2 LocalEngines (tiny model)")
        for r in real_run():
            print(f"    {r['policy']:<12} hit {r['hit']:6.1%}  p50 {r['p50']:.3f} s  "
                  f"p99 {r['p99']:.3f} s  {r['tok_s']:5.0f} tok/s  wall {r['wall']:.1f} s  "
                  f"requests {r['split']}")


if __name__ == "__main__":
    main()
