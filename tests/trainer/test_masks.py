"""Masks, non-finite values and the entropy metric on the tiny model through the real trainer.

Pins (issue 47 items 2 and 4): a turn kept out of the loss (`train` False, not token-exact,
greedy, a sampling transform, a masked truncated turn) or an untrained trace changes nothing:
not the loss, not the gradient of any parameter, not the loss tokens' advantages, not the loss
metrics, whatever logprobs were recorded for it (NaN, ±inf, 1e30); a NaN/±inf recorded logprob
in a trained slot is dropped and counted (`nonfinite_tokens`), exactly as if that token were
masked; a NaN reward drops its rollout from the group (`nonfinite_rewards`). Entropy (CASES.md
C25): `entropy_mean` equals a numpy computation from a plain forward's logits at the sampling
temperature over exactly the loss tokens, per domain too, and is unchanged by extra context,
row splitting (micro-batching), packing without merging, prefix merging and chunking; the toy
C25 case by hand; `EntropyWatch` warns once per 10 steps and counts.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forgerl.metrics import EntropyWatch, agent_summary
from forgerl.models import build_tiny_model
from forgerl.trainer.trainer import Trainer
from forgerl.trainer.tree_forward import entropy_of
from forgerl.types import Group, SamplingParams
from tests.factories import completion, trajectory

T = 0.7
P = [1, 80, 90, 100, 2, 13, 1, 70]
INS = [2, 13, 1, 60, 61, 2, 13, 1, 70]
LOSS_KEYS = ("loss", "ratio_mean", "ratio_max", "clip_frac", "num_loss_tokens",
             "advantage_abs_mean", "entropy_mean", "nonfinite_tokens", "reward_mean",
             "token_off_policy_lag_mean", "token_off_policy_lag_max", "num_samples")
MODEL = build_tiny_model()


def _groups(extra=None, extra_traj=None, reward_b=0.0):
    """One group: "a" (two turns, reward 1), "b" (one turn, `reward_b`), "c" (reward 0.5);
    `extra` is appended to "a" as its last turn, `extra_traj` joins the group."""
    a1 = completion(P, [40, 41, 2], [-1.0, -2.0, -0.5], temperature=T)
    a2 = completion([*P, 40, 41, 2, *INS], [44, 45, 2], [-0.3, -1.2, -0.9], temperature=T)
    turns = [a1, a2] + ([extra] if extra is not None else [])
    trajs = [trajectory("a", turns, 1.0),
             trajectory("b", [completion(P, [50, 2], [-2.0, -0.1], temperature=T)], reward_b),
             trajectory("c", [completion(P, [40, 52, 2], [-1.0, -0.7, -0.2],
                                         temperature=T)], 0.5)]
    return [Group(0, trajs + ([extra_traj] if extra_traj is not None else []))]


def _measure(groups, **kwargs):
    """(metrics of the loss forward/backward, {param: grad}, loss tokens' advantages) without
    an optimizer step."""
    trainer = Trainer(MODEL, device="cpu", **kwargs)
    batch = trainer.prepare(groups)
    metrics = dict(batch.metrics)
    metrics |= trainer.accumulate_gradients(batch)
    metrics |= trainer._entropy_metrics(batch)
    grads = {n: p.grad.clone() for n, p in MODEL.named_parameters() if p.grad is not None}
    MODEL.zero_grad(set_to_none=True)
    mask = torch.tensor([m for s in batch.samples for m in s.loss_mask], dtype=torch.bool)
    return metrics, grads, batch.advantages[mask].tolist()


def _same(got, ref):
    m, g, a = got
    rm, rg, ra = ref
    assert a == ra  # the group's baseline, hence every advantage, is untouched
    assert {k: m[k] for k in LOSS_KEYS} == pytest.approx({k: rm[k] for k in LOSS_KEYS},
                                                         rel=1e-5, abs=1e-7)
    assert g.keys() == rg.keys()
    for name in g:
        torch.testing.assert_close(g[name], rg[name], rtol=1e-5, atol=1e-7)


ANY_LOGPROB = st.one_of(st.floats(-20, 0), st.sampled_from(
    [math.nan, math.inf, -math.inf, 1e30, -1e30, 3e38, -3e38]))
EXCLUDED = ["untrained", "not_token_exact", "greedy", "top_k", "truncated_masked",
            "untrained_trace"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(EXCLUDED), ids=st.lists(st.integers(3, 250), min_size=1, max_size=4),
       data=st.data())
def test_an_excluded_turn_changes_nothing_whatever_its_logprobs(kind, ids, data):
    logprobs = data.draw(st.lists(ANY_LOGPROB, min_size=len(ids), max_size=len(ids)))
    prompt = [*P, 40, 41, 2, *INS, 44, 45, 2, *INS]  # extends "a"'s sample: context after it
    turn = completion(prompt, ids, logprobs, temperature=T)
    kwargs = {}
    extra_traj = None
    if kind == "untrained":
        turn = replace(turn, train=False)
    elif kind == "not_token_exact":
        turn = replace(turn, token_exact=False)
    elif kind == "greedy":
        turn = replace(turn, sampling=SamplingParams(temperature=0.0))
    elif kind == "top_k":
        turn = replace(turn, sampling=SamplingParams(temperature=T, top_k=5))
    elif kind == "truncated_masked":
        turn, kwargs = replace(turn, finish_reason="length"), {"mask_truncated": True}
    else:  # a second trace (a title call) with no trained turn: no sample at all
        turn = replace(turn, prompt_ids=[1, 99, 2], trace=1, train=False)
    ref = _measure(_groups(), **kwargs)
    _same(_measure(_groups(extra=turn, extra_traj=extra_traj), **kwargs), ref)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_recorded_logprob_is_dropped_like_a_masked_token(bad):
    # before: the NaN reached the loss, the step raised NonFiniteStep and was lost
    groups = _groups()
    turn = groups[0].trajectories[0].completions[1]
    broken = replace(turn, logprobs=[turn.logprobs[0], bad, turn.logprobs[2]])
    groups[0].trajectories[0].completions[1] = broken
    got = _measure(groups)
    # reference: the same batch with that one token's loss mask set to 0 by hand
    trainer = Trainer(MODEL, device="cpu")
    samples = trainer.prepare(_groups()).samples
    t = len(P) + 3 + len(INS) + 1  # "a"'s sample: the second token of turn 2
    assert samples[0].trajectory_id == "a" and samples[0].input_ids[t] == 45
    samples[0].loss_mask[t] = 0
    batch = trainer.pack(samples, {})
    metrics = batch.metrics | trainer.accumulate_gradients(batch)
    metrics |= trainer._entropy_metrics(batch)
    grads = {n: p.grad.clone() for n, p in MODEL.named_parameters() if p.grad is not None}
    MODEL.zero_grad(set_to_none=True)
    assert got[0]["nonfinite_tokens"] == 1.0 and metrics["nonfinite_tokens"] == 0.0
    keys = [k for k in LOSS_KEYS if k not in ("nonfinite_tokens", "reward_mean")]
    assert {k: got[0][k] for k in keys} == pytest.approx({k: metrics[k] for k in keys},
                                                         rel=1e-6)
    for name, g in got[1].items():
        torch.testing.assert_close(g, grads[name], rtol=1e-6, atol=1e-8)
    step = Trainer(build_tiny_model(), device="cpu").train_step(groups)  # the step goes on
    assert math.isfinite(step["loss"]) and math.isfinite(step["grad_norm"])
    assert step["nonfinite_tokens"] == 1.0


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nonfinite_reward_drops_its_rollout_and_is_counted(bad):
    # before: group_advantages raised ValueError and the whole step failed
    groups = _groups(extra_traj=trajectory(
        "x", [completion(P, [77, 2], [-1.0, -1.0], temperature=T)], bad))
    got = _measure(groups)
    assert got[0]["nonfinite_rewards"] == 1.0
    ref = _measure(_groups())
    assert ref[0]["nonfinite_rewards"] == 0.0
    _same(got, ref)


# --- entropy (CASES.md C25) -------------------------------------------------------------------


def _np_entropy(logits, temperature):
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    return -(p * np.log(p)).sum(-1)


def test_c25_toy_logits_by_hand():
    # 7 positions of toy logits over 4 ids, loss on positions 1-3
    logits = [[0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 0.0, -1.0], [0.5, 0.5, 3.0, 0.0],
              [1.0, 1.0, 1.0, 4.0], [9.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [5.0, 5.0, 0, 0]]
    loss = [1, 2, 3]
    t1 = _np_entropy([logits[i] for i in loss], 1.0).mean()
    t05 = _np_entropy([logits[i] for i in loss], 0.5).mean()
    # by hand (pure-Python math): per row 0.947537, 0.655011, 0.529061 at T = 1 and
    # 0.455429, 0.096789, 0.051697 at T = 0.5
    assert t1 == pytest.approx((0.947537 + 0.655011 + 0.529061) / 3, abs=1e-6)  # 0.710536
    assert t05 == pytest.approx((0.455429 + 0.096789 + 0.051697) / 3, abs=1e-6)  # 0.201305
    lp = torch.log_softmax(torch.tensor(logits)[loss], -1)
    assert entropy_of(lp).mean().item() == pytest.approx(t1, abs=1e-6)
    lp05 = torch.log_softmax(torch.tensor(logits)[loss] / 0.5, -1)
    assert entropy_of(lp05).mean().item() == pytest.approx(t05, abs=1e-6)
    # never negative, and p = 0 (-inf log-prob) adds 0, not NaN
    peaked = torch.log_softmax(torch.tensor([[0.0, -float("inf"), -1e9]]), -1)
    assert entropy_of(peaked).tolist() == [0.0]


def _reference_entropy(groups, domain_of=None):
    """numpy: per loss token, the entropy at its temperature of a plain causal forward's
    logits at the position before it; mean overall and per domain."""
    trainer = Trainer(MODEL, device="cpu")
    samples = trainer.prepare(groups).samples
    per: dict[str, list[float]] = {}
    for s in samples:
        with torch.no_grad():
            logits = MODEL(input_ids=torch.tensor([s.input_ids])).logits[0].double().numpy()
        for t, m in enumerate(s.loss_mask):
            if m:
                h = _np_entropy(logits[t - 1], s.temperatures[t])
                per.setdefault(domain_of(s.task_index) if domain_of else "", []).append(h)
    every = [h for hs in per.values() for h in hs]
    return sum(every) / len(every), {d: sum(h) / len(h) for d, h in per.items()}


def _two_domain_groups():
    g0 = _groups()[0]
    q = [1, 81, 91, 2, 13, 1, 70]
    g1 = Group(1, [trajectory("e", [completion(q, [30, 31, 2], [-1.0] * 3, temperature=1.0)],
                              1.0, task=1),
                   trajectory("f", [completion(q, [30, 2], [-1.0] * 2, temperature=1.0)], 0.0,
                              task=1)])
    return [g0, g1]


@pytest.mark.parametrize("kwargs", [
    {}, {"merge_prefixes": False}, {"max_row_tokens": 24}, {"logprob_chunk_tokens": 0},
    {"logprob_chunk_tokens": 3, "max_row_tokens": 24},
])
def test_entropy_over_exactly_the_loss_tokens_per_domain(kwargs):
    # packing, merging, micro-batching (rows of 24 tokens) and chunking change nothing
    groups = _two_domain_groups()
    domain = {0: "math", 1: "code"}.get
    mean, per_domain = _reference_entropy(groups, domain)
    trainer = Trainer(MODEL, device="cpu", **kwargs)
    trainer.domain_of = domain
    batch = trainer.prepare(groups)
    trainer.accumulate_gradients(batch)
    MODEL.zero_grad(set_to_none=True)
    got = trainer._entropy_metrics(batch)
    assert got["entropy_mean"] == pytest.approx(mean, rel=1e-5)
    assert got["domain_math_entropy"] == pytest.approx(per_domain["math"], rel=1e-5)
    assert got["domain_code_entropy"] == pytest.approx(per_domain["code"], rel=1e-5)
    assert got["entropy_mean"] > 0


def test_entropy_in_a_full_step_and_on_the_progress_line():
    metrics = Trainer(build_tiny_model(), device="cpu").train_step(_groups())
    mean, _ = _reference_entropy(_groups())
    assert metrics["entropy_mean"] == pytest.approx(mean, rel=1e-5)
    assert agent_summary(metrics).endswith(f" entropy {metrics['entropy_mean']:.2f}")


def test_entropy_collapse_warning_once_per_10_steps_and_counted():
    warnings = []
    watch = EntropyWatch(floor=0.05, drop_factor=10.0, warn=warnings.append)
    step = {"num_loss_tokens": 5.0}
    for s, h in enumerate([1.0, 0.9, 1.1, 1.0, 1.0, 0.5, 0.11], start=1):
        assert watch.update(s, step | {"entropy_mean": h}) == {"entropy_collapse_steps": 0.0}
    assert watch.update(8, step | {"entropy_mean": 0.08}) == {"entropy_collapse_steps": 1.0}
    assert len(warnings) == 1 and "12x below the first steps' 1" in warnings[0]
    for s in range(9, 18):  # still collapsed, inside the 10-step window: counted, not warned
        watch.update(s, step | {"entropy_mean": 0.01})
    assert watch.collapsed_steps == 10 and len(warnings) == 1
    watch.update(18, step | {"entropy_mean": 0.01})
    assert len(warnings) == 2 and "below trainer.entropy_floor 0.05" in warnings[1]
    # a step without loss tokens neither counts nor enters the reference
    assert watch.update(19, {"num_loss_tokens": 0.0, "entropy_mean": 0.0}) == {
        "entropy_collapse_steps": 11.0}
