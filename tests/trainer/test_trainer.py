"""Trainer on the tiny model: one RL step end to end, its loss, gradients and checkpoints.

Pins: the packed prefix-tree loss equals a naive per-sample computation (a separate plain causal
forward per sample, the same CISPO formula, the same global token count N) in value and in
gradients, with prefix merging on or off and with rows small enough to split the batch
(DESIGN.md "Prefix tree merging"; CASES.md C07 across rows); with behavior logprobs taken from
the unchanged model the ratio is 1 (CASES.md C04); a step changes every trained parameter;
groups without signal are skipped; failed rollouts stay out; off-policy lag is measured per
loss token; a checkpoint round-trips weights and optimizer state exactly (CASES.md C12's
trainer half); a step that raises leaves no gradients and the next step equals a fresh
trainer's (issue 9); `device` picks CUDA when present, the CPU path trains with sdpa, and on
CUDA (marker gpu) the tree rows use FlexAttention and weights sync to a CPU engine.
"""

from __future__ import annotations

import pytest
import torch

from forgerl.models import build_tiny_model, build_tiny_moe
from forgerl.trainer.attention import TREE_SDPA
from forgerl.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from forgerl.trainer.losses import cispo_loss
from forgerl.trainer.samples import trajectory_to_samples
from forgerl.trainer.trainer import NonFiniteStep, Trainer
from forgerl.types import Group
from tests.factories import completion, trajectory

IM_START, IM_END, NL = 1, 2, 13
P = [IM_START, 80, 90, 100, IM_END, NL, IM_START, 70]  # group 0's task prompt
Q = [IM_START, 81, 91, IM_END, NL, IM_START, 70]  # group 1's task prompt
INS = [IM_END, NL, IM_START, 60, 61, IM_END, NL, IM_START, 70]  # tool turn + next header
TEMPERATURE = 0.7


def _trainer(model, **kwargs):
    """A CPU trainer that drops failed rollouts (the hand values below leave "d" out)."""
    return Trainer(model, device="cpu", failed_reward=None, **kwargs)


