"""The global prefix-KV pool (issue 49 part 3) and the router's third option, fetching from it.

Pinned here:
- Exactness through real LocalEngines: instance B fetching instance A's KV from the pool gives
  the ids and logprobs of an engine without a pool within 1e-6 (greedy and sampled), and
  prefills only the tokens the pool lacks.
- A weight update invalidates the pool: no block of the old version is ever fetched, and the
  new version's logprobs are those of the new weights.
- The byte bound: LRU, a chain's root outlives its leaves.
- The cross-process backend: a second OS process publishes with a real engine, this one
  fetches through the pool process and matches an engine without a pool. The pool process
  ends when the process that started it is SIGKILLed (no orphan); an engine whose pool
  process is SIGKILLed goes on without it (exact completions, weight updates settle, a warning).
- cost_aware picks the instance that fetches when the transfer is cheaper than the prefill,
  and the one with the queue when it is not (hand-computed costs); RouterState's record of
  the pool; DFS order, pure and through a real Router whose waiters it releases.
- A Router over two pooled engines: the second instance fetches the first's KV (exact), and
  a weight update through the router empties the pool and its record.
- [engine] kv_pool config and the controller's pool construction (a real pool process).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from forgerl.config import ConfigError, load_config
from forgerl.controller.startup import _block_bytes, _kv_pool
from forgerl.engines.blocks import BLOCK, block_hashes
from forgerl.engines.kv_pool import KVPool, SharedKVPool
from forgerl.engines.local import LocalEngine
from forgerl.gateway.router import Router
from forgerl.gateway.routing import InstanceLoad, RouterState, cost_aware, dfs_order
from forgerl.models import build_tiny_model
from forgerl.types import GenerateOutput, SamplingParams
from tests.engines.test_local import perturbed

PROMPT = [(7 * i + 3) % 250 + 3 for i in range(75)]  # 4 full blocks + 11 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
SAMPLED = SamplingParams(temperature=0.9, max_tokens=10, seed=3)


async def _gen(engine: LocalEngine, prompt: list[int], params: SamplingParams) -> GenerateOutput:
    return await engine.generate(prompt, params)


def _close(a: GenerateOutput, b: GenerateOutput) -> None:
    assert a.completion_ids == b.completion_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-6


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_fetched_kv_matches_recomputed(tiny_model, params):
    async def main():
        pool = KVPool(1 << 24)
        a, b = (LocalEngine(tiny_model, max_model_len=256, kv_pool=pool) for _ in range(2))
        alone = LocalEngine(tiny_model, max_model_len=256)
        first = await _gen(a, PROMPT, params)
        turn2 = PROMPT + first.completion_ids + [9, 8, 7, 6, 5]
        fetched, ref = await _gen(b, turn2, params), await _gen(alone, turn2, params)
        stats = dict(b.stats)
        for e in (a, b, alone):
            await e.close()
        return first, fetched, ref, stats, pool

    first, fetched, ref, stats, pool = asyncio.run(main())
    _close(fetched, ref)
    # A published prompt + completion but its last token: 75 + 9 = 84 tokens = 5 blocks
    assert (stats["pool_hits"], stats["pool_hit_tokens"]) == (1, 5 * BLOCK)
    assert stats["prefill_tokens"] == len(PROMPT) + len(first.completion_ids) + 5 - 5 * BLOCK
    assert pool.stats["fetch_bytes"] == 5 * b_bytes(tiny_model) and pool.seconds_per_byte() > 0


def b_bytes(model) -> int:
    """One block's bytes: 2 layers · (K, V) · 2 kv heads · BLOCK · head_dim 16 · fp32."""
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * BLOCK * 16 * 4


def test_weight_update_invalidates_the_pool(tiny_model):
    new_model = perturbed(tiny_model, seed=1)

    async def main():
        pool = KVPool(1 << 24)
        a, b = (LocalEngine(tiny_model, max_model_len=256, kv_pool=pool) for _ in range(2))
        fresh = LocalEngine(new_model, max_model_len=256)
        await _gen(a, PROMPT, GREEDY)  # version 0 blocks
        assert pool.stats["blocks"] == 5 and pool.version == 0  # prompt + completion: 84
        await b.update_weights(new_model.state_dict(), 1)
        assert pool.stats["blocks"] == 0 and pool.version == 1
        await _gen(a, PROMPT[:70], GREEDY)  # a still serves version 0: no fetch, no publish
        assert a.stats["pool_hits"] == 0 and pool.stats["blocks"] == 0
        out_b, ref = await _gen(b, PROMPT, GREEDY), await _gen(fresh, PROMPT, GREEDY)
        assert b.stats["pool_hits"] == 0 and pool.stats["blocks"] == 5  # its own, version 1
        await a.update_weights(new_model.state_dict(), 1)
        out_a = await _gen(a, PROMPT, GREEDY)  # now fetches b's version-1 KV
        stats = dict(a.stats)
        for e in (a, b, fresh):
            await e.close()
        return out_b, out_a, ref, stats

    out_b, out_a, ref, stats = asyncio.run(main())
    _close(out_b, ref)
    _close(out_a, ref)
    assert stats["pool_hits"] == 1 and stats["pool_hit_tokens"] == 4 * BLOCK


