"""Speculative decoding in the local engine with an MTP drafter (forgerl/drafter.py,
forgerl/engines/local/speculative.py), and the drafter's online training and sync.

The tiny random Llama's next-token distributions are almost flat; `peaky` gives it an untied
LM head with sharper ones (a policy a drafter can learn), and `drafter` distils a
head on that policy's own samples (the warm start), so drafts are accepted often enough for
every branch of the verifier to run."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from forgerl.drafter import PREFIX, Drafter, drafter_loss, policy_samples, warm_start
from forgerl.engines.local import LocalEngine
from forgerl.engines.local.sampler import sampling_logprobs
from forgerl.engines.local.speculative import verify
from forgerl.models import build_tiny_model, build_tiny_moe
from forgerl.trainer.trainer import Trainer
from forgerl.trainer.weight_sync import WeightSync
from forgerl.types import Group, SamplingParams
from tests.factories import completion, trajectory

PROMPTS = [[3, 4, 5], [60, 61, 62, 63, 64, 65], [7], [100, 101, 102, 103]]


@pytest.fixture(scope="module")
def peaky():
    return build_tiny_model(head_std=0.25)


@pytest.fixture(scope="module")
def drafter(peaky):
    head = Drafter.for_model(peaky)
    kls = warm_start(head, peaky, policy_samples(peaky, 16, 48), steps=60)
    assert kls[-1] < kls[0] / 4  # the warm start learns
    return head


async def _generate(model, params: list[SamplingParams], k: int, head=None, prompts=PROMPTS,
                    engine_out: list | None = None):
    engine = LocalEngine(model, max_model_len=256, max_batch_size=4, drafter=head,
                         speculative_tokens=k)
    try:
        outs = await asyncio.gather(*(engine.generate(p, s)
                                      for p, s in zip(prompts, params, strict=True)))
        if engine_out is not None:
            engine_out.append(dict(engine.stats))
        return outs
    finally:
        await engine.close()


def test_rejection_sampling_gives_the_policy_distribution():
    """40 000 seeded rows of two drafts from q verified against p_0, p_1, p_2: the first
    emitted token's frequencies are p_0's (chi-square, 4 degrees of freedom, under the 0.1 %
    critical value 18.47), not q's (a statistic in the thousands), and so are the second's
    (p_1, after an accepted first draft or a resampled one alike); acceptance of the first
    draft is Σ min(p, q); greedy rows accept exactly the argmax."""
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.05, 0.1, 0.15, 0.2, 0.5],
                      [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3], [0.3, 0.3, 0.2, 0.1, 0.1]])
    n = 40_000
    torch.manual_seed(0)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True) for j in range(2)], 1)
    params = [SamplingParams(1.0)] * n
    tokens, logprobs, accepted = verify(p.log().expand(n, 3, 5), q.log().expand(n, 2, 5),
                                        drafts, params, [None] * n)

    def chi2(counts, dist):
        return float(((counts - counts.sum() * dist) ** 2 / (counts.sum() * dist)).sum())

    first = torch.bincount(tokens[:, 0], minlength=5).float()
    second = torch.bincount(tokens[accepted >= 1, 1], minlength=5).float()
    assert chi2(first, p[0]) < 18.47 and chi2(first, q[0]) > 1000
    assert chi2(second, p[1]) < 18.47
    assert float((accepted >= 1).float().mean()) == pytest.approx(
        float(torch.minimum(p[0], q[0]).sum()), abs=0.01)
    assert torch.allclose(logprobs[:, 0], p[0].log()[tokens[:, 0]])
    greedy, _, ok = verify(p.log()[None], q.log()[None], torch.tensor([[0, 1]]),
                           [SamplingParams(0.0)], [None])
    assert ok.tolist() == [1] and greedy[0, :2].tolist() == [0, 4]


def test_greedy_speculative_equals_plain_greedy(peaky, drafter):
    """Token for token and logprob for logprob (1e-5), four rows decoded together, with drafts
    accepted and rejected."""
    params = [SamplingParams(0.0, max_tokens=n) for n in (30, 24, 17, 40)]
    plain = asyncio.run(_generate(peaky, params, 0))
    stats: list = []
    spec = asyncio.run(_generate(peaky, params, 4, drafter, engine_out=stats))
    for a, b in zip(plain, spec, strict=True):
        assert b.completion_ids == a.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
        assert b.finish_reason == "length"
    s = stats[0]
    assert s["spec_steps"] > 0 and 0 < s["accepted_tokens"] < s["draft_tokens"]
    assert s["spec_tokens"] <= sum(len(o.completion_ids) for o in spec)


def test_sampled_logprobs_are_the_policys(peaky, drafter):
    """Seeded sampled rows with temperature, top_p, top_k and a repetition penalty: every
    recorded logprob equals the processed distribution of a teacher-forced forward over the
    prompt and the completion so far (1e-5), i.e. the policy's own (C04, C18)."""
    params = [SamplingParams(0.7, max_tokens=32, seed=1),
              SamplingParams(1.0, max_tokens=32, seed=2, top_p=0.9),
              SamplingParams(0.9, max_tokens=32, seed=3, top_k=20, repetition_penalty=1.2),
              SamplingParams(1.3, max_tokens=32, seed=4, min_p=0.05)]
    stats: list = []
    outs = asyncio.run(_generate(peaky, params, 3, drafter, engine_out=stats))
    assert stats[0]["accepted_tokens"] > 0
    for prompt, sp, out in zip(PROMPTS, params, outs, strict=True):
        ids = prompt + out.completion_ids
        with torch.no_grad():
            logits = peaky(torch.tensor([ids])).logits[0, len(prompt) - 1:-1]
        contexts = [(prompt, out.completion_ids[:t]) for t in range(len(out.completion_ids))]
        ref = sampling_logprobs(logits, [sp] * len(contexts), contexts)
        ref = ref.gather(1, torch.tensor(out.completion_ids)[:, None])[:, 0]
        assert torch.allclose(ref, torch.tensor(out.logprobs), atol=1e-5)


