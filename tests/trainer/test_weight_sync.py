"""Weight sync, full and delta (issue 13 item 3), on the tiny model with real AdamW steps.

Pins: after every one of 20 optimizer steps a delta-synced LocalEngine holds weights bitwise
equal to an engine given the trainer's fp32 state dict through `update_weights`, in fp32 and in
a bf16 engine copy, and greedy generation on both is identical; a delta against another version,
or against tampered weights at the right version, is refused and the sync falls back to full; a
corrupted delta (checksum mismatch) leaves the old weights and version; a delta that fails
half-way restores what it wrote; the encoding is sparse for few changes, dense for many, and
counts bit changes (-0.0 vs 0.0); tied tensors are sent once. The broadcast transport's
packing round-trips every dtype bitwise (each tensor 64-byte aligned, floats cast on request),
and a 3-rank gloo `weight_group` broadcasts a packed state dict to both receivers, apart from
any default process group, twice on the same store under two epochs.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import threading

import pytest
import torch

from forgerl.engines.local import LocalEngine
from forgerl.gateway.router import Router
from forgerl.trainer.weight_sync import WeightSync
from forgerl.types import SamplingParams
from forgerl.weights import (
    DeltaMismatch,
    WeightDelta,
    apply_delta,
    checksum,
    make_delta,
    pack,
    unique_tensors,
    unpack,
    weight_group,
)


def _optimizer_steps(model, lr: float):
    """Yield after each real AdamW step of a causal-LM loss on a fixed random batch."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 259, (4, 12), generator=gen)  # (B, T)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    while True:
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        yield


