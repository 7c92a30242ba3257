"""R3 routing replay on the tiny MoE: the trainer runs each token through the experts the
engine recorded (forgerl/trainer/routing_replay.py).

The engine samples with the model's own routers (init std 0.002: router logits near zero, so
near-ties are common and gate weights close to 1/top_k); the trainer's copy has its router
weights scaled elementwise by 1 + 3e-3·N(0, 1), everything else identical, which flips a few
routes. Without replay those flips move logprobs by about 1e-2; with replay the only difference
left is the perturbed gate weights over the same experts, under 1e-5.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model, build_tiny_moe, router_modules
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.routing_replay import replay_routes, routes_tensor
from forgerl.trainer.samples import TrainingSample, trajectory_to_samples_with_stats
from forgerl.trainer.trainer import Trainer
from forgerl.trainer.tree_forward import forward_logprobs
from forgerl.types import Routes, SamplingParams
from tests.factories import completion, trajectory

PROMPT = [1, 40, 41, 42, 43, 44, 9]
EPS = 3e-3


@pytest.fixture(scope="module")
def rollouts():
    """(model, prompts + completions, outputs): 12 completions of 96 tokens of prompts that
    share their first 7 tokens."""
    torch.set_num_threads(1)
    model = build_tiny_moe(router_std=0.002)

    async def run():
        engine = LocalEngine(model, max_model_len=512, device="cpu")
        try:
            return await asyncio.gather(*[engine.generate(
                [*PROMPT, 50 + i], SamplingParams(temperature=1.0, max_tokens=96, seed=i))
                for i in range(12)])
        finally:
            await engine.close()

    outs = asyncio.run(run())
    seqs = [[*PROMPT, 50 + i, *o.completion_ids] for i, o in enumerate(outs)]
    return model, seqs, outs


def perturbed(model: torch.nn.Module, eps: float = EPS) -> torch.nn.Module:
    """A copy of `model` whose router weights are scaled by (1 + eps·N(0, 1)) elementwise."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in router_modules(out):
            router.weight.mul_(1 + eps * torch.randn(router.weight.shape, generator=gen))
    return out


def own_routes(model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    """(len(seq), layers, top_k) the experts `model` itself picks over `seq`."""
    got: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, o: got.append(o[2]))
             for r in router_modules(model)]
    with torch.no_grad():
        model(input_ids=torch.tensor([seq]))
    for hook in hooks:
        hook.remove()
    return torch.stack(got, 1)


def tree_logprobs(model, seqs, outs, replay: bool) -> torch.Tensor:
    """Trainer logprobs of every completion token (sample order) over the merged prefix tree."""
    needed = [[t >= len(PROMPT) + 1 for t in range(len(s))] for s in seqs]
    routes = [routes_tensor(o.routed_experts) for o in outs] if replay else None
    parts = []
    with torch.no_grad():
        for row in build_tree_batch(seqs, 4096, needed=needed, routes=routes).rows:
            with replay_routes(model, row.routes) as n:
                assert n == (len(row.input_ids) - len(seqs) if replay else 0)  # leaves: no route
                parts.append(forward_logprobs(model, row))
    return torch.cat(parts)


def test_replay_removes_the_logprob_gap_of_flipped_routes(rollouts):
    model, seqs, outs = rollouts
    trainer_model = perturbed(model)
    recorded = [routes_tensor(o.routed_experts) for o in outs]
    flips = sum(int((own_routes(trainer_model, s[:-1]).sort(-1).values != r.sort(-1).values)
                    .any(-1).sum()) for s, r in zip(seqs, recorded, strict=True))
    assert flips >= 3  # the perturbation does flip routes (of 12 · 103 · 2 token-layers)
    behavior = torch.tensor([x for o in outs for x in o.logprobs])
    same = tree_logprobs(model, seqs, outs, replay=True)  # unperturbed: replay is a no-op
    assert (same - behavior).abs().max() <= 2e-6
    plain = tree_logprobs(trainer_model, seqs, outs, replay=False)
    replayed = tree_logprobs(trainer_model, seqs, outs, replay=True)
    assert (plain - behavior).abs().max() > 1e-3
    assert (replayed - behavior).abs().max() <= 1e-5
    ratio_plain, ratio_replay = (plain - behavior).exp(), (replayed - behavior).exp()
    assert (ratio_plain - 1).abs().max() > 1e-3
    assert (ratio_replay - 1).abs().max() <= 1e-5
    assert (ratio_replay - 1).abs().mean() < (ratio_plain - 1).abs().mean()


def _samples(seqs, outs) -> list[TrainingSample]:
    p = len(PROMPT) + 1
    return [TrainingSample(
        s, [0] * p + [1] * len(o.completion_ids), [0.0] * p + o.logprobs,
        [0.0] * p + [(-1.0) ** i * 0.5] * len(o.completion_ids),
        [-1] * p + o.weight_versions, temperatures=[1.0] * len(s), routes=o.routed_experts)
        for i, (s, o) in enumerate(zip(seqs, outs, strict=True))]


def _grads(trainer: Trainer, samples) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    batch = trainer.pack(samples, {})
    metrics = trainer.accumulate_gradients(batch)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads, metrics


