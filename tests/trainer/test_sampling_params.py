"""Sampling parameters the trainer can account for (CASES.md C21, issue 46 item 4).

A group sampled by the real LocalEngine on the tiny model: two rollouts with every sampling
parameter spelled out at its neutral value, one with repetition_penalty 1.1 (a model's
generation_config default) and one with top_k 20 and top_p 0.9. The trainer keeps the last two
as context (counted in the step's `transformed_turns`) and trains the neutral ones with a
policy/behavior ratio of 1 within 1e-4 on unchanged weights. The fault, an engine sampling with
defaults the record does not show: the same turns recorded as plain T-only sampling are trained
and their ratios move away from 1 (the test's sensitivity).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from forgerl.engines.local import LocalEngine
from forgerl.models import build_tiny_model
from forgerl.trainer.trainer import Trainer
from forgerl.types import Completion, Group, SamplingParams, Trajectory
from tests.trainer.test_temperature import RATIO_TOL, _ratio_errors

NEUTRAL = dict(top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
               frequency_penalty=0.0)
ROLLOUTS = [NEUTRAL, NEUTRAL, dict(repetition_penalty=1.1), dict(top_k=20, top_p=0.9)]


async def _sample_group(prompt: list[int]) -> list[Trajectory]:
    engine = LocalEngine(build_tiny_model(), max_model_len=256, max_batch_size=4)

    async def turn(seed: int, extra: dict) -> Completion:
        params = SamplingParams(temperature=0.9, max_tokens=16, seed=seed, **extra)
        out = await engine.generate(prompt, params)
        return Completion(prompt, out.completion_ids, out.logprobs, out.weight_versions, 0,
                          out.finish_reason, sampling=params)

    try:
        turns = await asyncio.gather(*(turn(i, x) for i, x in enumerate(ROLLOUTS)))
    finally:
        await engine.close()
    return [Trajectory(f"r{i}", 0, i, [c], reward=float(i), status="finished")
            for i, c in enumerate(turns)]


@pytest.fixture(scope="module")
def group(tokenizer) -> Group:
    prompt = tokenizer.encode("<|im_start|>user\nName a prime.<|im_end|>\n<|im_start|>assistant\n")
    return Group(0, asyncio.run(_sample_group(prompt)))


def test_transformed_turns_are_context_and_neutral_ones_train_at_ratio_one(group):
    trainer = Trainer(build_tiny_model(), device="cpu")
    batch = trainer.prepare([group])
    assert batch.metrics["transformed_turns"] == 2.0 and batch.metrics["greedy_turns"] == 0.0
    lengths = [len(t.completions[0].completion_ids) for t in group.trajectories]
    assert batch.num_loss_tokens == lengths[0] + lengths[1]
    errors = _ratio_errors(trainer, batch)
    assert errors.numel() == batch.num_loss_tokens and errors.max().item() < RATIO_TOL
    metrics = trainer.accumulate_gradients(batch)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=RATIO_TOL)
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=RATIO_TOL)


@pytest.mark.parametrize(("rollout", "moved"), [(2, 1e-3), (3, 0.05)])
def test_the_fault_unrecorded_defaults_move_the_ratio(group, rollout, moved):
    # the tiny model's logits are small, so repetition_penalty 1.1 moves its ratios by ~3e-3
    # (30x the tolerance); top_k 20 with top_p 0.9 drops tokens and moves them by ~0.9
    traj = group.trajectories[rollout]
    plain = dataclasses.replace(traj, completions=[dataclasses.replace(
        c, sampling=SamplingParams(temperature=0.9)) for c in traj.completions])
    trainer = Trainer(build_tiny_model(), device="cpu")
    batch = trainer.prepare([Group(0, [*group.trajectories[:2], plain])])
    assert batch.metrics["transformed_turns"] == 0.0
    assert _ratio_errors(trainer, batch).max().item() > moved
