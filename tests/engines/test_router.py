"""The router: several engine instances behind one RolloutEngine (issue 12 item 3).

Pinned here:
- Policies are pure functions of InstanceLoad lists (hypothesis): none ever picks an unhealthy
  instance; affinity keeps a request on the healthy instance holding most of its prefix;
  cost_aware never picks an instance at its load bound and picks the least estimated seconds
  (hand-computed for a cached prefix against an imbalance of rows);
  round robin over n consecutive turns hits every healthy instance equally.
- PrefixIndex: a prompt matches the blocks recorded for an instance, per instance, and stays
  within its LRU bound (the root of a chain outlives its leaves).
- A Router over 2 real LocalEngines (tiny model): greedy ids/logprobs equal one engine's;
  multi-turn turns land on the instance holding their prefix (its engine's prefix_hits prove
  the KV was reused); a weight update reaches both, per-token versions exact; a failed update
  on one instance keeps the router's version and serves new requests at the old version only;
  streaming works; cancelling a stream aborts it on the chosen instance; a closed instance is
  never routed to again.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forgerl.engines.base import TokenEvent
from forgerl.engines.local import LocalEngine
from forgerl.gateway.router import Router
from forgerl.gateway.routing import (
    BLOCK,
    InstanceLoad,
    PrefixIndex,
    RouterState,
    affinity,
    block_hashes,
    cost_aware,
    estimated_seconds,
    round_robin,
)
from forgerl.types import GenerateOutput, SamplingParams
from tests.engines.test_local import perturbed

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)

loads_st = st.lists(
    st.builds(
        InstanceLoad,
        healthy=st.booleans(),
        in_flight=st.integers(0, 40),
        cached_tokens=st.integers(0, 600),
        prefill_tok_s=st.floats(10, 1e5),
        step_s=st.floats(0, 1),
        row_s=st.floats(0, 0.1),
        expected_tokens=st.floats(1, 512),
        overlap_tokens=st.floats(0, 5000),
        load_bound=st.integers(1, 32),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(loads_st, st.integers(1, 600), st.integers(0, 1000))
def test_policies_never_pick_an_unhealthy_instance(loads, prompt_len, turn):
    for policy in (round_robin, affinity, cost_aware):
        i = policy(loads, prompt_len, turn)
        if i is None:
            assert policy is cost_aware or not any(x.healthy for x in loads)
        else:
            assert loads[i].healthy


@settings(max_examples=300, deadline=None)
@given(loads_st, st.integers(1, 600), st.data())
def test_affinity_kept_while_the_holder_is_healthy(loads, prompt_len, data):
    holder = data.draw(st.integers(0, len(loads) - 1))
    others = max((x.cached_tokens for j, x in enumerate(loads) if j != holder), default=0)
    held = data.draw(st.integers(max(others + 1, (prompt_len + 1) // 2), max(others + 1, 600)))
    loads[holder] = InstanceLoad(True, loads[holder].in_flight, held, 1, 1, 1, 1, 0, 1)
    assert affinity(loads, prompt_len, 0) == holder
    sick = InstanceLoad(False, 0, held, 1, 1, 1, 1, 0, 1)  # once it fails, the request moves
    assert affinity([*loads[:holder], sick, *loads[holder + 1 :]], prompt_len, 0) != holder


@settings(max_examples=300, deadline=None)
@given(loads_st, st.integers(1, 600))
def test_cost_aware_respects_the_load_bound_and_minimises_the_estimate(loads, prompt_len):
    i = cost_aware(loads, prompt_len, 0)
    ok = [x for x in loads if x.healthy and x.in_flight < x.load_bound]
    if i is None:
        assert not ok
        return
    assert loads[i].in_flight < loads[i].load_bound
    assert estimated_seconds(loads[i], prompt_len) == min(estimated_seconds(x, prompt_len)
                                                          for x in ok)


def test_cost_aware_trades_cache_against_queue():
    # 1000-token prompts at 1000 tok/s prefill, t(B) = 0.01 + 0.001·B s, 50 tokens expected
    idle = InstanceLoad(True, 0, 0, 1000.0, 0.01, 0.001, 50, 0, 8)  # nothing cached or running
    assert estimated_seconds(idle, 1000) == pytest.approx(1.0 + 0.5 + 0.05)
    warm = InstanceLoad(True, 2, 900, 1000.0, 0.01, 0.001, 50, 100, 8)  # 2 rows, 100 shared steps
    assert estimated_seconds(warm, 1000) == pytest.approx(0.1 * 3 + 0.5 + 0.001 * (50 + 200))
    assert cost_aware([idle, warm], 1000, 0) == 1  # 1.05 s < 1.55 s: the cache wins
    busy = InstanceLoad(True, 6, 900, 1000.0, 0.01, 0.001, 50, 300, 8)
    assert estimated_seconds(busy, 1000) == pytest.approx(0.1 * 7 + 0.5 + 0.001 * 650)
    assert cost_aware([idle, busy], 1000, 0) == 0  # 1.85 s: 6 rows outweigh the cached prefix
    full = InstanceLoad(True, 8, 900, 1000.0, 0.01, 0.001, 50, 0, 8)
    assert cost_aware([full], 1000, 0) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=10).filter(any), st.integers(0, 100))
def test_round_robin_is_balanced(healthy, start):
    loads = [InstanceLoad(h, 0, 0, 1, 1, 1, 1, 0, 1) for h in healthy]
    picks = [round_robin(loads, 10, start + k) for k in range(len(healthy) * 3)]
    counts = {i: picks.count(i) for i in set(picks)}
    assert set(counts) == {i for i, h in enumerate(healthy) if h}
    if all(healthy):
        assert set(counts.values()) == {3}


def test_prefix_index_matches_and_stays_bounded():
    index = PrefixIndex(3, capacity_blocks=4)
    a = list(range(3 * BLOCK + 5))  # 3 full blocks
    index.add(1, block_hashes(a))
    assert index.matched(block_hashes(a + [7] * 40)) == [0, 3 * BLOCK, 0]
    b = a[:BLOCK] + [9] * (2 * BLOCK)  # shares one block with a
    index.add(2, block_hashes(b))
    assert index.matched(block_hashes(b)) == [0, BLOCK, 3 * BLOCK]
    index.add(1, block_hashes(b))  # 5 distinct blocks > 4: a's deepest block goes first
    assert index.matched(block_hashes(a)) == [0, 2 * BLOCK, BLOCK]
    assert all(len(lru) <= 4 for lru in index.lru)
    index.forget(1)
    assert index.matched(block_hashes(a)) == [0, 0, BLOCK]


def test_router_state_measures_rates_on_its_clock():
    s = RouterState(2, cost_aware, cache_tokens=1024, load_bound=8)
    prompt = list(range(200))
    f = s.dispatch(0, prompt, block_hashes(prompt), 0, 64, now=0.0)
    s.token(f, now=0.1)  # 200 uncached tokens in 0.1 s
    s.token(f, now=0.22, count=10)  # alone: 10 decode steps of 0.012 s at batch 1
    s.land(f, list(range(11)), now=0.22)
    assert s.prefill_tok_s[0] == pytest.approx(2000)
    assert s.step_line(0) == pytest.approx((0.006, 0.006))  # one batch size: half per row
    five = [s.dispatch(0, [7] * 8, [], 0, 64, now=1.0) for _ in range(5)]
    for g in five:
        s.token(g, now=1.1)
    for g in five:
        s.token(g, now=1.3, count=10)  # 10 steps of 0.02 s at batch 5
    for g in five:
        s.land(g, list(range(11)), now=1.3)
    # the line through (1, 0.012) and (5, 0.020): t(B) = 0.010 + 0.002·B
    assert s.step_line(0) == pytest.approx((0.010, 0.002))
    g = s.dispatch(0, [7] * 8, [], 0, 64, now=2.0)
    s.token(g, now=2.1, count=3)
    loads = s.loads(prompt + [1] * 30, block_hashes(prompt + [1] * 30), max_tokens=64)
    assert loads[0].cached_tokens == 192 and loads[1].cached_tokens == 0  # 12 blocks of 16
    assert loads[0].expected_tokens == 11  # the mean completion so far
    assert loads[0].overlap_tokens == 8 and loads[1].overlap_tokens == 0  # 11 - 3 still owed
    assert loads[1].prefill_tok_s == pytest.approx(2000)  # unmeasured: the others' mean
    assert (loads[1].step_s, loads[1].row_s) == pytest.approx((0.010, 0.002))
    stats = s.stats()
    assert stats["instance0_requests"] == 7 and stats["instance0_queue_peak"] == 5
    assert stats["instance0_queue_depth"] == 1 and stats["instance1_requests"] == 0
    assert stats["instance0_row_s"] == pytest.approx(0.002) and stats["instance1_row_s"] == 0


def run(coro):
    return asyncio.run(coro)


def _router(model, policy="affinity", n=2, **kw) -> Router:
    engines = [LocalEngine(model, max_model_len=512, max_batch_size=4) for _ in range(n)]
    return Router(engines, policy, cache_tokens=4096, **kw)


@pytest.mark.prefix_cache
def test_router_over_two_engines_equals_one_and_keeps_sessions(tiny_model):
    """Greedy outputs equal a single engine's; each session's turns stay on one instance and
    that instance's engine reuses the KV of the previous turn."""
    system = list(range(3, 3 + 2 * BLOCK))
    tasks = [system + [100 + t] * 40 for t in range(4)]  # system < half

    async def session(engine, prompt: list[int]) -> list[GenerateOutput]:
        outs = []
        for turn in range(3):
            out = await engine.generate(prompt, GREEDY)
            outs.append(out)
            prompt = prompt + out.completion_ids + [200 + turn] * 5  # tool result
        return outs

    async def main():
        single = LocalEngine(tiny_model, max_model_len=512)
        ref = await asyncio.gather(*(session(single, p) for p in tasks))
        await single.close()
        router = _router(tiny_model)
        got = await asyncio.gather(*(session(router, p) for p in tasks))
        stats, per_engine = router.stats, [e.stats for e in router.instances]
        await router.close()
        return ref, got, stats, per_engine

    ref, got, stats, per_engine = run(main())
    for a_T, b_T in zip(ref, got, strict=True):
        for a, b in zip(a_T, b_T, strict=True):
            assert a.completion_ids == b.completion_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert stats["instance0_requests"] + stats["instance1_requests"] == 12
    assert stats["instance0_requests"] > 0 and stats["instance1_requests"] > 0  # both used
    # turns 2 and 3 of every session found their prefix where they went: 8 reuses of >= 1 turn
    hits = sum(e["prefix_hits"] for e in per_engine)
    assert hits >= 8 and stats["prefix_hits"] == hits
    assert stats["instance0_cache_hit_tokens"] + stats["instance1_cache_hit_tokens"] >= 8 * 40