def test_tree_step_with_replay_has_the_per_sample_gradients(rollouts):
    """Prefix-tree rows with replayed routes give the gradients of each sample run alone with
    its own record (merge off), router weights included; replay changes them."""
    model, seqs, outs = rollouts
    samples = _samples(seqs, outs)
    trainer = Trainer(perturbed(model), device="cpu", lr=1e-3)
    assert trainer.routing_replay
    tree, metrics = _grads(trainer, samples)
    assert metrics["replayed_tokens"] == sum(len(s) - 1 for s in seqs) - 11 * (len(PROMPT))
    trainer.merge_prefixes = False
    alone, metrics_alone = _grads(trainer, samples)
    assert metrics_alone["replayed_tokens"] == sum(len(s) - 1 for s in seqs)
    assert tree.keys() == alone.keys() and any("gate" in n for n in tree)
    for name in tree:
        scale = alone[name].abs().max().clamp(min=1e-6)
        assert ((tree[name] - alone[name]).abs().max() / scale) < 1e-4, name
    trainer.routing_replay = False
    own, _ = _grads(trainer, samples)
    assert max((own[n] - alone[n]).abs().max() / alone[n].abs().max().clamp(min=1e-6)
               for n in own) > 1e-3


def test_a_sample_takes_each_token_from_the_earliest_turn_that_fed_it():
    """Turn 2 extends turn 1: its record covers turn 1's tokens too, but those keep turn 1's
    routes; a turn without routes is counted and leaves its tokens to later records."""
    def rec(n: int, fill: int) -> Routes:
        return Routes(bytes([fill]) * (n * 2 * 2), 2, 2)

    t1 = completion([1, 2, 3], [4, 5])
    t1.routed_experts = rec(3 + 2 - 1, 1)  # 4 fed tokens
    t2 = completion([1, 2, 3, 4, 5, 6], [7, 8])
    t2.routed_experts = rec(6 + 2 - 1, 2)
    t3 = completion([1, 2, 3, 4, 5, 6, 7, 8, 9], [10])
    samples, stats = trajectory_to_samples_with_stats(
        trajectory("a", [t1, t2, t3], 1.0), [1.0, 1.0, 1.0])
    (sample,) = samples
    assert stats.unrouted_turns == 1
    ids = routes_tensor(sample.routes)
    assert ids.shape == (7, 2, 2)
    assert ids[:4].eq(1).all() and ids[4:].eq(2).all()


def test_shared_tree_nodes_take_the_first_record_and_dense_models_are_untouched():
    a, b = [1, 2, 3, 4], [1, 2, 5]
    ra = torch.zeros(4, 1, 2, dtype=torch.long)
    rb = torch.ones(3, 1, 2, dtype=torch.long)
    (row,) = build_tree_batch([a, b], 16, routes=[None, rb]).rows
    assert row.routes[:, 0, 0].tolist() == [1, 1, -1, -1, 1]  # 3, 4: a's only, it has none
    row_tokens = row.input_ids.tolist()
    assert row_tokens == [1, 2, 3, 4, 5]
    (row,) = build_tree_batch([a, b], 16, routes=[ra[:2], rb]).rows
    assert row.routes[:, 0, 0].tolist() == [0, 0, -1, -1, 1]
    (row,) = build_tree_batch([a, b], 16, routes=[ra, rb]).rows
    assert row.routes[:, 0, 0].tolist() == [0, 0, 0, 0, 1]
    dense = build_tiny_model()
    with replay_routes(dense, row.routes) as n:
        assert n == 0
    with pytest.raises(ValueError, match="do not fit"), replay_routes(
            build_tiny_moe(), torch.zeros(5, 3, 2, dtype=torch.long)):
        pass


def test_the_controller_trains_the_tiny_moe_with_replayed_routes(tmp_path):
    """Config → engine → gateway → pool → scheduler → trainer with model.path = "tiny-moe":
    every turn arrives with its routes, the steps replay them, weights sync back."""
    from forgerl.controller import start_services  # lazy: the whole app, only for this test
    from tests.test_controller import make_agent, tiny_config

    async def run():
        config = tiny_config(tmp_path / "run", "--model.path", "tiny-moe")
        async with start_services(config, make_agent()) as s:
            for step in range(2):
                s.admit()
                metrics = await s.train(await s.next_batch())
                await s.sync_weights()
                assert metrics["num_loss_tokens"] > 0 and metrics["unrouted_turns"] == 0
                assert metrics["replayed_tokens"] > 0
                if step == 0:  # on-policy (lag 0), same routes: every ratio is 1
                    assert metrics["token_off_policy_lag_max"] == 0
                    assert abs(metrics["ratio_max"] - 1) < 1e-5
            assert s.engine.weight_version == 2

    asyncio.run(run())


def test_replaying_a_models_own_routes_is_exact_in_each_family_normalisation():
    """Replaying the experts a model picks itself reproduces its forward (logits within 1e-6)
    for Mixtral (renormalised over the top-k) and Qwen2-MoE without norm_topk_prob (softmax
    weights as they are, beside its shared expert); other experts change the logits."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    qwen = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=259, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
        initializer_range=0.2)).eval()
    for model in (build_tiny_moe(), qwen):
        seq = [1, 5, 9, 33, 70, 4, 8, 200]
        own = own_routes(model, seq)
        with torch.no_grad():
            plain = model(input_ids=torch.tensor([seq])).logits
            with replay_routes(model, own) as n:
                same = model(input_ids=torch.tensor([seq])).logits
            with replay_routes(model, (own + 1) % own.max().add(1)):
                other = model(input_ids=torch.tensor([seq])).logits
        assert n == len(seq) and (same - plain).abs().max() <= 1e-6
        assert (other - plain).abs().max() > 1e-4