def _state(engine: LocalEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine._params.items()}


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        bits = [t[name].reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(*bits), name


async def _greedy(engine: LocalEngine):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    return await asyncio.gather(*(engine.generate(p, params) for p in ([5, 6, 7], [9, 10])))


@pytest.mark.parametrize(("dtype", "lr"), [(torch.float32, 1e-4), (torch.bfloat16, 1e-5)])
def test_twenty_deltas_equal_full_sync_and_generate_the_same(tiny_model, dtype, lr):
    asyncio.run(_twenty_deltas_equal_full_sync_and_generate_the_same(tiny_model, dtype, lr))


async def _twenty_deltas_equal_full_sync_and_generate_the_same(tiny_model, dtype, lr):
    model = tiny_model.train()
    # packed weights (fp32): both update kinds must rebuild the packed copies
    full = LocalEngine(model, max_model_len=64, dtype=dtype, prefix_cache_tokens=0,
                       packed_weights=True)
    delta = LocalEngine(model, max_model_len=64, dtype=dtype, prefix_cache_tokens=0,
                        packed_weights=True)
    sync = WeightSync(delta, "delta")
    steps = _optimizer_steps(model, lr)
    kinds, fractions, ratios = [], [], []
    full_bytes = sum(v.numel() * v.element_size() for v in unique_tensors(_state(full)).values())
    try:
        for version in range(1, 21):
            next(steps)
            weights = {k: v.detach() for k, v in model.state_dict().items()}
            await full.update_weights(weights, version)  # the engine casts fp32 → its dtype
            stats = await sync.sync(weights, version)
            kinds.append(stats["kind"])
            fractions.append(stats["changed_fraction"])
            ratios.append(stats["bytes"] / full_bytes)
            assert delta.weight_version == full.weight_version == version
            _assert_bitwise_equal(_state(delta), _state(full))
        assert kinds == ["full"] + ["delta"] * 19 and stats["fallbacks"] == 0
        assert math.isnan(fractions[0]) and all(0 < f <= 1 for f in fractions[1:])
        if dtype == torch.bfloat16:  # bf16 hides many small updates: a sparse, smaller payload
            assert max(fractions[1:]) < 0.5 and max(ratios[1:]) < 0.9
        a, b = await _greedy(full), await _greedy(delta)
        for x, y in zip(a, b, strict=True):
            assert x.completion_ids == y.completion_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-6
            assert x.weight_versions == y.weight_versions == [20] * len(x.completion_ids)
        # the updates reached the forward itself (fp32: the packed linears were rebuilt)
        fresh = LocalEngine(model, max_model_len=64, dtype=dtype, prefix_cache_tokens=0,
                            packed_weights=True)
        try:
            for x, y in zip(await _greedy(fresh), b, strict=True):
                assert x.completion_ids == y.completion_ids
                assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-6
        finally:
            await fresh.close()
    finally:
        await full.close()
        await delta.close()


def test_wrong_base_falls_back_to_full(tiny_model):
    asyncio.run(_wrong_base_falls_back_to_full(tiny_model))


async def _wrong_base_falls_back_to_full(tiny_model):
    model = tiny_model.train()
    engine = LocalEngine(model, max_model_len=64, prefix_cache_tokens=0)
    sync = WeightSync(engine, "delta")
    steps = _optimizer_steps(model, 1e-3)
    try:
        for version in (1, 2):
            next(steps)
            await sync.sync(model.state_dict(), version)
        assert sync.stats["kind"] == "delta"
        # Someone else published version 7: the delta's base (version 2) is not what it holds.
        await engine.update_weights(model.state_dict(), 7)
        next(steps)
        stats = await sync.sync(model.state_dict(), 8)
        assert stats["kind"] == "full" and stats["fallbacks"] == 1
        # Same version, different bits: the base checksum refuses the delta.
        name = "model.norm.weight"
        tampered = engine._params[name].clone()
        tampered[0] += 1.0
        await engine.update_weights({name: tampered}, 8)
        next(steps)
        stats = await sync.sync(model.state_dict(), 9)
        assert stats["kind"] == "full" and stats["fallbacks"] == 2
        trained = {k: v.detach() for k, v in model.state_dict().items()}
        _assert_bitwise_equal(_state(engine), trained)
        next(steps)
        assert (await sync.sync(model.state_dict(), 10))["kind"] == "delta"
        assert engine.weight_version == 10
    finally:
        await engine.close()


def test_corrupted_or_stale_delta_leaves_old_weights_and_version(tiny_model):
    asyncio.run(_corrupted_or_stale_delta_leaves_old_weights_and_version(tiny_model))


async def _corrupted_or_stale_delta_leaves_old_weights_and_version(tiny_model):
    model = tiny_model.train()
    engine = LocalEngine(model, max_model_len=64, prefix_cache_tokens=0)
    try:
        base = _state(engine)
        before = await _greedy(engine)
        next(_optimizer_steps(model, 1e-3))
        new = {k: v.detach().clone() for k, v in unique_tensors(model.state_dict()).items()}
        crcs = {k: checksum(v) for k, v in base.items()}
        good, _ = make_delta({k: base[k] for k in new}, crcs, new, 0)

        def corrupt(name, values=None, indices=None):
            tensors = dict(good.tensors)
            d = tensors[name]
            tensors[name] = type(d)(indices if indices is not None else d.indices,
                                    values if values is not None else d.values,
                                    d.base_crc, d.result_crc)
            return WeightDelta(good.base_version, tensors, good.changed, good.numel)

        name = "model.layers.1.mlp.down_proj.weight"
        values = good.tensors[name].values.clone()
        values[0] += 1.0
        bad = [corrupt(name, values=values), WeightDelta(5, good.tensors, 0, 0)]
        for delta in bad:
            with pytest.raises(DeltaMismatch):
                await engine.apply_delta(delta, 1)
            assert engine.weight_version == 0
            _assert_bitwise_equal(_state(engine), base)
        after = await _greedy(engine)
        assert [o.completion_ids for o in after] == [o.completion_ids for o in before]
        await engine.apply_delta(good, 1)
        assert engine.weight_version == 1
        _assert_bitwise_equal({k: v for k, v in _state(engine).items() if k in new}, new)
    finally:
        await engine.close()


def test_encoding_counts_bits_and_restores_on_failure():
    base = {"a": torch.zeros(1000), "b": torch.arange(8, dtype=torch.bfloat16)}
    new = {"a": base["a"].clone(), "b": base["b"].clone() + 1}
    new["a"][[3, 500]] = torch.tensor([-0.0, 2.0])  # -0.0 == 0.0 as floats, not as bits
    crcs = {k: checksum(v) for k, v in base.items()}
    delta, new_crcs = make_delta(base, crcs, new, 4)
    a, b = delta.tensors["a"], delta.tensors["b"]
    assert a.indices.tolist() == [3, 500] and a.indices.dtype == torch.int32
    assert b.indices is None and b.values.dtype == torch.bfloat16  # all changed: dense
    assert (delta.changed, delta.numel, delta.nbytes) == (10, 1008, 2 * 8 + 8 * 2)
    assert new_crcs == {k: checksum(v) for k, v in new.items()}
    params = {k: v.clone() for k, v in base.items()}
    apply_delta(params, delta, 4)
    _assert_bitwise_equal(params, new)
    # A failure half-way (an index out of range in the second tensor) restores the first.
    params = {k: v.clone() for k, v in base.items()}
    broken = WeightDelta(4, {"b": b, "a": type(a)(torch.tensor([3, 5000], dtype=torch.int32),
                                                  a.values, a.base_crc, a.result_crc)}, 0, 0)
    with pytest.raises(IndexError):
        apply_delta(params, broken, 4)
    _assert_bitwise_equal(params, base)
    swapped = WeightDelta(4, {"a": type(a)(a.indices.flip(0), a.values, a.base_crc,
                                            a.result_crc)}, 0, 0)
    with pytest.raises(DeltaMismatch, match="result checksum"):  # crc32 sees positions
        apply_delta(params, swapped, 4)
    _assert_bitwise_equal(params, base)
    with pytest.raises(DeltaMismatch):
        apply_delta(params, delta, 3)  # params hold version 4's base, not 3's


def test_deltas_through_a_router_reach_every_instance(tiny_model):
    asyncio.run(_deltas_through_a_router_reach_every_instance(tiny_model))


async def _deltas_through_a_router_reach_every_instance(tiny_model):
    """One delta per step goes to both bf16 instances of a Router; an instance at another
    version refuses it and the full sync that follows brings both to the trainer's weights;
    a Router with an instance that takes no deltas gets full syncs."""
    model = tiny_model.train()
    full = LocalEngine(model, max_model_len=64, dtype=torch.bfloat16, prefix_cache_tokens=0)
    router = Router([LocalEngine(model, max_model_len=64, dtype=torch.bfloat16,
                                 prefix_cache_tokens=0) for _ in range(2)], "round_robin")
    sync, steps, kinds = WeightSync(router, "delta"), _optimizer_steps(model, 1e-5), []
    try:
        assert router.weight_dtype == torch.bfloat16
        for version in range(1, 5):
            next(steps)
            weights = {k: v.detach() for k, v in model.state_dict().items()}
            await full.update_weights(weights, version)
            kinds.append((await sync.sync(weights, version))["kind"])
            assert router.weight_version == version
            for e in router.instances:
                assert e.weight_version == version
                _assert_bitwise_equal(_state(e), _state(full))
        assert kinds == ["full", "delta", "delta", "delta"]
        # instance 1 was given version 9 by someone else: it refuses the delta against 4
        await router.instances[1].update_weights(weights, 9)
        next(steps)
        weights = {k: v.detach() for k, v in model.state_dict().items()}
        await full.update_weights(weights, 5)
        stats = await sync.sync(weights, 5)
        assert stats["kind"] == "full" and stats["fallbacks"] == 1
        assert router.weight_version == 5 and [e.weight_version for e in router.instances] == [5, 5]
        for e in router.instances:
            _assert_bitwise_equal(_state(e), _state(full))
        outs = [await router.generate([5, 6, 7], SamplingParams(0.0, max_tokens=4))
                for _ in range(2)]  # round robin: one on each instance, same weights
        assert outs[0].completion_ids == outs[1].completion_ids
        assert outs[0].weight_versions == outs[1].weight_versions == [5] * 4
        next(steps)
        assert (await sync.sync(model.state_dict(), 6))["kind"] == "delta"
    finally:
        await full.close()
        await router.close()

    class FullOnly(LocalEngine):  # e.g. a vLLM instance: full weights only
        apply_delta = None

    mixed = Router([LocalEngine(model, max_model_len=64, dtype=torch.bfloat16),
                    FullOnly(model, max_model_len=64, dtype=torch.bfloat16)])
    try:
        assert mixed.weight_dtype is None
        with pytest.raises(DeltaMismatch, match="not every engine instance"):
            await mixed.apply_delta(WeightDelta(0, {}, 0, 0), 1)
        sync = WeightSync(mixed, "delta")
        for version in (1, 2):
            assert (await sync.sync(model.state_dict(), version))["kind"] == "full"
        assert sync.stats["fallbacks"] == 0 and mixed.weight_version == 2
    finally:
        await mixed.close()


def test_full_mode_and_engines_without_deltas(tiny_model):
    asyncio.run(_full_mode_and_engines_without_deltas(tiny_model))


async def _full_mode_and_engines_without_deltas(tiny_model):
    engine = LocalEngine(tiny_model, max_model_len=64, prefix_cache_tokens=0)
    try:
        weights = {k: v.detach() for k, v in tiny_model.state_dict().items()}
        stats = await WeightSync(engine, "full").sync(weights, 1)
        tied = tiny_model.lm_head.weight.numel() * 4
        assert stats["kind"] == "full" and math.isnan(stats["changed_fraction"])
        assert stats["bytes"] == sum(v.numel() * 4 for v in weights.values()) - tied
    finally:
        await engine.close()

    class PlainEngine:  # a RolloutEngine without apply_delta / weight_dtype
        def __init__(self):
            self.calls = []

        async def update_weights(self, state_dict, version):
            self.calls.append(version)

    plain = PlainEngine()
    sync = WeightSync(plain, "delta")
    for version in (1, 2):
        assert (await sync.sync(weights, version))["kind"] == "full"
    assert plain.calls == [1, 2]


def test_controller_syncs_with_the_configured_kind(tiny_model):
    """`Services.sync_weights` builds one WeightSync of `[trainer] weight_sync` and publishes
    trainer.step; its stats are what the step record gets as weight_sync_*."""
    from types import SimpleNamespace

    from forgerl.config import Config
    from forgerl.controller import Services

    async def main():
        engine = LocalEngine(tiny_model, max_model_len=64, prefix_cache_tokens=0)
        model = tiny_model.train()
        trainer = SimpleNamespace(step=0, state_dict_for_sync=lambda: model.state_dict())
        services = SimpleNamespace(engine=engine, trainer=trainer, weight_sync=None, policies={},
                                   config=Config(trainer={"weight_sync": "delta"}))
        steps = _optimizer_steps(model, 1e-3)
        try:
            for trainer.step in (1, 2):
                next(steps)
                await Services.sync_weights(services)
            assert services.weight_sync.kind == "delta" and engine.weight_version == 2
            assert services.weight_sync.stats["kind"] == "delta"
        finally:
            await engine.close()

    asyncio.run(main())


def test_pack_round_trips_bitwise_and_casts_only_floats():
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(3, 5, generator=gen), "ids": torch.arange(7),
               "h": torch.randn(2, 1, 3, generator=gen).to(torch.bfloat16),
               "neg0": torch.tensor([-0.0, float("nan")]), "empty": torch.empty(0, 4)}
    buffer, specs = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 64 * 4  # the empty tensor takes none
    assert [s[0] for s in specs] == list(tensors)
    for name, t in unpack(buffer, specs).items():
        assert t.dtype == tensors[name].dtype and t.shape == tensors[name].shape
        assert torch.equal(t.view(-1).view(torch.uint8), tensors[name].view(-1).view(torch.uint8))
    half, specs16 = pack(tensors, torch.bfloat16)
    got = unpack(half, specs16)
    assert got["ids"].dtype == torch.int64 and torch.equal(got["ids"], tensors["ids"])
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], tensors["w"].bfloat16())
    with pytest.raises(ValueError, match="256 bytes, its specs need 320"):
        unpack(buffer, [*specs16, ("x", "float32", (16,))])