def test_weight_update_reaches_every_instance(tiny_model):
    new_state = perturbed(tiny_model, seed=1).state_dict()

    async def main():
        router = _router(tiny_model, "round_robin")
        router.weight_version = 5
        task = asyncio.create_task(router.generate([1, 2, 3], SamplingParams(0.0, max_tokens=200)))
        while not any(e._batch for e in router.instances):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)
        await router.update_weights(new_state, 6)
        mid = await task
        after = [await router.generate([4, 5, 6], GREEDY) for _ in range(2)]
        versions = [e.weight_version for e in router.instances]
        stats = router.stats
        await router.close()
        return router.weight_version, mid, after, versions, stats

    version, mid, after, versions, stats = run(main())
    assert version == 6 and versions == [6, 6]
    k = mid.weight_versions.index(6)
    assert k > 0 and mid.weight_versions == [5] * k + [6] * (len(mid.completion_ids) - k)
    assert all(out.weight_versions == [6] * GREEDY.max_tokens for out in after)
    assert after[0].completion_ids == after[1].completion_ids
    assert (stats["instance0_requests"], stats["instance1_requests"]) == (2, 1)


def test_failed_update_on_one_instance_keeps_the_old_version(tiny_model):
    new_state = perturbed(tiny_model, seed=1).state_dict()

    async def main():
        router = _router(tiny_model, "round_robin")
        before = await router.generate([7, 8, 9], GREEDY)

        async def broken(state_dict, version):
            raise RuntimeError("device lost")

        router.instances[1].update_weights = broken
        with pytest.raises(RuntimeError, match=r"instance\(s\) \[1\].*stays 0"):
            await router.update_weights(new_state, 1)
        held = (router.weight_version, router.stats["instance0_healthy"])
        outs = [await router.generate([7, 8, 9], GREEDY) for _ in range(3)]
        served = (router.stats["instance0_requests"], router.stats["instance1_requests"])
        del router.instances[1].update_weights  # repaired: the next update lands everywhere
        await router.update_weights(new_state, 2)
        later = [await router.generate([7, 8, 9], GREEDY) for _ in range(2)]
        await router.close()
        return before, held, outs, served, router.weight_version, later

    before, held, outs, served, version, later = run(main())
    assert held == (0, 0)  # instance 0 took version 1: held back
    assert served == (1, 3)  # every request after the failure ran on instance 1, at version 0
    assert all(o.completion_ids == before.completion_ids for o in outs)
    assert all(o.weight_versions == [0] * GREEDY.max_tokens for o in outs)
    assert version == 2 and all(o.weight_versions == [2] * GREEDY.max_tokens for o in later)
    assert later[0].completion_ids == later[1].completion_ids != before.completion_ids