def test_stop_and_max_tokens_mid_draft(peaky, drafter):
    """A stop id met inside a draft ends the row there ("stop", the stop id last); max_tokens
    below the draft length ends it at max_tokens; a later request reusing the finished row's
    KV from the prefix cache (rejected columns masked out) continues exactly as plain decode."""
    (ref,) = asyncio.run(_generate(peaky, [SamplingParams(0.0, max_tokens=40)], 0,
                                   prompts=PROMPTS[:1]))
    stop = ref.completion_ids[9]
    cut = ref.completion_ids.index(stop)
    params = [SamplingParams(0.0, max_tokens=40, stop_token_ids=(stop,)),
              SamplingParams(0.0, max_tokens=2)]
    outs = asyncio.run(_generate(peaky, params, 4, drafter, prompts=[PROMPTS[0], PROMPTS[0]]))
    assert outs[0].completion_ids == ref.completion_ids[:cut + 1]
    assert outs[0].finish_reason == "stop"
    assert outs[1].completion_ids == ref.completion_ids[:2] and outs[1].finish_reason == "length"

    async def twice():
        engine = LocalEngine(peaky, max_model_len=256, drafter=drafter, speculative_tokens=4)
        try:
            first = await engine.generate(PROMPTS[0], SamplingParams(0.0, max_tokens=20))
            prompt = PROMPTS[0] + first.completion_ids
            second = await engine.generate(prompt, SamplingParams(0.0, max_tokens=20))
            return first, second, engine.stats["prefix_hit_tokens"]
        finally:
            await engine.close()

    first, second, hits = asyncio.run(twice())
    assert first.completion_ids + second.completion_ids == ref.completion_ids
    assert hits >= len(PROMPTS[0]) + 19  # the second prompt came from the cache