def test_weight_group_broadcasts_a_packed_state_dict_to_every_rank():
    gen = torch.Generator().manual_seed(1)
    weights = {"a": torch.randn(4, 4, generator=gen), "b": torch.randn(9, generator=gen)}
    store = torch.distributed.TCPStore("127.0.0.1", 0, 3, True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=30))
    received: dict[tuple[int, int], dict] = {}

    def member(rank: int, epoch: int, specs: list) -> None:
        client = torch.distributed.TCPStore("127.0.0.1", store.port, 3, False,
                                            timeout=datetime.timedelta(seconds=30))
        group = weight_group(client, rank, 3, epoch, "gloo", 30.0)
        buffer = torch.empty(pack(weights)[0].numel(), dtype=torch.uint8)
        group.broadcast(buffer, 0).wait()
        received[rank, epoch] = {k: v.clone() for k, v in unpack(buffer, specs).items()}

    for epoch, scale in ((1, 1.0), (2, -2.0)):
        buffer, specs = pack({k: v * scale for k, v in weights.items()})
        threads = [threading.Thread(target=member, args=(r, epoch, specs)) for r in (1, 2)]
        for t in threads:
            t.start()
        group = weight_group(store, 0, 3, epoch, "gloo", 30.0)
        group.broadcast(buffer, 0).wait()
        for t in threads:
            t.join(30)
        for rank in (1, 2):
            for k, v in weights.items():
                assert torch.equal(received[rank, epoch][k], v * scale)
    assert not torch.distributed.is_initialized()
