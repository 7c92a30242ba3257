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
    group_trajectory_advantages,
    reward_to_go,
    trajectory_advantages,
)
from forgerl.types import Completion, Group, Trajectory

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


def _traj(i: int, turns: int, reward: float | None, process=None, status="finished"):
    c = Completion([1], [2], [-0.1], [0], 0, "stop")
    return Trajectory(
        f"t{i}", 0, i, [c] * turns, reward=reward, turn_rewards=process, status=status
    )


def test_composite_rewards_reward_to_go_minus_group_mean_return():
    # returns: A = 0.2 + 0.0 + 1.0 = 1.2 ; B = 0.0 (outcome only, 1 turn) -> baseline 0.6
    a = _traj(0, 3, 1.0, process=[0.2, 0.0, 0.0])
    b = _traj(1, 1, 0.0)
    advs = trajectory_advantages([a, b])
    assert advs[0] == pytest.approx([0.6, 0.4, 0.4])
    assert advs[1] == pytest.approx([-0.6])
    normed = trajectory_advantages([a, b], normalize_std=True)
    std = float(np.std([1.2, 0.0], ddof=1))
    assert normed[0] == pytest.approx([0.6 / std, 0.4 / std, 0.4 / std])


def test_equal_outcome_group_gives_exact_zeros():
    advs = trajectory_advantages([_traj(0, 2, 0.1), _traj(1, 3, 0.1), _traj(2, 1, 0.1)])
    assert advs == [[0.0, 0.0], [0.0, 0.0, 0.0], [0.0]]


def test_failed_trajectories_are_left_out_unless_asked():
    g = Group(0, [_traj(0, 1, 1.0), _traj(1, 1, 0.0), _traj(2, 1, None, status="failed")])
    members = group_trajectory_advantages(g)
    assert [t.id for t, _ in members] == ["t0", "t1"]
    assert [a for _, a in members] == [[0.5], [-0.5]]
    with_failed = group_trajectory_advantages(g, train_failed=True)
    # the failed one has no reward: it counts as 0.0; baseline = 1/3
    assert [a[0] for _, a in with_failed] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