def _groups(outs, prompts, temperature) -> list[Group]:
    trajs = [trajectory(f"t{i}", [completion(p, o.completion_ids, o.logprobs,
                                             temperature=temperature)], reward=float(i % 2))
             for i, (p, o) in enumerate(zip(prompts, outs, strict=True))]
    return [Group(0, trajs)]


def test_trainer_ratio_one_and_policy_gradient_unchanged_with_drafter(peaky, drafter):
    """Rollouts decoded with speculation on, trained on unchanged weights: ratio 1 (1e-5).
    A trainer that also trains the drafter takes exactly the policy step of one that does not
    (same loss, bitwise-equal weights after the step), reports drafter metrics, and its drafter
    moved."""
    params = [SamplingParams(1.0, max_tokens=24, seed=s) for s in range(4)]
    outs = asyncio.run(_generate(peaky, params, 3, drafter, prompts=[PROMPTS[1]] * 4))
    groups = _groups(outs, [PROMPTS[1]] * 4, 1.0)
    plain = Trainer(copy.deepcopy(peaky), lr=1e-3, device="cpu")
    with_head = Trainer(copy.deepcopy(peaky), lr=1e-3, device="cpu")
    head = copy.deepcopy(drafter)
    with_head.attach_drafter(head, lr=1e-3, top_k=8)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    m_plain, m_head = plain.train_step(groups), with_head.train_step(groups)
    assert abs(m_plain["ratio_mean"] - 1) < 1e-5 and abs(m_plain["ratio_max"] - 1) < 1e-5
    assert m_head["loss"] == m_plain["loss"] and m_head["grad_norm"] == m_plain["grad_norm"]
    for (name, a), b in zip(plain.model.state_dict().items(),
                            with_head.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert "drafter_kl" not in m_plain and m_head["drafter_positions"] > 0
    assert m_head["drafter_kl"] > 0 and 0 <= m_head["drafter_top1"] <= 1
    assert any(not torch.equal(before[k], v) for k, v in head.state_dict().items())


def test_drafter_loss_is_zero_without_positions(peaky, drafter):
    hidden = torch.zeros(3, peaky.config.hidden_size)
    loss, stats = drafter_loss(drafter, peaky, hidden, torch.tensor([1, 2, 3]),
                               torch.tensor([-1, 0, 1]), torch.tensor([0]), 8)
    assert float(loss) == 0.0 and stats == {}


@pytest.mark.parametrize("kind", ["full", "delta"])
def test_drafter_weights_sync_with_the_policy(peaky, drafter, kind):
    """After each sync (full, then full or delta) the engine's drafter equals the trainer's,
    tensor for tensor, and an engine without a drafter refuses drafter tensors."""
    trainer = Trainer(copy.deepcopy(peaky), lr=1e-3, device="cpu")
    trainer.attach_drafter(copy.deepcopy(drafter), lr=1e-2)
    params = [SamplingParams(1.0, max_tokens=16, seed=s) for s in range(4)]

    async def main():
        engine = LocalEngine(peaky, max_model_len=256, drafter=Drafter.for_model(peaky, seed=5),
                             speculative_tokens=2)
        sync = WeightSync(engine, kind)
        try:
            await sync.sync(trainer.state_dict_for_sync(), trainer.step)
            kinds = []
            for _ in range(2):
                outs = await asyncio.gather(*(engine.generate(PROMPTS[1], p) for p in params))
                trainer.train_step(_groups(outs, [PROMPTS[1]] * 4, 1.0))
                kinds.append((await sync.sync(trainer.state_dict_for_sync(), trainer.step))["kind"])
            return engine.drafter.state_dict(), kinds
        finally:
            await engine.close()

    synced, kinds = asyncio.run(main())
    assert kinds == [kind, kind]
    mine = trainer.drafter.state_dict()
    assert synced.keys() == mine.keys()
    for name, value in mine.items():
        assert torch.equal(synced[name], value), name

    async def refused():
        bare = LocalEngine(peaky, max_model_len=64)
        try:
            await bare.update_weights(trainer.state_dict_for_sync(), 9)
        finally:
            await bare.close()

    with pytest.raises(ValueError, match="unknown keys.*" + PREFIX):
        asyncio.run(refused())


def test_speculative_tokens_needs_a_drafter_and_a_dense_model(peaky):
    with pytest.raises(ValueError, match="only with a drafter"):
        LocalEngine(peaky, speculative_tokens=2)
    moe = build_tiny_moe()
    with pytest.raises(ValueError, match="MoE"):
        LocalEngine(moe, drafter=Drafter.for_model(moe), speculative_tokens=2)


def test_controller_runs_speculative_engine_with_online_drafter(tmp_path):
    """[engine] speculative_tokens: the controller warm-starts a drafter, the engine drafts
    with it (spec steps run), a step trains it (drafter metrics), the sync hands it over and
    the checkpoint saves it."""
    from forgerl.controller import start_services
    from forgerl.trainer.checkpoint import latest_checkpoint, load_drafter
    from tests.test_controller import make_agent, tiny_config

    config = tiny_config(tmp_path / "run", "--engine.speculative_tokens", "2",
                         "--engine.drafter_warm_start_steps", "5")

    async def main():
        async with start_services(config, make_agent()) as s:
            s.admit()
            metrics = await s.train(await s.next_batch())
            await s.sync_weights()
            await s.checkpoint()
            mine = s.trainer.drafter.state_dict()
            theirs = s.engine.drafter.state_dict()
            saved = load_drafter(latest_checkpoint(config.run_dir))["weights"]
            return metrics, dict(s.engine.stats), all(
                torch.equal(mine[k], theirs[k]) and torch.equal(mine[k], saved[k]) for k in mine)

    metrics, stats, equal = asyncio.run(main())
    assert metrics["drafter_positions"] > 0 and metrics["drafter_kl"] == metrics["drafter_kl"]
    assert stats["spec_steps"] > 0 and stats["draft_tokens"] > 0
    assert equal


def test_speculative_config_needs_one_local_trainer(tmp_path):
    from forgerl.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match="speculative_tokens"):
        load_config(None, ["--run_dir", str(tmp_path), "--model.path", "tiny",
                           "--engine.speculative_tokens", "2", "--trainer.workers", "2"])