def _block(value: float) -> torch.Tensor:
    # 2 layers · (K, V) · 2 heads · BLOCK · 4, fp32: 2 KiB
    return torch.full((2, 2, 2, BLOCK, 4), float(value))


def test_lru_byte_bound():
    size = _block(0).numel() * 4
    pool = KVPool(3 * size)
    chain = block_hashes(list(range(5 * BLOCK)))
    pool.put(0, chain, [_block(k) for k in range(5)])
    assert pool.stats["bytes"] == 3 * size and pool.stats["evicted_blocks"] == 2
    assert [float(b[0, 0, 0, 0, 0]) for b in pool.get(0, chain)] == [0.0, 1.0, 2.0]  # the root
    other = block_hashes(list(range(100, 100 + 2 * BLOCK)))
    pool.put(0, other, [_block(10), _block(11)])  # the least recently used go: chain[2], [1]
    assert len(pool.get(0, chain)) == 1 and len(pool.get(0, other)) == 2
    assert pool.held(1, other) == [False, False] and pool.get(1, other) == []
    pool.put(0, [12345], [torch.zeros(size)])  # 4 · size bytes, over the bound: not kept
    assert pool.held(0, [12345]) == [False] and pool.stats["bytes"] == 3 * size
    pool.put(2, other[:1], [_block(20)])  # a newer version drops every older block
    assert pool.stats["blocks"] == 1 and pool.get(0, chain) == [] and pool.version == 2
    pool.put(1, chain[:1], [_block(30)])  # an older one is ignored
    assert pool.held(2, chain[:1]) == [False]


CHILD = textwrap.dedent("""
    import asyncio, sys, torch
    from forgerl.engines.kv_pool import SharedKVPool
    from forgerl.engines.local import LocalEngine
    from forgerl.models import build_tiny_model
    from forgerl.types import SamplingParams
    torch.set_num_threads(1)
    async def main():
        pool = SharedKVPool(sys.argv[1])
        engine = LocalEngine(build_tiny_model(), max_model_len=256, kv_pool=pool)
        out = await engine.generate(eval(sys.argv[2]), SamplingParams(0.0, max_tokens=10))
        await engine.close()
        pool.close()
        print(out.completion_ids)
    asyncio.run(main())
""")


def test_shared_pool_across_processes(tiny_model, tmp_path):
    path = tmp_path / "pool.sock"
    pool = SharedKVPool.start(path, 1 << 24)
    try:
        env = dict(os.environ, PYTHONPATH=os.getcwd())
        child = subprocess.run([sys.executable, "-c", CHILD, str(path), repr(PROMPT)], env=env,
                               capture_output=True, text=True, timeout=120, check=True)
        first = eval(child.stdout.strip().splitlines()[-1])
        assert pool.pool_stats["blocks"] == 5  # 84 tokens published by the other process

        async def main():
            b = LocalEngine(tiny_model, max_model_len=256, kv_pool=pool)
            alone = LocalEngine(tiny_model, max_model_len=256)
            turn2 = PROMPT + first + [9, 8, 7]
            outs = await _gen(b, turn2, GREEDY), await _gen(alone, turn2, GREEDY)
            stats = dict(b.stats)
            await b.close()
            await alone.close()
            return (*outs, stats)

        fetched, ref, stats = asyncio.run(main())
        _close(fetched, ref)
        assert (stats["pool_hits"], stats["pool_hit_tokens"]) == (1, 5 * BLOCK)
        assert pool.stats["fetch_bytes"] == 5 * b_bytes(tiny_model)
        assert 0 < pool.seconds_per_byte() < 1e-6
    finally:
        pool.close()
    assert pool.process is not None and pool.process.returncode is not None


OWNER = textwrap.dedent("""
    import sys, time
    from forgerl.engines.kv_pool import SharedKVPool
    pool = SharedKVPool.start(sys.argv[1], 1 << 20)
    print(pool.process.pid, flush=True)
    time.sleep(600)
""")


def test_pool_process_ends_with_its_killed_owner(tmp_path):
    path = tmp_path / "pool.sock"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(path)], env=env,
                             stdout=subprocess.PIPE, text=True)
    pool_pid = int(owner.stdout.readline())
    assert path.exists() and _alive(pool_pid)
    owner.kill()  # SIGKILL: no cleanup runs in the owner
    owner.wait(10)
    for _ in range(100):
        if not _alive(pool_pid):
            break
        time.sleep(0.1)
    else:
        os.kill(pool_pid, 9)
        pytest.fail("the pool process outlived its SIGKILLed owner by 10 s")
    assert not path.exists()


