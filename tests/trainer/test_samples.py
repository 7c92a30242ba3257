"""Trajectory → samples: loss masks, behavior logprobs and advantages per token.

Pins DESIGN.md's merging rule and CASES.md C01-C03 on the trainer side: a turn whose prompt
extends the previous prompt + completion joins the same sample, where the sampled end-of-turn id
(151645) keeps loss mask 1 and the inserted "\\n" (198), tool turn and next assistant header
(151644 77091 198) get mask 0; a rewritten context starts a new sample and is counted as a
branch; a turn that is not token-exact never enters the loss; every trained token carries its
turn's sampling temperature, and a greedy (temperature 0) turn is context only and counted
(issue 9), as is a turn sampled with top_p, top_k, min_p or a penalty (CASES.md C21). Ids are
Qwen-style ChatML.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from forgerl.trainer.samples import trajectory_to_samples, trajectory_to_samples_with_stats
from forgerl.types import SamplingParams
from tests.factories import completion, trajectory

IM_START, IM_END, NL, ASSISTANT, USER, TOOL = 151644, 151645, 198, 77091, 872, 14

P1 = [IM_START, USER, NL, 100, IM_END, NL, IM_START, ASSISTANT, NL]  # 9 ids
C1 = [10, 11, IM_END]
INSERT = [NL, IM_START, TOOL, NL, 42, IM_END, NL, IM_START, ASSISTANT, NL]  # 10 ids
P2 = P1 + C1 + INSERT
C2 = [20, IM_END]


def test_extending_turns_merge_into_one_sample():
    t1 = completion(P1, C1, [-0.5, -0.7, -0.1], [3, 3, 3])
    # version changed mid-completion (partial rollout)
    t2 = completion(P2, C2, [-0.2, -0.3], [4, 5])
    traj = trajectory("traj-a", [t1, t2], 1.0, task=5, rollout=1)
    samples, stats = trajectory_to_samples_with_stats(traj, [0.7, 0.5])
    assert (stats.extensions, stats.branches) == (1, 0)
    assert len(samples) == 1
    s = samples[0]
    assert s.input_ids == P1 + C1 + INSERT + C2
    assert s.loss_mask == [0] * 9 + [1, 1, 1] + [0] * 10 + [1, 1]
    assert s.behavior_logprobs == [0.0] * 9 + [-0.5, -0.7, -0.1] + [0.0] * 10 + [-0.2, -0.3]
    assert s.advantages == [0.0] * 9 + [0.7] * 3 + [0.0] * 10 + [0.5] * 2
    assert s.weight_versions == [-1] * 9 + [3, 3, 3] + [-1] * 10 + [4, 5]
    assert (s.task_index, s.trajectory_id) == (5, "traj-a")
    # C02 boundary: sampled end-of-turn trained, the separator and next header are not
    i = s.input_ids.index(IM_END, 9)
    assert s.input_ids[i : i + 3] == [IM_END, NL, IM_START]
    assert s.loss_mask[i : i + 3] == [1, 0, 0]
    # C03: the second completion directly follows the assistant header, which has mask 0
    assert s.input_ids[-5:-2] == [IM_START, ASSISTANT, NL] and s.loss_mask[-5:-2] == [0, 0, 0]


def test_rewritten_context_branches_into_a_new_sample():
    t1 = completion(P1, C1, [-0.5, -0.7, -0.1], [3, 3, 3])
    t2 = completion(P2, C2, [-0.2, -0.3], [4, 4])
    # turn 3: the agent summarised its context; shares P1[:3] but drops the first answer
    p3 = [IM_START, USER, NL, 101, IM_END, NL, IM_START, ASSISTANT, NL]
    t3 = completion(p3, [30, IM_END], [-0.9, -0.05], [4, 4])
    traj = trajectory("traj-a", [t1, t2, t3], 1.0, task=5, rollout=1)
    samples, stats = trajectory_to_samples_with_stats(traj, [0.7, 0.5, 0.25])
    assert (stats.extensions, stats.branches) == (1, 1)
    assert [s.input_ids for s in samples] == [P1 + C1 + INSERT + C2, [*p3, 30, IM_END]]
    b = samples[1]
    assert b.loss_mask == [0] * 9 + [1, 1]
    assert b.behavior_logprobs == [0.0] * 9 + [-0.9, -0.05]
    assert b.advantages == [0.0] * 9 + [0.25, 0.25]
    assert b.weight_versions == [-1] * 9 + [4, 4]


def test_prompt_equal_to_previous_prefix_but_shorter_is_a_branch():
    t1 = completion(P1, C1, [-0.5, -0.7, -0.1], [0, 0, 0])
    t2 = completion(P1 + C1[:2], [7], [-0.4], [0])  # ends before the previous completion's end
    traj = trajectory("traj-a", [t1, t2], 1.0, task=5, rollout=1)
    samples, stats = trajectory_to_samples_with_stats(traj, [1.0, 1.0])
    assert (stats.extensions, stats.branches) == (0, 1)
    assert samples[1].input_ids == [*P1, 10, 11, 7]
    assert samples[1].loss_mask == [0] * 11 + [1]


def test_non_token_exact_turn_contributes_only_mask_zero():
    t1 = completion(P1, C1, [-0.5, -0.7, -0.1], [3, 3, 3])
    # turn 2 came back as text and was re-encoded: ids kept for context, never trained
    t2 = completion(P2, [12, IM_END], [0.0, 0.0], [4, 4], token_exact=False)
    p3 = [*P2, 12, IM_END, *INSERT]
    t3 = completion(p3, [40, IM_END], [-1.0, -0.2], [4, 4])
    traj = trajectory("traj-a", [t1, t2, t3], 1.0, task=5, rollout=1)
    samples = trajectory_to_samples(traj, [0.3, 0.2, 0.1])
    assert len(samples) == 1
    s = samples[0]
    assert s.input_ids == [*p3, 40, IM_END]
    n1 = len(P1)
    assert s.loss_mask == [0] * n1 + [1] * 3 + [0] * 10 + [0, 0] + [0] * 10 + [1, 1]
    assert s.behavior_logprobs[n1 + 13 : n1 + 15] == [0.0, 0.0]
    assert s.advantages == [0.0] * n1 + [0.3] * 3 + [0.0] * 22 + [0.1] * 2
    assert 12 in s.input_ids and all(
        m == 0 for i, m in zip(s.input_ids, s.loss_mask, strict=True) if i == 12
    )


def test_first_position_is_never_trained():
    turn = completion([], [5, 6], [-0.1, -0.2], [0, 0])
    traj = trajectory("traj-a", [turn], 1.0, task=5, rollout=1)
    s = trajectory_to_samples(traj, [1.0])[0]
    assert s.loss_mask == [0, 1]
    assert s.behavior_logprobs == [0.0, -0.2]
    assert s.advantages == [0.0, 1.0]
    assert s.weight_versions == [-1, 0]


def test_advantage_count_must_match_turns():
    t1 = completion(P1, C1, [-0.5, -0.7, -0.1], [3, 3, 3])
    traj = trajectory("traj-a", [t1], 1.0, task=5, rollout=1)
    with pytest.raises(ValueError, match="1 turns"):
        trajectory_to_samples(traj, [0.1, 0.2])


def test_tokens_carry_their_turns_temperature_and_greedy_turns_are_context():
    t1 = completion(P1, C1, [-0.5, -0.7, -0.1], [3, 3, 3], temperature=0.5)
    t2 = completion(P2, C2, [-0.4, -0.3], [4, 4], temperature=1.3)
    p3 = [*P2, *C2, *INSERT]
    t3 = completion(p3, [40, IM_END], [-0.01, -0.02], [4, 4], temperature=0.0)  # greedy
    traj = trajectory("traj-a", [t1, t2, t3], 1.0, task=5, rollout=1)
    samples, stats = trajectory_to_samples_with_stats(traj, [0.3, 0.2, 0.1])
    (s,) = samples
    n1 = len(P1)
    assert s.input_ids == [*p3, 40, IM_END]
    assert s.temperatures == [1.0] * n1 + [0.5] * 3 + [1.0] * 10 + [1.3] * 2 + [1.0] * 12
    assert s.loss_mask == [0] * n1 + [1] * 3 + [0] * 10 + [1] * 2 + [0] * 12
    assert s.behavior_logprobs[-2:] == [0.0, 0.0] and s.advantages[-2:] == [0.0, 0.0]
    assert s.weight_versions[-2:] == [-1, -1]
    assert (stats.extensions, stats.branches, stats.greedy_turns) == (2, 0, 1)


@pytest.mark.parametrize("transform", [dict(top_p=0.9), dict(top_k=20), dict(min_p=0.05),
                                       dict(repetition_penalty=1.1), dict(presence_penalty=0.5),
                                       dict(frequency_penalty=-0.5)])
def test_turns_sampled_with_a_transform_are_context_and_counted(transform):
    """CASES.md C21: the trainer's log_softmax(logits / T) is not the distribution such a turn
    was sampled from, so it is context only; the explicit neutral values train as before."""
    neutral = dict(top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                   frequency_penalty=0.0)
    t1 = replace(completion(P1, C1, [-0.5, -0.7, -0.1]), sampling=SamplingParams(**neutral))
    t2 = replace(completion(P2, C2, [-0.2, -0.3]), sampling=SamplingParams(**transform))
    t3 = replace(completion([*P2, *C2, *INSERT], [40, IM_END], [-0.1, -0.2]),
                 sampling=SamplingParams(0.0, **transform))  # greedy: counted as greedy only
    traj = trajectory("traj-a", [t1, t2, t3], 1.0, task=5, rollout=1)
    (s,), stats = trajectory_to_samples_with_stats(traj, [0.3, 0.2, 0.1])
    assert s.loss_mask == [0] * 9 + [1] * 3 + [0] * 10 + [0] * 2 + [0] * 12
    assert s.behavior_logprobs == [0.0] * 9 + [-0.5, -0.7, -0.1] + [0.0] * 24
    assert (stats.extensions, stats.greedy_turns, stats.transformed_turns) == (2, 1, 1)
    untrusted = replace(t2, token_exact=False)  # not token-exact: context, counted as neither
    _, stats = trajectory_to_samples_with_stats(replace(traj, completions=[t1, untrusted]),
                                                [0.3, 0.2])
    assert (stats.greedy_turns, stats.transformed_turns) == (0, 0)