def test_stream_emits_every_accepted_token(peaky, drafter):
    """With speculation on, the stream yields one TokenEvent per emitted token (several per
    speculative step), equal to the final completion, ids and logprobs."""
    async def main():
        engine = LocalEngine(peaky, max_model_len=256, drafter=drafter, speculative_tokens=4)
        try:
            items = [item async for item in engine.stream(PROMPTS[1],
                                                          SamplingParams(0.0, max_tokens=30))]
            return items, dict(engine.stats)
        finally:
            await engine.close()

    items, stats = asyncio.run(main())
    *events, out = items
    assert [e.token_id for e in events] == out.completion_ids and len(events) == 30
    assert [e.logprob for e in events] == out.logprobs
    assert stats["accepted_tokens"] > 0 and stats["spec_steps"] < 29


GROUP_PROMPT = list(range(30, 54))  # 24 tokens: later rows of the group wait for the cache


def test_group_with_prefix_reuse_and_weight_update_mid_completion(peaky, drafter):
    """Four sampled rows sharing a prompt (later ones reuse its KV from the prefix cache) decode
    speculatively; a weight update (policy and drafter) arrives mid-completion and the rows are
    re-prefilled. Every token's logprob equals a teacher-forced forward under the weights of its
    weight_versions entry (1e-5), both versions occur in every row, drafts were accepted under
    each version, and the prefix cache served the group."""
    new_policy = copy.deepcopy(peaky)
    with torch.no_grad():
        for p in new_policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    update = dict(new_policy.state_dict())
    update |= {PREFIX + k: v + 0.01 for k, v in drafter.state_dict().items()}
    params = [SamplingParams(1.0, max_tokens=64, seed=10 + i, top_p=0.95) for i in range(4)]

    async def main():
        engine = LocalEngine(peaky, max_model_len=256, max_batch_size=4, drafter=drafter,
                             speculative_tokens=3)
        try:
            async def row(i: int):
                outs = []
                async for item in engine.stream(GROUP_PROMPT, params[i]):
                    outs.append(item)
                    if i == 0 and len(outs) == 6:
                        accepted = engine.stats["accepted_tokens"]
                        await engine.update_weights(update, 1)
                        stats.append(accepted)
                return outs[-1]
            stats: list = []
            outs = await asyncio.gather(*(row(i) for i in range(4)))
            return outs, stats[0], dict(engine.stats)
        finally:
            await engine.close()

    outs, accepted_before, stats = asyncio.run(main())
    assert 0 < accepted_before < stats["accepted_tokens"]
    assert stats["prefix_hit_tokens"] >= 3 * (len(GROUP_PROMPT) - 1)
    models = {0: peaky, 1: new_policy}
    for sp, out in zip(params, outs, strict=True):
        assert set(out.weight_versions) == {0, 1} and len(out.completion_ids) == 64
        assert out.weight_versions == sorted(out.weight_versions)
        ids = GROUP_PROMPT + out.completion_ids
        contexts = [(GROUP_PROMPT, out.completion_ids[:t]) for t in range(64)]
        for version, model in models.items():
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, len(GROUP_PROMPT) - 1:-1]
            ref = sampling_logprobs(logits, [sp] * 64, contexts)
            ref = ref.gather(1, torch.tensor(out.completion_ids)[:, None])[:, 0]
            mine = [t for t, v in enumerate(out.weight_versions) if v == version]
            got = torch.tensor(out.logprobs)[mine]
            assert torch.allclose(ref[mine], got, atol=1e-5), version


