"""The global prefix-KV pool behind the cost-aware router: hits, latency, transferred bytes.

Issue 49 part 3 (Forge §3.3's L3 pool). Part 1 measures, in this run, a real LocalEngine (tiny
model, one thread: prefill tokens/s, decode step line, as benchmarks/router.py) and the pool's
transfer cost: a real engine's `fetch` of a 512-token prefix from a `KVPool` in this process and
from a `SharedKVPool` (pool process, unix socket), seconds per token, copies included.

Part 2 is benchmarks/router.py's simulation (same traffic: groups of 8 agent sessions sharing
a 256-token system prompt, multi-turn, skewed) at N = 2-64 with the measured costs, for
round_robin, affinity, cost_aware and cost_aware + pool (the in-process pool's measured cost;
POOL_TOKENS of pool). Part 3 runs real LocalEngines (N = 2, 4, 8, one process, one torch thread)
behind a real `Router`, same four policies, on a scaled-down traffic (2 groups per instance,
64-token system prompt, 3 turns, every fifth task heavy: 6) with prefix caches scaled down
alike (CACHE_TOKENS / 4 per engine); hit = the engines' reused prompt tokens
(local prefix cache + pool fetches) / prompt tokens; achievable = tokens of each request's
longest common prefix with any earlier prompt or finished prompt + completion (one unbounded
cache); pool = tokens fetched from the pool / prompt tokens; MB = bytes fetched.

Run: `.venv/bin/python benchmarks/kv_pool.py [--instances 2 4 8 64] [--real 2 4 8]`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.router import (
    CACHE_TOKENS,
    MAX_BATCH,
    Costs,
    G,
    Sim,
    drive,
    make_tasks,
    make_traffic,
    measure_costs,
)
from forgerl.engines.kv_pool import KVPool, SharedKVPool, fetch, publish
from forgerl.engines.local import LocalEngine
from forgerl.gateway.router import Router
from forgerl.models import build_tiny_model
from forgerl.types import SamplingParams

POOL_TOKENS = 65_536  # the pool: 8 instances' prefix caches (host memory is the larger tier)
POLICIES = ("round_robin", "affinity", "cost_aware", "cost_aware+pool")


def measure_fetch() -> dict[str, float]:
    """Seconds per token of a real fetch of a 512-token prefix (in-process and shared pool),
    median of 20, and the KV bytes per token."""
    model = build_tiny_model()

    async def kv_of(prompt: list[int]) -> tuple[int, list]:
        engine = LocalEngine(model, max_model_len=1024)
        await engine.generate(prompt, SamplingParams(0.0, max_tokens=1))
        kv = engine.prefix_cache.lookup((*prompt, 0))[1]
        per_token = engine.kv_bytes_per_token
        await engine.close()
        return per_token, kv

    prompt = [random.Random(1).randrange(3, 250) for _ in range(512)]
    per_token, kv = asyncio.run(kv_of(prompt))
    out = {"bytes_per_token": per_token}
    with tempfile.TemporaryDirectory() as tmp:
        shared = SharedKVPool.start(Path(tmp) / "pool.sock", 1 << 26)
        for name, pool in (("process", KVPool(1 << 26)), ("shared", shared)):
            publish(pool, 0, prompt, kv)
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                n, _ = fetch(pool, 0, [*prompt, 1], 0)
                times.append((time.perf_counter() - t0) / n)
            out[name] = sorted(times)[len(times) // 2]
        shared.close()
    return out


def simulate(costs: Costs, fetch_s: float, instances: list[int]) -> list[dict]:
    rows = []
    mean_tokens = G * (0.8 * 5 * 32 * 1.2 + 0.2 * 8 * 128 * 1.2)
    for n in instances:
        rate = 0.6 * n * MAX_BATCH / costs.step(MAX_BATCH) / mean_tokens
        traffic = make_traffic(max(8, 3 * n), rate, seed=n)
        for name in POLICIES:
            pool = name.endswith("+pool")
            sim = Sim(n, name.removesuffix("+pool"), costs, seed=n,
                      pool_tokens=POOL_TOKENS if pool else 0, fetch_s_per_token=fetch_s)
            rows.append({"n": n, "policy": name, **sim.run(traffic)})
    return rows


class Oracle:
    """One unbounded token-level cache that saw every earlier prompt and finished sequence."""

    def __init__(self) -> None:
        self.root: dict = {}

    def match(self, ids: list[int]) -> int:
        node, n = self.root, 0
        for t in ids[:-1]:
            if t not in node:
                break
            node, n = node[t], n + 1
        return n

    def add(self, ids: list[int]) -> None:
        node = self.root
        for t in ids:
            node = node.setdefault(t, {})


class Counted:
    """`router.generate` that records the oracle's achievable hits and the prompt tokens."""

    def __init__(self, router: Router) -> None:
        self.router, self.oracle, self.achievable, self.prompt = router, Oracle(), 0, 0

    async def generate(self, prompt: list[int], params: SamplingParams):
        self.achievable += self.oracle.match(prompt)
        self.prompt += len(prompt)
        self.oracle.add(prompt)
        out = await self.router.generate(prompt, params)
        self.oracle.add(prompt + out.completion_ids[:-1])
        return out


