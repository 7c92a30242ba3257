"""The local engine serves the tiny MoE (Mixtral) and records its routed experts (R3).

Routes are checked against the model's own forward over each prompt + completion (the
reference), with the prefix cache on (a group's shared prompt and a second turn are reused from
it, with the routes stored beside their KV) and off.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model, build_tiny_moe, router_modules
from forgerl.trainer.routing_replay import routes_tensor
from forgerl.types import SamplingParams

SYSTEM = [1, 7, 8, 9, 10] * 4  # a shared 20-token prefix
PROMPTS = [[*SYSTEM, 40, 41], [*SYSTEM, 50, 51, 52], [*SYSTEM, 60]]


def reference_routes(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """(len(ids), layers, top_k) experts of the model's own forward over `ids` alone."""
    got: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, o: got.append(o[2]))
             for r in router_modules(model)]
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(got, 1)


async def two_turns(engine: LocalEngine, batched: bool):
    """Turn 1 of each prompt, then turn 2 extending it; concurrently or one by one."""
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=i) for i in range(3)]

    async def run(prompts):
        if batched:
            return await asyncio.gather(*[engine.generate(p, s)
                                          for p, s in zip(prompts, params, strict=True)])
        return [await engine.generate(p, s) for p, s in zip(prompts, params, strict=True)]

    first = await run(PROMPTS)
    second_prompts = [p + o.completion_ids + [2, 1, 77]
                      for p, o in zip(PROMPTS, first, strict=True)]
    return list(zip(PROMPTS + second_prompts, first + await run(second_prompts), strict=True))


@pytest.mark.parametrize("cache", [0, 4096])
def test_routes_are_those_of_the_models_own_forward(cache):
    model = build_tiny_moe()

    async def main():
        engine = LocalEngine(model, max_model_len=256, device="cpu", prefix_cache_tokens=cache)
        try:
            return await two_turns(engine, batched=True), dict(engine.stats)
        finally:
            await engine.close()

    results, stats = asyncio.run(main())
    assert (stats["prefix_hit_tokens"] > 60) == bool(cache)  # the second turns reuse the first
    for prompt, out in results:
        fed = prompt + out.completion_ids[:-1]  # the last sampled token is never fed
        routes = out.routed_experts
        assert (len(routes), routes.layers, routes.top_k) == (len(fed), 2, 2)
        assert torch.equal(routes_tensor(routes), reference_routes(model, fed))


def test_batched_equals_alone_and_dense_models_record_no_routes():
    model = build_tiny_moe()

    async def main(m, batched):
        engine = LocalEngine(m, max_model_len=256, device="cpu", prefix_cache_tokens=4096)
        try:
            return await two_turns(engine, batched)
        finally:
            await engine.close()

    alone, batched = asyncio.run(main(model, False)), asyncio.run(main(model, True))
    for (_, a), (_, b) in zip(alone, batched, strict=True):
        assert a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
        assert a.routed_experts == b.routed_experts
    assert all(o.routed_experts is None for _, o in asyncio.run(main(build_tiny_model(), True)))


def test_a_weight_update_mid_completion_re_records_every_route():
    """After an update the row is re-prefilled under the new weights: its routes are then all
    the new model's (the KV every later token attends over), none of the old ones."""
    model, new_model = build_tiny_moe(), build_tiny_moe(seed=1)
    prompt = [1, 50, 51, 52]

    async def main():
        engine = LocalEngine(model, max_model_len=1024, device="cpu")
        try:
            task = asyncio.create_task(engine.generate(
                prompt, SamplingParams(temperature=1.0, max_tokens=200, seed=5)))
            while engine._batch is None or len(engine._batch.rows[0].completion_ids) < 3:
                await asyncio.sleep(0.001)
            await engine.update_weights(new_model.state_dict(), 1)
            return await task
        finally:
            await engine.close()

    out = asyncio.run(main())
    k = out.weight_versions.index(1)
    assert 3 <= k < len(out.completion_ids)
    fed = prompt + out.completion_ids[:-1]
    routes = routes_tensor(out.routed_experts)
    assert torch.equal(routes, reference_routes(new_model, fed))
    assert not torch.equal(routes, reference_routes(model, fed))
