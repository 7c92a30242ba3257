"""Losses: CISPO (and PPO-clip / TIS for comparison) against hand computations.

Pins: the CISPO value and its gradient d loss / d policy_logprobs = -clip(r)·Â / N with ratios
inside and outside [1 - eps_low, 1 + eps_high]; no gradient through the clipped ratio; ratio
exactly 1 when policy == behavior (CASES.md C04's trainer side); and CASES.md C07: the token-mean
loss divides by the GLOBAL loss-token count, so accumulating micro-batches gives the same loss
and gradients as one pass. Property tests (hypothesis), for cispo, ppo_clip, tis (capped and
not) and nll alike: a token with a NaN/±inf policy logprob, behavior logprob or advantage is
dropped and counted (`nonfinite_tokens`): the loss, the gradient and the ratio statistics equal
those of the same batch without it, its own gradient is exactly 0; finite but extreme logprobs
(|log r| up to 6e38, exp overflow) keep the loss and gradient finite.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forgerl.trainer.losses import (
    LOG_RATIO_BOUND,
    cispo_loss,
    nll_loss,
    ppo_clip_loss,
    tis_loss,
)


def _leaf(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_cispo_value_and_gradient_by_hand():
    # ratios 0.5 (inside, eps_low=1 -> lower bound 0), 1.0, 2.0 (clipped to 1.28), 1.1 (inside)
    behavior = torch.tensor([-1.0, -2.0, -3.0, -0.5])
    ratios = [0.5, 1.0, 2.0, 1.1]
    policy = _leaf([b + math.log(r) for b, r in zip(behavior.tolist(), ratios, strict=True)])
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    n = 10  # global loss tokens, more than this call's 4
    loss, stats = cispo_loss(policy, behavior, adv, n)
    w = [0.5, 1.0, 1.28, 1.1]
    lp = policy.detach().tolist()
    expected = -sum(wi * ai * li for wi, ai, li in zip(w, adv.tolist(), lp, strict=True)) / n
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    grad = [-wi * ai / n for wi, ai in zip(w, adv.tolist(), strict=True)]
    assert policy.grad.tolist() == pytest.approx(grad, abs=1e-7)
    assert stats["ratio_max"] == pytest.approx(2.0, abs=1e-6)
    assert stats["ratio_mean"] == pytest.approx(sum(ratios) / 4, abs=1e-6)
    assert stats["clip_frac"] == 0.25
    assert stats["num_tokens"] == 4.0


def test_cispo_lower_bound_with_eps_low():
    behavior = torch.zeros(2)
    policy = _leaf([math.log(0.5), math.log(0.95)])
    adv = torch.tensor([1.0, 1.0])
    loss, stats = cispo_loss(policy, behavior, adv, 2, eps_low=0.2, eps_high=0.28)
    loss.backward()
    # 0.5 -> clipped up to 0.8; 0.95 inside
    assert policy.grad.tolist() == pytest.approx([-0.8 / 2, -0.95 / 2], abs=1e-7)
    assert stats["clip_frac"] == 0.5


def test_cispo_no_gradient_through_the_ratio():
    # Gradient of the loss equals that of -(const weight)·Â·logπ: the ratio's own derivative
    # (which would add -w·Â·logπ/N for unclipped tokens) must be absent.
    behavior = torch.tensor([-1.0])
    policy = _leaf([-1.0 + math.log(1.1)])  # unclipped ratio 1.1
    loss, _ = cispo_loss(policy, behavior, torch.tensor([2.0]), 1)
    loss.backward()
    assert policy.grad.item() == pytest.approx(-1.1 * 2.0, abs=1e-6)
    # A behavior tensor that requires grad gets none either: the ratio is detached.
    behavior2 = _leaf([-1.0])
    loss2, _ = cispo_loss(_leaf([-0.9]), behavior2, torch.tensor([2.0]), 1)
    loss2.backward()
    assert behavior2.grad is None or behavior2.grad.abs().item() == 0.0


def test_c04_ratio_is_one_when_policy_equals_behavior():
    logits = torch.tensor([2.0, 1.0, 0.0])
    lp = torch.log_softmax(logits / 0.5, dim=-1)[0]
    assert lp.item() == pytest.approx(-0.142932, abs=1e-6)
    _, stats = cispo_loss(lp.reshape(1).clone().requires_grad_(), lp.reshape(1), torch.ones(1), 1)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats["clip_frac"] == 0.0


def _c07_inputs():
    # A: 10 loss tokens, per-token loss -1·1·(-1) = 1.0 ; B: 2 tokens, -1·4·(-1) = 4.0 (ratio 1)
    pol = _leaf([-1.0] * 12)
    beh = torch.full((12,), -1.0)
    adv = torch.tensor([1.0] * 10 + [4.0] * 2)
    return pol, beh, adv


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_c07_global_token_mean_under_accumulation(micro_batch):
    pol_ref, beh, adv = _c07_inputs()
    ref, _ = cispo_loss(pol_ref, beh, adv, 12)
    ref.backward()
    assert ref.item() == pytest.approx(1.5, abs=1e-6)  # not (1.0 + 4.0) / 2 = 2.5

    pol, _, _ = _c07_inputs()
    sequences = [slice(0, 10), slice(10, 12)]
    n_global = 12  # known before the micro-batch loop
    total = 0.0
    for i in range(0, len(sequences), micro_batch):
        idx = torch.cat([torch.arange(12)[s] for s in sequences[i : i + micro_batch]])
        loss, _ = cispo_loss(pol[idx], beh[idx], adv[idx], n_global)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(1.5, abs=1e-6)
    assert torch.allclose(pol.grad, pol_ref.grad, atol=1e-6, rtol=0)
    assert pol.grad[0].item() == pytest.approx(-1 / 12, abs=1e-7)
    assert pol.grad[11].item() == pytest.approx(-4 / 12, abs=1e-7)


def test_ppo_clip_value_and_gradient():
    behavior = torch.zeros(3)
    policy = _leaf([math.log(1.5), math.log(0.5), math.log(1.1)])
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, stats = ppo_clip_loss(policy, behavior, adv, 3)
    # token 0: min(1.5, 1.28) = 1.28 (clipped, no grad); token 1: min(-0.5, -0.8) = -0.8
    # (clipped, no grad); token 2: 1.1 (grad = r·Â)
    assert loss.item() == pytest.approx(-(1.28 - 0.8 + 1.1) / 3, abs=1e-6)
    loss.backward()
    assert policy.grad.tolist() == pytest.approx([0.0, 0.0, -1.1 / 3], abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)


def test_tis_truncates_the_weight():
    behavior = torch.zeros(2)
    policy = _leaf([math.log(3.0), math.log(0.5)])
    adv = torch.tensor([1.0, 1.0])
    loss, stats = tis_loss(policy, behavior, adv, 2, tis_cap=2.0)
    loss.backward()
    assert policy.grad.tolist() == pytest.approx([-2.0 / 2, -0.5 / 2], abs=1e-6)
    assert stats["clip_frac"] == 0.5
    plain = _leaf([math.log(3.0), math.log(0.5)])
    loss, _ = tis_loss(plain, behavior, adv, 2, tis_cap=None)
    loss.backward()
    assert plain.grad.tolist() == pytest.approx([-3.0 / 2, -0.5 / 2], abs=1e-6)


def test_shape_and_normaliser_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="shapes"):
        cispo_loss(x, torch.zeros(2), x, 3)
    with pytest.raises(ValueError, match="num_loss_tokens"):
        cispo_loss(x, x, x, 0)


# --- Property tests: the non-finite rule (module docstring of losses.py), for every loss ------

LOSSES = {
    "cispo": cispo_loss,
    "ppo_clip": ppo_clip_loss,
    "tis": tis_loss,
    "tis_uncapped": partial(tis_loss, tis_cap=None),
    "nll": nll_loss,
}
NONFINITE = [math.nan, math.inf, -math.inf]
SANE = st.floats(-8.0, 0.0, width=32)  # a logprob a model gives
EXTREME = st.sampled_from([-1e30, 1e30, -3e38, 3e38, -88.0, 89.0, -1e4])  # finite, exp overflows
ADV = st.floats(-5.0, 5.0, width=32)


@st.composite
def batches(draw):
    """K kept tokens (finite) and D tokens with a NaN/±inf policy or behavior logprob or
    advantage, interleaved at random positions; N >= K + D."""
    k = draw(st.integers(0, 6))
    kept = [(draw(SANE), draw(st.one_of(SANE, EXTREME)), draw(ADV)) for _ in range(k)]
    bad = []
    for _ in range(draw(st.integers(1, 4))):
        slot = draw(st.integers(0, 2))
        row = [draw(st.one_of(SANE, EXTREME)), draw(st.one_of(SANE, EXTREME)), draw(ADV)]
        row[slot] = draw(st.sampled_from(NONFINITE))
        bad.append(tuple(row))
    order = draw(st.permutations(range(k + len(bad))))
    rows = [(kept + bad)[i] for i in order]
    is_bad = [i >= k for i in order]
    n = draw(st.integers(max(len(rows), 1), 20))
    return rows, is_bad, n


def _run(fn, rows, n):
    policy = _leaf([r[0] for r in rows])
    loss, stats = fn(policy, torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows]),
                     n)
    loss.backward()
    return loss, policy.grad, stats


@pytest.mark.parametrize("name", LOSSES)
@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_nonfinite_tokens_are_dropped_and_counted(name, batch):
    # The same loss, gradient and ratio statistics as the batch without those tokens (same N);
    # the dropped tokens get gradient exactly 0; everything stays finite (no 0·inf, no
    # exp(inf): masked before exp).
    rows, is_bad, n = batch
    fn = LOSSES[name]
    if name == "nll":  # ignores behavior logprobs and advantages: only its own logprob counts
        is_bad = [not math.isfinite(r[0]) for r in rows]
    loss, grad, stats = _run(fn, rows, n)
    kept_rows = [r for r, b in zip(rows, is_bad, strict=True) if not b]
    ref_loss, ref_grad, ref_stats = _run(fn, kept_rows, n)
    assert math.isfinite(loss.item()) and torch.isfinite(grad).all()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6, abs=1e-9)  # sum order
    assert grad[[not b for b in is_bad]].tolist() == ref_grad.tolist()
    assert grad[is_bad].tolist() == [0.0] * sum(is_bad)
    assert stats["nonfinite_tokens"] == sum(is_bad) and ref_stats["nonfinite_tokens"] == 0
    assert {k: v for k, v in stats.items() if k != "nonfinite_tokens"} == pytest.approx(
        {k: v for k, v in ref_stats.items() if k != "nonfinite_tokens"}, rel=1e-6)


@pytest.mark.parametrize("name", LOSSES)
@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.one_of(SANE, st.sampled_from([-1e4, -88.0])),
                               st.one_of(SANE, EXTREME), ADV), min_size=1, max_size=6))
def test_extreme_finite_logprobs_keep_loss_and_gradient_finite(name, rows):
    # behavior -1e30 with policy -1 is a log-ratio of 1e30: exp overflows unless the log-ratio
    # is bounded first (PPO-clip's ratio carries the gradient: inf · 0 = NaN in its backward).
    # Any recorded (behavior) value; policy logprobs as a model's log_softmax gives them (a
    # policy logprob near -3e38 times an advantage overflows the loss itself: NonFiniteStep).
    loss, grad, stats = _run(LOSSES[name], rows, len(rows))
    assert math.isfinite(loss.item()) and torch.isfinite(grad).all()
    assert stats["nonfinite_tokens"] == 0 and stats["num_tokens"] == len(rows)
    assert 0.0 <= stats["ratio_max"] <= math.exp(LOG_RATIO_BOUND) * (1 + 1e-6)


def test_ratio_bound_by_hand():
    # log-ratio 1e30 - ... is clamped to +20: CISPO weight min(e^20, 1.28) = 1.28; the ratio
    # statistic is e^20; below -20 the weight is e^-20 (eps_low = 1: lower clip 0).
    policy = _leaf([-1.0, -1.0])
    loss, stats = cispo_loss(policy, torch.tensor([-1e30, 1e30]), torch.tensor([1.0, 1.0]), 2)
    loss.backward()
    assert policy.grad.tolist() == pytest.approx([-1.28 / 2, -math.exp(-20) / 2], rel=1e-6)
    assert stats["ratio_max"] == pytest.approx(math.exp(20), rel=1e-6)
    assert stats["clip_frac"] == 0.5