def test_streaming_and_cancel_through_the_router(tiny_model):
    async def main():
        router = _router(tiny_model, "cost_aware")
        events = [item async for item in router.stream([1, 2, 3], GREEDY)]
        whole = await router.generate([1, 2, 3], GREEDY)
        long = router.stream([4, 5], SamplingParams(0.0, max_tokens=400))
        first = [await anext(long) for _ in range(3)]
        chosen = next(i for i, e in enumerate(router.instances) if e._batch is not None)
        (row,) = router.instances[chosen]._batch.rows
        await long.aclose()
        left_at = len(row.completion_ids)
        for _ in range(200):  # the row leaves the chosen engine's batch at its next step
            if router.instances[chosen]._batch is None:
                break
            await asyncio.sleep(0.005)
        freed = router.instances[chosen]._batch is None
        task = asyncio.create_task(router.generate([9, 9], SamplingParams(0.0, max_tokens=400)))
        while not any(e._batch for e in router.instances):
            await asyncio.sleep(0.001)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        depth = [router.stats[f"instance{i}_queue_depth"] for i in range(2)]
        await router.close()
        return events, whole, first, len(row.completion_ids) - left_at, freed, depth

    events, whole, first, extra, freed, depth = run(main())
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    assert [e.token_id for e in events[:-1]] == events[-1].completion_ids == whole.completion_ids
    assert events[-1].logprobs == pytest.approx(whole.logprobs, abs=1e-4)  # one may reuse KV
    assert all(isinstance(e, TokenEvent) for e in first)
    assert extra <= 1 and freed and depth == [0, 0]