def _model_logprobs(model, prompt, completion):
    """Logprobs of `completion` after `prompt` under `model` at TEMPERATURE (plain forward)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0] / TEMPERATURE
    lp = torch.log_softmax(logits, -1)
    n = len(prompt)
    return [lp[n - 1 + i, tok].item() for i, tok in enumerate(completion)]


def _turn(model, prompt, ids, version, shift):
    """A completion sampled at `version` and TEMPERATURE whose behavior logprobs are the model's
    own plus `shift` per token."""
    lps = [lp + shift[i % len(shift)] for i, lp in enumerate(_model_logprobs(model, prompt, ids))]
    return completion(prompt, ids, lps, [version] * len(ids), temperature=TEMPERATURE)


def make_groups(model, shift=(0.0,)):
    """Three groups: multi-turn extend + branch (task 0), process rewards (task 1), no signal."""
    a1 = _turn(model, P, [40, 41, IM_END], 0, shift)
    a2 = _turn(model, [*P, 40, 41, *INS], [44, 45, IM_END], 1, shift)
    c2_prompt = [*P[:4], 120, 121, NL, IM_START, 70]
    g0 = Group(
        0,
        [
            trajectory("a", [a1, a2], 1.0),
            trajectory("b", [_turn(model, P, [50, IM_END], 0, shift)], 0.0),
            trajectory(
                "c",
                [
                    _turn(model, P, [40, 52, 53, IM_END], 1, shift),
                    _turn(model, c2_prompt, [66, IM_END], 1, shift),
                ],
                0.5,
            ),
            trajectory("d", [_turn(model, P, [99, 98], 0, shift)], None, status="failed"),
        ],
    )
    g1 = Group(
        1,
        [
            trajectory("e", [_turn(model, Q, [30, 31, IM_END], 1, shift)], 1.0, task=1,
                       process=[0.2]),
            trajectory("f", [_turn(model, Q, [30, IM_END], 0, shift)], 0.0, task=1),
        ],
    )
    g2 = Group(
        2, [trajectory(x, [_turn(model, Q, [33, IM_END], 0, shift)], 1.0, task=2) for x in "gh"])
    return [g0, g1, g2]


# Hand-computed advantages: group 0 returns (1.0, 0.0, 0.5) -> baseline 0.5 ("d" failed, out);
# group 1 returns (0.2 + 1.0, 0.0) -> baseline 0.6; group 2 is constant -> skipped.
EXPECTED_ADVANTAGES = {"a": [0.5, 0.5], "b": [-0.5], "c": [0.0, 0.0], "e": [0.6], "f": [-0.6]}


def naive_loss(model, groups, eps_high=0.28):
    """Reference: one plain causal forward per sample, CISPO per token, divided by global N."""
    trajs = {t.id: t for g in groups for t in g.trajectories}
    samples = [
        s
        for tid, adv in EXPECTED_ADVANTAGES.items()
        for s in trajectory_to_samples(trajs[tid], adv)
    ]
    n_global = sum(sum(s.loss_mask) for s in samples)
    total = torch.zeros(())
    for s in samples:
        ids = torch.tensor([s.input_ids])
        logits = model(input_ids=ids).logits[0] / TEMPERATURE  # (T, V)
        lp = torch.log_softmax(logits, -1)
        t = torch.tensor([i for i, m in enumerate(s.loss_mask) if m])
        policy = lp[t - 1, ids[0, t]]
        loss, _ = cispo_loss(
            policy,
            torch.tensor(s.behavior_logprobs)[t],
            torch.tensor(s.advantages)[t],
            n_global,
            eps_high=eps_high,
        )
        total = total + loss
    return total, n_global


@pytest.mark.parametrize(("merge", "max_row_tokens"), [(True, 4096), (False, 4096), (True, 24)])
def test_packed_loss_and_grads_equal_naive_per_sample(merge, max_row_tokens):
    model = build_tiny_model()
    groups = make_groups(model, shift=(0.0, -0.6, 0.4, 0.1))  # ratios in and out of the clip
    trainer = _trainer(model, merge_prefixes=merge, max_row_tokens=max_row_tokens)
    batch = trainer.prepare(groups)
    metrics = trainer.accumulate_gradients(batch)
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    ref, n_global = naive_loss(model, groups)
    ref.backward()
    assert batch.num_loss_tokens == n_global == 3 + 3 + 2 + 4 + 2 + 3 + 2
    assert metrics["loss"] == pytest.approx(ref.item(), abs=1e-5)
    assert abs(ref.item()) > 1e-3  # a real signal, not 0 == 0
    assert metrics["clip_frac"] > 0.0
    for name, p in model.named_parameters():
        assert torch.allclose(packed_grads[name], p.grad, atol=1e-5, rtol=1e-4), name
    if max_row_tokens == 24:
        assert len(batch.tree.rows) > 1  # gradient accumulation over rows really happened
    before, after = batch.metrics["tokens_before_merge"], batch.metrics["tokens_after_merge"]
    assert before == 22 + 10 + 12 + 11 + 10 + 9  # the five trained trajectories' samples
    assert (after < before) if merge else (after == before)


def test_train_step_changes_every_parameter_and_reports_metrics():
    model = build_tiny_model()
    groups = make_groups(model)  # behavior == policy: every ratio is 1
    trainer = _trainer(model, lr=1e-3)
    trainer.step = 2  # as if resumed at weight_version 2
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = trainer.train_step(groups)
    for name, p in model.named_parameters():
        assert not torch.equal(before[name], p.detach()), f"{name} did not change"
    assert trainer.step == 3
    # C04 on the trainer side; behavior (plain forward) and policy (packed tree) logprobs come
    # from different computation paths, so the ratio is 1 within rounding (1e-5), not exactly
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["clip_frac"] == 0.0
    assert m["groups_skipped"] == 1.0
    assert m["num_loss_tokens"] == 19.0
    assert m["num_samples"] == 6.0
    assert (m["prefix_extensions"], m["prefix_branches"]) == (1.0, 1.0)
    # loss tokens by version: v0: a1 3, b 2, f 2 = 7 ; v1: a2 3, c 4+2, e 3 = 12
    assert m["token_off_policy_lag_mean"] == pytest.approx((7 * 2 + 12 * 1) / 19)
    assert m["token_off_policy_lag_max"] == 2.0
    # rewards of all scored trajectories: 1, 0, .5 | 1, 0 | 1, 1
    assert m["reward_mean"] == pytest.approx(4.5 / 7)
    # |Â| over loss tokens: a 6x0.5, b 2x0.5, c 6x0, e 3x0.6, f 2x0.6
    assert m["advantage_abs_mean"] == pytest.approx((3.0 + 1.0 + 1.8 + 1.2) / 19)
    assert m["grad_norm"] > 0.0 and m["tokens_per_second"] > 0.0
    sync = trainer.state_dict_for_sync()
    assert torch.equal(sync["model.norm.weight"], model.model.norm.weight.detach())
    assert not any(t.requires_grad for t in sync.values())


def test_step_without_signal_leaves_weights_and_version():
    model = build_tiny_model()
    trainer = _trainer(model, lr=1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = trainer.train_step([make_groups(model)[2]])
    assert trainer.step == 0
    assert (m["groups_skipped"], m["num_loss_tokens"], m["loss"]) == (1.0, 0.0, 0.0)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_checkpoint_round_trip(tmp_path):
    model = build_tiny_model()
    groups = make_groups(model, shift=(0.0, -0.3))
    trainer = _trainer(model, lr=1e-3)
    trainer.train_step(groups)
    first = save_checkpoint(tmp_path, model, trainer.optimizer, 1, {"cursor": 3})
    trainer.train_step(groups)
    path = save_checkpoint(tmp_path, model, trainer.optimizer, trainer.step, {"cursor": [5, 6]})
    assert latest_checkpoint(tmp_path) == path and path.name == "step_00000002"
    assert not first.exists()  # only the last complete checkpoint is kept
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [path.name]

    fresh = _trainer(build_tiny_model(seed=1), lr=1e-3)
    step, extra = load_checkpoint(path, fresh.model, fresh.optimizer)
    assert (step, extra) == (2, {"cursor": [5, 6]})
    for (name, a), b in zip(
        model.state_dict().items(), fresh.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    s_old, s_new = trainer.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert s_old["param_groups"] == s_new["param_groups"]
    for k, st in s_old["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(s_new["state"][k][key])), key
    # Same state → the next step is bit-identical.
    trainer.train_step(groups)
    fresh.step = step
    fresh.train_step(groups)
    for a, b in zip(model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_latest_checkpoint_empty_run(tmp_path):
    assert latest_checkpoint(tmp_path) is None


def test_failing_step_leaves_no_gradients_and_the_next_step_equals_a_fresh_one():
    model, fresh_model = build_tiny_model(), build_tiny_model()
    groups = make_groups(model, shift=(0.0, -0.3))
    calls = {"n": 0, "fail": True}

    def flaky_loss(*args):
        calls["n"] += 1
        if calls["fail"] and calls["n"] == 2:  # after row 1's backward has filled .grad
            raise RuntimeError("injected failure")
        return cispo_loss(*args)

    trainer = _trainer(model, lr=1e-3, loss_fn=flaky_loss, max_row_tokens=24)
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.train_step(groups)
    assert all(p.grad is None for p in model.parameters())
    assert trainer.step == 0 and not trainer.optimizer.state
    calls["fail"] = False
    fresh = _trainer(fresh_model, lr=1e-3, max_row_tokens=24)
    m, m_fresh = trainer.train_step(groups), fresh.train_step(groups)
    assert trainer.step == fresh.step == 1 and m["loss"] == m_fresh["loss"]
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_non_finite_step_changes_nothing():
    """Rewards of ±1e38 pass the scorer's finiteness check, but their advantages overflow the
    loss: the step raises NonFiniteStep and leaves weights, AdamW state, gradients and `step`
    as they were (before, AdamW wrote NaN into every weight and the run went on)."""
    model = build_tiny_model()
    trainer = _trainer(model, lr=1e-3)
    groups = make_groups(model)[:2]
    for group, reward in zip(groups, (1e38, -1e38), strict=True):
        group.trajectories[0].reward = reward
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(NonFiniteStep, match=r"step 1: the loss \(.*\) or the gradient norm"):
        trainer.train_step(groups)
    assert trainer.step == 0 and not trainer.optimizer.state
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_device_choice_and_cpu_attention():
    model = build_tiny_model()
    trainer = Trainer(model, device="auto", failed_reward=None)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert trainer.device.type == expected
    assert {p.device.type for p in model.parameters()} == {expected}
    if expected == "cpu":
        assert trainer.attn_implementation == TREE_SDPA  # block-sparse tree attention
        trainer.train_step(make_groups(model, shift=(0.0, -0.3)))
        assert model.config._attn_implementation == "sdpa"  # restored after the tree forwards
        with pytest.raises(ValueError, match=r"trainer\.device = 'cuda' but CUDA is not available"):
            Trainer(build_tiny_model(), device="cuda")
    with pytest.raises(ValueError, match="must be 'auto', 'cpu' or 'cuda', got 'tpu'"):
        Trainer(build_tiny_model(), device="tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_trainer_uses_flex_attention_and_syncs_to_a_cpu_engine():
    import asyncio

    from forgerl.engines.local import LocalEngine

    model = build_tiny_model()
    groups = make_groups(model)  # behavior logprobs from the CPU model: ratio 1
    trainer = Trainer(model, lr=1e-3, device="cuda", failed_reward=None)
    assert trainer.attn_implementation == "flex_attention"
    m = trainer.train_step(groups)
    assert trainer.step == 1 and m["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert model.config._attn_implementation == "sdpa"

    async def sync() -> dict[str, torch.Tensor]:
        engine = LocalEngine(build_tiny_model(seed=1), max_model_len=64, device="cpu")
        try:
            await engine.update_weights(trainer.state_dict_for_sync(), trainer.step)
            return engine.model.state_dict()
        finally:
            await engine.close()

    synced = asyncio.run(sync())
    for name, value in trainer.state_dict_for_sync().items():
        assert torch.equal(synced[name], value.cpu()), name


def test_moe_checkpoint_resumes(tmp_path):
    # transformers saves the tiny MoE's fused experts in Mixtral's per-expert on-disk layout;
    # loading must convert them back (a resumed tiny-moe run failed with "does not match")
    model, fresh = build_tiny_moe(), build_tiny_moe()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    path = save_checkpoint(tmp_path, model, torch.optim.AdamW(model.parameters()), 3, {"a": 1})
    assert load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters())) == (3, {"a": 1})
    saved, loaded = model.state_dict(), fresh.state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