def real_run(n: int, policy: str) -> dict:
    model, tasks = build_tiny_model(), make_tasks(2 * n, 64, (16, 64), 250)

    async def main() -> dict:
        pool = KVPool(POOL_TOKENS * 512) if policy.endswith("+pool") else None
        engines = [LocalEngine(model, max_model_len=2048, max_batch_size=MAX_BATCH,
                               prefix_cache_tokens=CACHE_TOKENS // 4, kv_pool=pool)
                   for _ in range(n)]
        router = Router(engines, policy.removesuffix("+pool"), CACHE_TOKENS // 4, MAX_BATCH,
                        kv_pool=pool)
        counted = Counted(router)
        run = await drive(counted, tasks, 3, (12, 48), 250)  # type: ignore[arg-type]
        st = router.stats
        await router.close()
        lat = run["lat"]
        return {"n": n, "policy": policy, "hit": st["prefix_hit_tokens"] / counted.prompt,
                "achievable": counted.achievable / counted.prompt,
                "pool_hit": st["pool_hit_tokens"] / counted.prompt,
                "fetched_tokens": st["pool_hit_tokens"], "p50": lat[len(lat) // 2],
                "p99": lat[int(len(lat) * 0.99)], "tok_s": run["tokens"] / run["wall"],
                "requests": len(lat)}

    return asyncio.run(main())


def print_table(rows: list[dict], title: str, bytes_per_token: int) -> None:
    print(title)
    print(f"{'N':>3} {'router':<16} {'hit':>6} {'pool':>6} {'achv':>6} {'of achv':>7} "
          f"{'p50 s':>7} {'p99 s':>7} {'p99/rr':>6} {'tok/s':>7} {'MB':>7} {'reqs':>5}")
    base: dict[int, dict] = {}
    for r in rows:
        b = base.setdefault(r["n"], r)
        print(f"{r['n']:>3} {r['policy']:<16} {r['hit']:>6.1%} {r['pool_hit']:>6.1%} "
              f"{r['achievable']:>6.1%} {r['hit'] / r['achievable']:>7.1%} {r['p50']:>7.3f} "
              f"{r['p99']:>7.3f} {r['p99'] / b['p99']:>5.2f}x {r['tok_s']:>7.0f} "
              f"{r['fetched_tokens'] * bytes_per_token / 1e6:>7.2f} {r['requests']:>5}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, nargs="*", default=[2, 4, 8, 64])
    ap.add_argument("--real", type=int, nargs="*", default=[2, 4, 8])
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    costs, transfer = measure_costs(), measure_fetch()
    per_token = int(transfer["bytes_per_token"])
    print(f"measured (tiny model, 1 thread): prefill {costs.prefill_tok_s:,.0f} tok/s "
          f"({1e6 / costs.prefill_tok_s:.2f} us/token); decode step {costs.step(1) * 1e3:.2f} ms"
          f" at batch 1, {costs.step(MAX_BATCH) * 1e3:.2f} ms at {MAX_BATCH}; KV {per_token} B"
          f"/token; pool fetch {transfer['process'] * 1e6:.3f} us/token in process, "
          f"{transfer['shared'] * 1e6:.3f} us/token shared (unix socket)")
    if args.instances:
        rows = simulate(costs, transfer["process"], args.instances)
        print_table(rows, "simulation (Router's bookkeeping, measured costs):", per_token)
    if args.real:
        rows = [real_run(n, p) for n in args.real for p in POLICIES]
        print_table(rows, "real: Router over N LocalEngines (tiny model, one process):",
                    per_token)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