def test_engine_goes_on_when_the_pool_process_is_killed(tiny_model, tmp_path, caplog):
    new_model = perturbed(tiny_model, seed=1)
    pool = SharedKVPool.start(tmp_path / "pool.sock", 1 << 24)

    async def main():
        a, b = (LocalEngine(tiny_model, max_model_len=256, kv_pool=pool) for _ in range(2))
        fresh = LocalEngine(new_model, max_model_len=256)
        await _gen(a, PROMPT, GREEDY)  # published
        pool.process.kill()
        pool.process.wait(10)
        alone = await _gen(b, PROMPT, GREEDY)  # would have fetched: now a miss
        await asyncio.wait_for(b.update_weights(new_model.state_dict(), 1), 30)
        outs = await _gen(b, PROMPT, GREEDY), await _gen(fresh, PROMPT, GREEDY)
        stats = dict(b.stats)
        for e in (a, b, fresh):
            await e.close()
        return alone, outs, stats

    try:
        alone, (after, ref), stats = asyncio.run(main())
    finally:
        pool.close()
    assert len(alone.completion_ids) == 10 and stats["pool_hits"] == 0
    _close(after, ref)
    assert pool.gone and pool.pool_stats == {} and "is gone" in caplog.text


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie that no one reaped yet has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _load(in_flight: int, cached: int, pooled: int, fetch_s: float) -> InstanceLoad:
    return InstanceLoad(True, in_flight, cached, prefill_tok_s=1000.0, step_s=0.01, row_s=0.001,
                        expected_tokens=10, overlap_tokens=10.0 * in_flight, load_bound=16,
                        pooled_tokens=pooled, fetch_s_per_token=fetch_s)


@pytest.mark.parametrize(("fetch_s", "pick"), [(1e-5, 1), (1e-3, 0)])
def test_cost_aware_fetches_when_cheaper(fetch_s, pick):
    # A 500-token prompt. Instance 0 holds 400 tokens, 2 requests in flight: prefill 100 tokens
    # = 0.1 s · 3 = 0.3 s; decode 10 · 0.01 + 0.001 · (10 + 2 · 20) = 0.15 s; 0.45 s. Instance 1
    # holds nothing, idle, the pool holds 480: recompute 0.5 s; fetch 480 · fetch_s + 0.02 s
    # (1e-5: 0.0248 s, 1e-3: 0.5 s, so min 0.5 s); decode 0.1 + 0.001 · 10 = 0.11 s.
    loads = [_load(2, 400, 480, fetch_s), _load(0, 0, 480, fetch_s)]
    assert cost_aware(loads, 500, 0) == pick
    without_pool = [_load(2, 400, 0, fetch_s), _load(0, 0, 0, fetch_s)]
    assert cost_aware(without_pool, 500, 0) == 0


def test_router_state_records_the_pool():
    s = RouterState(2, cost_aware, cache_tokens=1024, pool_blocks=64, fetch_s_per_token=1e-5)
    prompt = list(range(100, 100 + 6 * BLOCK))
    turn2 = [*prompt, 1, 2]
    f = s.dispatch(0, prompt, block_hashes(prompt), 0, 8, now=0.0)
    assert s.loads(turn2, block_hashes(turn2), 8)[1].pooled_tokens == 0  # not yet prefilled
    s.token(f, now=0.1)  # its first token: the prefill published the prompt
    loads = s.loads(turn2, block_hashes(turn2), 8)
    assert [x.pooled_tokens for x in loads] == [6 * BLOCK] * 2
    assert [x.cached_tokens for x in loads] == [6 * BLOCK, 0]
    for _ in range(3):  # load instance 0 so that fetching on 1 wins
        s.dispatch(0, [5] * 40, block_hashes([5] * 40), 0, 8, now=0.0)
    i, reused = s.choose(turn2, block_hashes(turn2), 8)
    assert (i, reused) == (1, 6 * BLOCK)
    s.dispatch(i, turn2, block_hashes(turn2), reused, 8, now=0.0)
    assert s.stats()["instance1_pool_fetch_tokens"] == 6 * BLOCK
    s.land(f, [1] * 17, now=1.0)  # prompt + 16 completion tokens: one more block pooled
    done = [*prompt, *[1] * 17]
    assert s.loads(done, block_hashes(done), 8)[1].pooled_tokens == 7 * BLOCK
    assert dfs_order([[3, 1], [2, 9], [3, 0, 5], [2, 9]]) == [1, 3, 2, 0]