def test_cancelling_one_row_mid_draft(peaky, drafter):
    """Three greedy rows decode speculatively; the consumer of one leaves after 5 tokens (its
    row leaves the batch at the next step, in the middle of its drafts). The other two still
    equal plain greedy decoding, token for token (the rows that moved in the batch kept their
    KV), and the engine serves a new request afterwards, exactly too."""
    params = [SamplingParams(0.0, max_tokens=n) for n in (40, 40, 40)]
    plain = asyncio.run(_generate(peaky, params, 0, prompts=PROMPTS[:3]))

    async def main():
        engine = LocalEngine(peaky, max_model_len=256, max_batch_size=4, drafter=drafter,
                             speculative_tokens=4)
        try:
            async def cancelled():
                seen, stream = [], engine.stream(PROMPTS[1], params[1])
                async for item in stream:
                    seen.append(item)
                    if len(seen) == 5:
                        await stream.aclose()  # the consumer leaves: the row is cancelled
                        return seen, engine.stats["decode_rows"], engine.stats["decode_steps"]
            outs = await asyncio.gather(engine.generate(PROMPTS[0], params[0]), cancelled(),
                                        engine.generate(PROMPTS[2], params[2]))
            after = engine.stats["decode_rows"], engine.stats["decode_steps"]
            later = await engine.generate(PROMPTS[1], params[1])
            return outs, later, dict(engine.stats), after
        finally:
            await engine.close()

    (first, (seen, rows, steps), third), later, stats, after = asyncio.run(main())
    assert after[0] - rows <= 2 * (after[1] - steps) + 3  # it left at the next step
    assert first.completion_ids == plain[0].completion_ids
    assert third.completion_ids == plain[2].completion_ids
    assert [e.token_id for e in seen] == plain[1].completion_ids[:5]
    assert later.completion_ids == plain[1].completion_ids
    assert max(abs(x - y) for x, y in zip(later.logprobs, plain[1].logprobs, strict=True)) < 1e-5
    assert stats["accepted_tokens"] > 0 and stats["spec_steps"] > 0


