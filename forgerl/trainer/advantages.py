"""Advantages: group-mean baseline and reward-to-go over turns (pure Python, no torch).

Data flow: the trainer takes finished groups from the scheduler; this module turns each group's
rewards into one advantage per turn of each trajectory, which `samples.py` spreads over that
turn's completion tokens.

Formula (DESIGN.md "Advantage", Forge §4.1): a trajectory's per-turn rewards are its process
rewards (zero if absent) with the outcome reward added at the last turn, r_0 .. r_{T-1}; the
return is R = Σ_p r_p; the group baseline is B = mean_G(R); the advantage of turn t is
Â_t = Σ_{p≥t} r_p - B (reward-to-go minus baseline), optionally divided by the group's return
std (ddof=1) when that std is at least `std_floor`.
"""

from __future__ import annotations

import math
import statistics

from forgerl.types import Group, Trajectory


def group_advantages(
    rewards_G: list[float], normalize_std: bool = False, std_floor: float = 1e-6
) -> list[float]:
    """Group-mean-centred rewards, one per group member.

    Â_i = R_i - mean(R); with `normalize_std`, Â_i /= std(R, ddof=1) unless that std is below
    `std_floor` (near-constant groups are only centred, never blown up; CASES.md C08).
    A group of size 1, or one whose rewards are all equal, gives exactly 0.0 for every member.

    Raises ValueError on a non-finite reward.
    """
    if any(not math.isfinite(r) for r in rewards_G):
        raise ValueError(f"rewards must be finite, got {rewards_G}")
    if len(rewards_G) <= 1 or min(rewards_G) == max(rewards_G):
        return [0.0] * len(rewards_G)
    mean = statistics.fmean(rewards_G)
    centred = [r - mean for r in rewards_G]
    if not normalize_std:
        return centred
    std = statistics.stdev(rewards_G)
    return centred if std < std_floor else [a / std for a in centred]


def reward_to_go(turn_rewards: list[float]) -> list[float]:
    """Suffix sums: out[t] = Σ_{p≥t} turn_rewards[p] (same length; empty in, empty out)."""
    out = [0.0] * len(turn_rewards)
    acc = 0.0
    for t in range(len(turn_rewards) - 1, -1, -1):
        acc += turn_rewards[t]
        out[t] = acc
    return out


def turn_rewards(traj: Trajectory) -> list[float]:
    """Per-turn rewards of one trajectory: process rewards + the outcome reward at the last turn.

    A missing outcome reward (None: unscored, e.g. a failed rollout) counts as 0.0.
    Raises ValueError when `turn_rewards` has a different length than `completions`.
    """
    n = len(traj.completions)
    process = list(traj.turn_rewards) if traj.turn_rewards is not None else [0.0] * n
    if len(process) != n:
        raise ValueError(
            f"trajectory {traj.id}: len(turn_rewards) ({len(process)}) != len(completions) ({n})"
        )
    if n:
        process[-1] += traj.reward if traj.reward is not None else 0.0
    return process


def trajectory_advantages(
    trajectories: list[Trajectory], normalize_std: bool = False, std_floor: float = 1e-6
) -> list[list[float]]:
    """Per-turn advantages Â_t = reward_to_go[t] - B for each trajectory of one group.

    B = group mean of the total returns; with `normalize_std` every Â_t is divided by the
    group's return std (ddof=1) when that std is ≥ `std_floor`. Returns one list per trajectory,
    each of length len(traj.completions). The caller picks which trajectories form the group
    (e.g. only finished ones).
    """
    rtg_G_T = [reward_to_go(turn_rewards(t)) for t in trajectories]
    returns_G = [rtg[0] if rtg else 0.0 for rtg in rtg_G_T]
    centred_G = group_advantages(returns_G, normalize_std=False)
    if all(a == 0.0 for a in centred_G):
        # Equal returns carry no signal for the outcome; keep only reward-to-go differences
        # inside each trajectory (zero when there are no process rewards).
        baseline = returns_G[0] if returns_G else 0.0
    else:
        baseline = statistics.fmean(returns_G)
    scale = 1.0
    if normalize_std and len(returns_G) > 1:
        std = statistics.stdev(returns_G)
        scale = 1.0 if std < std_floor else std
    return [[(g - baseline) / scale for g in rtg] for rtg in rtg_G_T]


def trainable(traj: Trajectory, train_failed: bool = False) -> bool:
    """Whether a trajectory enters the loss: finished ones always, failed/aborted on request."""
    if traj.status == "finished":
        return True
    return train_failed and traj.status in ("failed", "aborted")


def group_trajectory_advantages(
    group: Group, normalize_std: bool = False, train_failed: bool = False
) -> list[tuple[Trajectory, list[float]]]:
    """The trainable trajectories of a group, each with its per-turn advantages."""
    members = [t for t in group.trajectories if trainable(t, train_failed)]
    advs = trajectory_advantages(members, normalize_std=normalize_std)
    return list(zip(members, advs, strict=True))