def test_config_and_startup_pool():
    config = load_config(None, ["--engine.kv_pool", "process", "--engine.kv_pool_bytes", "4096"])
    assert (config.engine.kv_pool, config.engine.kv_pool_bytes) == ("process", 4096)
    assert load_config(None).engine.kv_pool == "off"
    with pytest.raises(ConfigError, match=r"engine.kv_pool"):
        load_config(None, ["--engine.kv_pool", "disk"])
    with pytest.raises(ConfigError, match=r"engine.kv_pool: the pool is wired for local"):
        load_config(None, ["--engine.kv_pool", "shared", "--cluster.backend", "ray"])
    assert _kv_pool("off", 1) is None and _kv_pool("process", 4096).max_bytes == 4096
    assert _block_bytes(build_tiny_model(), torch.float32) == BLOCK * 512  # docs/kv-pool.md
    with pytest.raises(ConfigError, match=r"engine.kv_pool_bytes \(8191\) cannot hold one KV"):
        _kv_pool("shared", 8191, 8192)  # before any pool process starts
    shared = _kv_pool("shared", 4096)
    try:
        assert shared.held(0, [1]) == [False] and shared.process.poll() is None
    finally:
        shared.close()


def test_router_releases_waiters_in_dfs_order(tiny_model):
    """One instance, load bound 1: requests waiting for its slot go in prefix-trie order, not
    in arrival order: [5] * 40 before [5] * 30 + [7] * 10 before [9] * 40, which came first."""
    order: list[int] = []

    async def main():
        engine = LocalEngine(tiny_model, max_model_len=256)
        router = Router([engine], "cost_aware", load_bound=1)

        async def one(prompt: list[int], tag: int) -> None:
            await router.generate(prompt, SamplingParams(0.0, max_tokens=4))
            order.append(tag)

        first = asyncio.create_task(one([1] * 40, 0))
        await asyncio.sleep(0)  # it holds the slot
        waiting = [asyncio.create_task(one(p, t)) for p, t in
                   (([9] * 40, 3), ([5] * 30 + [7] * 10, 2), ([5] * 40, 1))]
        await asyncio.gather(first, *waiting)
        await router.close()

    asyncio.run(main())
    assert order == [0, 1, 2, 3]  # arrival order was 0, 3, 2, 1


def test_router_over_pooled_engines(tiny_model):
    """Round robin sends turn 2 to the other instance, which fetches turn 1's KV; a weight
    update through the router empties the pool and the router's record of it."""
    new_model = perturbed(tiny_model, seed=2)

    async def main():
        pool = KVPool(1 << 24)
        engines = [LocalEngine(tiny_model, max_model_len=256, kv_pool=pool) for _ in range(2)]
        router = Router(engines, "round_robin", kv_pool=pool)
        alone = LocalEngine(tiny_model, max_model_len=256)
        assert router.state.pool is not None and router.state.fetch_s_per_token > 0
        first = await router.generate(PROMPT, GREEDY)
        turn2 = PROMPT + first.completion_ids + [4, 4, 4]
        out, ref = await router.generate(turn2, GREEDY), await alone.generate(turn2, GREEDY)
        stats = router.stats
        before = router.state.pool.matched(block_hashes(turn2))[0]
        await router.update_weights(new_model.state_dict(), 1)
        after = router.state.pool.matched(block_hashes(turn2))[0], pool.stats["blocks"]
        await router.close()
        await alone.close()
        return out, ref, stats, before, after

    out, ref, stats, before, after = asyncio.run(main())
    _close(out, ref)
    assert stats["instance0_requests"] == stats["instance1_requests"] == 1
    assert (stats["pool_hits"], stats["pool_hit_tokens"]) == (1, 5 * BLOCK)
    assert before == 5 * BLOCK and after == (0, 0)


def test_controller_runs_instances_over_a_shared_pool(tmp_path):
    """`[engine] instances = 2, kv_pool = "shared"`: a controller step's rollouts publish to
    the pool process; the weight sync advances it to the new version (no block left)."""
    from forgerl.controller import start_services  # lazy: as test_router's controller test
    from tests.test_controller import make_agent, tiny_config

    config = tiny_config(tmp_path / "run", "--engine.instances", "2", "--engine.kv_pool",
                         "shared", "--tasks.eval_size", "0")

    async def main():
        async with start_services(config, make_agent()) as s:
            s.admit()
            await s.train(await s.next_batch())
            pool = s.engine.kv_pool
            published = pool.pool_stats["blocks"]
            await s.sync_weights()
            return pool, published, pool.pool_stats, s.engine.stats

    pool, published, after, stats = asyncio.run(main())
    assert pool.process.returncode is not None  # the router's close stopped the pool process
    name = type(pool).__name__
    assert name == "SharedKVPool" and published > 0
    assert (after["blocks"], after["bytes"]) == (0, 0)  # version 1: every block dropped
    assert stats["instance0_requests"] > 0 and stats["instance1_requests"] > 0