def test_a_closed_instance_is_skipped(tiny_model):
    async def main():
        router = _router(tiny_model, "round_robin")
        await router.instances[0].close()
        outs = [await router.generate([3, 4], GREEDY) for _ in range(3)]
        stats = router.stats
        await router.close()
        return outs, stats

    outs, stats = run(main())
    assert all(o.finish_reason == "length" for o in outs)
    assert stats["instance0_healthy"] == 0 and stats["instance1_requests"] == 3


def test_router_refuses_what_the_engine_refuses(tiny_model):
    async def main():
        router = _router(tiny_model)
        with pytest.raises(ValueError, match="max_model_len"):
            await router.generate([1] * 500, SamplingParams(0.0, max_tokens=100))
        depth, healthy = router.stats["instance0_queue_depth"], router.stats["instance0_healthy"]
        await router.close()
        return depth, healthy

    assert run(main()) == (0, 1)


def test_config_instances_and_router():
    from forgerl.config import LocalEngineConfig

    assert LocalEngineConfig().instances == 1
    cfg = LocalEngineConfig(instances=4, router="affinity")
    assert (cfg.instances, cfg.router) == (4, "affinity")
    with pytest.raises(ValueError):
        LocalEngineConfig(router="least_load")


def test_controller_builds_a_router_for_several_instances(tmp_path):
    """`[engine] instances = 2`: the controller's loop runs unchanged over the router; one step's
    rollouts spread over both engines and the weight sync reaches both."""
    from forgerl.controller import start_services
    from tests.test_controller import make_agent, tiny_config

    config = tiny_config(tmp_path / "run", "--engine.instances", "2", "--tasks.eval_size", "0")

    async def main():
        async with start_services(config, make_agent()) as s:
            s.admit()
            await s.train(await s.next_batch())
            await s.sync_weights()
            stats = s.engine.stats
            versions = [e.weight_version for e in s.engine.instances]
            return type(s.engine).__name__, s.engine.weight_version, versions, stats

    name, version, versions, stats = run(main())
    assert (name, version, versions) == ("Router", 1, [1, 1])
    assert stats["instance0_requests"] + stats["instance1_requests"] >= 8  # 2 groups of 4
    assert stats["instance0_requests"] > 0 and stats["instance1_requests"] > 0
