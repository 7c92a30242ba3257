"""Per-token sampling temperature in the trainer (issue 9, defect 1).

Pins: each trained token's policy logprob is log_softmax(logits / T_token)[token], where
T_token is the temperature its completion was sampled at (checked per token against a
float64 logsumexp written out by hand). A group whose rollouts the real LocalEngine sampled at
T = 0.5 and T = 1.3 on the tiny model (one rollout switching temperature between its two turns)
has policy/behavior ratio 1 within 1e-4 on unchanged weights, through the prefix tree and the
unmerged path; scoring the same tokens at one global T = 1, as the trainer used to, moves the
ratios by far more (the test's sensitivity). Greedy turns are counted and stay out of the loss.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch

from forgerl.engines.local import LocalEngine
from forgerl.trainer.prefix_tree import build_tree_batch
from forgerl.trainer.trainer import PreparedBatch, Trainer
from forgerl.trainer.tree_forward import forward_logprobs
from forgerl.types import Completion, Group, SamplingParams, Trajectory

RATIO_TOL = 1e-4  # engine (KV-cached decode) vs trainer (tree forward): fp32 rounding only
INS = [2, 16, 1, 60, 61, 2, 16, 1, 70]  # tool turn + next assistant header (byte ids)


async def _sample_group(model, prompt: list[int]) -> list[Trajectory]:
    """Four rollouts: two at T = 0.5, two at T = 1.3; rollout 0 has a second turn at T = 1.3."""
    engine = LocalEngine(model, max_model_len=256, max_batch_size=4)

    async def turn(ids: list[int], t: float, seed: int) -> Completion:
        params = SamplingParams(temperature=t, max_tokens=12, seed=seed)
        out = await engine.generate(ids, params)
        return Completion(
            ids,
            out.completion_ids,
            out.logprobs,
            out.weight_versions,
            0,
            out.finish_reason,
            sampling=params,
        )

    try:
        temps = [0.5, 0.5, 1.3, 1.3]
        firsts = await asyncio.gather(*(turn(prompt, t, i) for i, t in enumerate(temps)))
        second = await turn([*prompt, *firsts[0].completion_ids, *INS], 1.3, 7)
    finally:
        await engine.close()
    turns = [[firsts[0], second], *([c] for c in firsts[1:])]
    rewards = [1.0, 0.0, 0.5, 0.25]
    return [
        Trajectory(f"r{i}", 0, i, ts, reward=r, status="finished")
        for i, (ts, r) in enumerate(zip(turns, rewards, strict=True))
    ]


def _ratio_errors(trainer: Trainer, batch: PreparedBatch) -> torch.Tensor:
    """(N,) |policy/behavior - 1| over every loss token, from the trainer's own rows."""
    errors = []
    with torch.no_grad():
        for row in batch.tree.rows:
            flat = batch.offsets[row.sample_idx] + row.token_idx
            policy = forward_logprobs(trainer.model, row)
            errors.append((torch.exp(policy - batch.behavior_logprobs[flat]) - 1).abs())
    return torch.cat(errors)


@pytest.fixture(scope="module")
def two_temperature_group(tokenizer):
    from forgerl.models import build_tiny_model

    prompt = tokenizer.encode("<|im_start|>user\nName a prime.<|im_end|>\n<|im_start|>assistant\n")
    return asyncio.run(_sample_group(build_tiny_model(), prompt))


@pytest.mark.parametrize("merge", [True, False])
def test_group_sampled_at_two_temperatures_has_ratio_one(two_temperature_group, merge):
    from forgerl.models import build_tiny_model

    trainer = Trainer(build_tiny_model(), merge_prefixes=merge, device="cpu")
    group = Group(0, two_temperature_group)
    batch = trainer.prepare([group])
    temps = {
        t for s in batch.samples for t, m in zip(s.temperatures, s.loss_mask, strict=True) if m
    }
    assert temps == {0.5, 1.3}
    assert batch.num_loss_tokens == sum(
        len(c.completion_ids) for t in group.trajectories for c in t.completions
    )
    if merge:  # the four first turns share the prompt: first tokens share one pred_pos
        assert batch.metrics["tokens_after_merge"] < batch.metrics["tokens_before_merge"]
    errors = _ratio_errors(trainer, batch)
    assert errors.numel() == batch.num_loss_tokens
    assert errors.max().item() < RATIO_TOL
    metrics = trainer.accumulate_gradients(batch)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=RATIO_TOL)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=RATIO_TOL)
    assert metrics["clip_frac"] == 0.0

    # The old behavior: every token scored at one global T = 1.
    at_one = [
        dataclasses.replace(
            t,
            completions=[
                dataclasses.replace(c, sampling=SamplingParams(temperature=1.0))
                for c in t.completions
            ],
        )
        for t in group.trajectories
    ]
    assert _ratio_errors(trainer, trainer.prepare([Group(0, at_one)])).max().item() > 0.05


def test_per_token_logprobs_equal_hand_computed_tempered_softmax(tiny_model):
    a = [1, 40, 41, 42, 43, 44, 45]
    b = [1, 40, 41, 50, 51, 52]
    temps_a = [1.0, 1.0, 1.0, 0.5, 0.5, 1.3, 2.0]  # per token; a shares [1, 40, 41] with b
    temps_b = [1.0, 1.0, 1.0, 1.3, 0.7, 0.7]
    needed = [[t >= 3 for t in range(len(a))], [t >= 3 for t in range(len(b))]]
    batch = build_tree_batch([a, b], 64, needed=needed, temperatures=[temps_a, temps_b])
    (row,) = batch.rows
    assert row.temperature.tolist() == pytest.approx([0.5, 0.5, 1.3, 2.0, 1.3, 0.7, 0.7])
    with torch.no_grad():
        got = forward_logprobs(tiny_model, row).tolist()
        logits = {
            i: tiny_model(torch.tensor([s])).logits[0].double().tolist()
            for i, s in enumerate((a, b))
        }
    for k, (s, t) in enumerate(zip(row.sample_idx.tolist(), row.token_idx.tolist(), strict=True)):
        seq, temp = (a, temps_a) if s == 0 else (b, temps_b)
        z = [v / temp[t] for v in logits[s][t - 1]]  # logits predicting token t, over T_t
        top = max(z)
        expected = z[seq[t]] - top - math.log(sum(math.exp(v - top) for v in z))
        assert got[k] == pytest.approx(expected, abs=1e-5), (s, t)


def test_tree_refuses_a_needed_token_at_temperature_zero():
    with pytest.raises(ValueError, match=r"sequence 0 token 2: temperature 0\.0 is not > 0"):
        build_tree_batch([[1, 2, 3]], 8, temperatures=[[1.0, 1.0, 0.0]])
    with pytest.raises(ValueError, match="one value per token"):
        build_tree_batch([[1, 2, 3]], 8, temperatures=[[1.0]])


def test_greedy_turns_are_counted_and_never_trained(two_temperature_group):
    from forgerl.models import build_tiny_model

    trajs = list(two_temperature_group)
    greedy = dataclasses.replace(trajs[1].completions[0], sampling=SamplingParams(temperature=0))
    trajs[1] = dataclasses.replace(trajs[1], completions=[greedy])
    trainer = Trainer(build_tiny_model(), device="cpu")
    batch = trainer.prepare([Group(0, trajs)])
    assert batch.metrics["greedy_turns"] == 1.0
    assert batch.num_loss_tokens == sum(
        len(c.completion_ids) for t in trajs for c in t.completions
    ) - len(greedy.completion_ids)
    assert [s.trajectory_id for s in batch.samples] == ["r0", "r2", "r3"]
