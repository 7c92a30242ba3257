"""Advantages: group-mean baseline, std normalisation with a floor, reward-to-go over turns.

Pins CASES.md C08 (near-zero-variance groups must give exact, finite advantages: centring only,
no division by a vanishing std, zeros for constant or singleton groups) and DESIGN.md's
Â_t = Σ_{p≥t} r_p - B with B the group mean of total returns.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from forgerl.trainer.advantages import (
    group_advantages,
    group_members,
    reward_to_go,
    trajectory_advantages,
)
from forgerl.types import Group
from tests.factories import completion, trajectory

C08_REWARDS = np.array([0.35] * 7 + [0.0], dtype=np.float32).tolist()


def test_c08_centring_only():
    adv = group_advantages(C08_REWARDS)
    assert adv[:7] == pytest.approx([0.04375] * 7, abs=1e-6)
    assert adv[7] == pytest.approx(-0.30625, abs=1e-6)


def test_c08_std_normalisation_ddof1():
    adv = group_advantages(C08_REWARDS, normalize_std=True)
    assert adv[:7] == pytest.approx([0.353553] * 7, abs=1e-6)
    assert adv[7] == pytest.approx(-2.474874, abs=1e-6)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_c08_constant_and_singleton_groups_are_exact_zero(normalize_std):
    assert group_advantages([1.0, 1.0, 1.0, 1.0], normalize_std) == [0.0, 0.0, 0.0, 0.0]
    # 0.1 * 3 / 3 != 0.1 in floating point; a constant group must still be exactly zero.
    assert group_advantages([0.1, 0.1, 0.1], normalize_std) == [0.0, 0.0, 0.0]
    assert group_advantages([0.7], normalize_std) == [0.0]
    assert group_advantages([], normalize_std) == []


def test_std_below_floor_is_not_divided():
    rewards = [1.0, 1.0 + 1e-9]  # std ≈ 7e-10 < 1e-6
    adv = group_advantages(rewards, normalize_std=True)
    assert adv == pytest.approx([-5e-10, 5e-10], abs=1e-15)
    assert all(math.isfinite(a) for a in adv)


def test_non_finite_reward_raises():
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, float("nan")])


def test_reward_to_go_suffix_sums():
    assert reward_to_go([0.1, 0.0, 0.5, 1.0]) == pytest.approx([1.6, 1.5, 1.5, 1.0])
    assert reward_to_go([]) == []


TURN = completion([1], [2], [-0.1])  # every turn: one id, logprob -0.1


def test_composite_rewards_outcome_centred_on_group_process_per_position():
    # outcomes 1.0, 0.0 -> ±0.5 at every turn; process reward-to-go: A [0.2, 0, 0], B [0.0]:
    # turn 0 baseline 0.1 (both), turns 1-2 baseline 0.0 (A alone)
    a = trajectory("t0", [TURN] * 3, 1.0, process=[0.2, 0.0, 0.0])
    b = trajectory("t1", [TURN], 0.0, rollout=1)
    advs = trajectory_advantages([a, b])
    assert advs[0] == pytest.approx([0.6, 0.5, 0.5])
    assert advs[1] == pytest.approx([-0.6])
    normed = trajectory_advantages([a, b], normalize_std=True)
    std = float(np.std([1.2, 0.0], ddof=1))  # of the returns R = o + Σ p
    assert normed[0] == pytest.approx([0.6 / std, 0.5 / std, 0.5 / std])


def test_identical_trajectories_with_turn_rewards_get_exact_zeros():
    """Issue 9: four identical trajectories with per-turn rewards [1, 1, 1] got [0, -1, -2]
    (reward-to-go against the mean total return); a per-position baseline gives 0."""
    group = [trajectory(f"t{i}", [TURN] * 3, 0.0, rollout=i, process=[1.0, 1.0, 1.0])
             for i in range(4)]
    assert trajectory_advantages(group) == [[0.0, 0.0, 0.0]] * 4
    tenths = [trajectory(f"t{i}", [TURN] * 3, 0.1, rollout=i, process=[0.1, 0.1, 0.1])
              for i in range(3)]  # 0.1*3/3 != 0.1
    assert trajectory_advantages(tenths, normalize_std=True) == [[0.0, 0.0, 0.0]] * 3


def test_equal_outcome_group_gives_exact_zeros():
    advs = trajectory_advantages([trajectory("t0", [TURN] * 2, 0.1),
                                  trajectory("t1", [TURN] * 3, 0.1, rollout=1),
                                  trajectory("t2", [TURN], 0.1, rollout=2)])
    assert advs == [[0.0, 0.0], [0.0, 0.0, 0.0], [0.0]]


def group_trajectory_advantages(g, failed_reward=0.0):
    """The group's members (`group_members`) with their advantages, as the trainer pairs them."""
    members = group_members(g, failed_reward)
    advs = trajectory_advantages(members, failed_reward=failed_reward)
    return list(zip(members, advs, strict=True))


def test_a_finished_trajectory_without_model_calls_counts_in_the_baseline():
    """Issue 9: an agent that answered without calling the model (no completions) dropped its
    reward from the baseline (0 instead of 0.25 here). Rewards 1, 0, 0, 0: baseline 0.25."""
    g = Group(0, [trajectory("t0", [], 1.0), trajectory("t1", [TURN], 0.0, rollout=1),
                  trajectory("t2", [TURN] * 2, 0.0, rollout=2),
                  trajectory("t3", [TURN], 0.0, rollout=3)])
    members = group_trajectory_advantages(g)
    assert [a for _, a in members] == [[], [-0.25], [-0.25, -0.25], [-0.25]]


def test_failed_rollouts_count_with_a_penalty_or_are_dropped():
    """A failed (crashed, timed-out) rollout counts with the penalty outcome in the baseline and
    the loss, or is dropped from both; an aborted attempt (re-run) never counts."""
    g = Group(0, [trajectory("t0", [TURN], 1.0), trajectory("t1", [TURN], 0.0, rollout=1),
                  trajectory("t2", [TURN], None, rollout=2, status="failed"),
                  trajectory("t3", [TURN], None, rollout=3, status="aborted")])
    penalty = group_trajectory_advantages(g, failed_reward=0.0)  # the default
    assert [t.id for t, _ in penalty] == ["t0", "t1", "t2"]
    assert [a[0] for _, a in penalty] == pytest.approx([2 / 3, -1 / 3, -1 / 3])  # baseline 1/3
    harsh = group_trajectory_advantages(g, failed_reward=-1.0)  # baseline 0
    assert [a[0] for _, a in harsh] == pytest.approx([1.0, 0.0, -1.0])
    dropped = group_trajectory_advantages(g, failed_reward=None)
    assert [t.id for t, _ in dropped] == ["t0", "t1"]
    assert [a for _, a in dropped] == [[0.5], [-0.5]]