def test_drafter_is_checkpointed_and_restored_without_warm_start(peaky, drafter, tmp_path):
    """A trained drafter (weights and AdamW state) is saved with the trainer's checkpoint; a
    resumed run's `_attach_drafter` restores it, tensor for tensor, instead of warm-starting a
    fresh head; a checkpoint without a drafter holds none (a fresh run warm-starts)."""
    from types import SimpleNamespace

    from forgerl.controller.startup import _attach_drafter
    from forgerl.trainer.checkpoint import latest_checkpoint, load_drafter, save_checkpoint

    trainer = Trainer(copy.deepcopy(peaky), lr=1e-3, device="cpu")
    trainer.attach_drafter(copy.deepcopy(drafter), lr=1e-3, top_k=8)
    params = [SamplingParams(1.0, max_tokens=16, seed=s) for s in range(4)]
    outs = asyncio.run(_generate(peaky, params, 2, drafter, prompts=[PROMPTS[1]] * 4))
    trainer.train_step(_groups(outs, [PROMPTS[1]] * 4, 1.0))
    run = tmp_path / "run"
    save_checkpoint(run, trainer.model, trainer.optimizer, trainer.step, {},
                    drafter=trainer.drafter_state())
    ec = SimpleNamespace(drafter_lr=1e-3, drafter_top_k=8, drafter_warm_start_steps=3)
    resumed = Trainer(copy.deepcopy(peaky), lr=1e-3, device="cpu")
    _attach_drafter(resumed, ec, run)
    for name, value in trainer.drafter.state_dict().items():
        assert torch.equal(resumed.drafter.state_dict()[name], value), name
    saved, restored = (t.drafter_optimizer.state_dict() for t in (trainer, resumed))
    assert saved["state"].keys() == restored["state"].keys() and saved["state"]
    for key, state in saved["state"].items():
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(restored["state"][key][field], state[field])

    bare = tmp_path / "bare"
    save_checkpoint(bare, trainer.model, trainer.optimizer, trainer.step, {})
    assert load_drafter(latest_checkpoint(bare)) is None
    fresh = Trainer(copy.deepcopy(peaky), lr=1e-3, device="cpu")
    _attach_drafter(fresh, ec, bare)
    untrained = Drafter.for_model(peaky)
    assert not torch.equal(fresh.drafter.proj.weight, untrained.proj.weight)  # warm-started
    assert not torch.equal(fresh.drafter.proj.weight, trainer.drafter.proj.weight)


def test_engine_forwards_leave_the_trainers_hidden_states_alone(peaky, drafter):
    """The controller attaches the drafter before it builds the engines, whose deepcopy of the
    model keeps the trainer's forward hook: an engine's forward (another thread, at any time)
    must not overwrite the hidden states the trainer's drafter loss reads (IndexError in
    drafter_loss with [engine] instances = 2)."""
    trainer = Trainer(copy.deepcopy(peaky), lr=1e-3, device="cpu")
    trainer.attach_drafter(copy.deepcopy(drafter), lr=1e-2)
    engine = LocalEngine(trainer.model, max_model_len=64, drafter=trainer.drafter,
                         speculative_tokens=2)
    with torch.no_grad():
        trainer.model(input_ids=torch.tensor([PROMPTS[1]]))
    mine = trainer._hidden
    assert mine is not None and mine.shape[:2] == (1, len(PROMPTS[1]))
    out = asyncio.run(engine.generate(PROMPTS[0], SamplingParams(1.0, max_tokens=6, seed=0)))
    asyncio.run(engine.close())
    assert len(out.completion_ids) == 6 and trainer._hidden is mine
