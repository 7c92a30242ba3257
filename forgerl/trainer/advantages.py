"""Advantages: group-mean baseline for the outcome, per-position baselines for process rewards,
reward-to-go over turns (pure Python, no torch).

Data flow: the trainer takes finished groups from the scheduler; this module turns each group's
rewards into one advantage per turn of each trajectory, which `samples.py` spreads over that
turn's completion tokens.

Formula (DESIGN.md "Advantage", Forge §4.1). Trajectory j of a group has an outcome reward o_j
and process rewards p_{j,0} .. p_{j,T_j-1} (zero if absent), both composite
(`forgerl.rewards.composite`: weighted score + completion-time reward; agent turn rewards +
weighted process events); its return is R_j = o_j + Σ_t p_{j,t}.
The advantage of its turn t is

    Â_{j,t} = (o_j - mean_G(o)) + (g_{j,t} - mean_{i: T_i > t}(g_{i,t})),  g_{j,t} = Σ_{p≥t} p_{j,p}

where the reward-to-go sum runs over the later turns p of turn t's own trace (`Completion.trace`:
a title or compaction call's events do not reach the agent's turns), i.e. the outcome is
centred on the group (GRPO: the same at every turn, of every trace) and the process reward-to-go
on the members that reached turn t (a per-position baseline), so identical trajectories get
exactly 0 at every turn and an outcome-only group is plain GRPO. Optionally every Â is divided
by the group's return std (ddof=1) when that std is at least `std_floor`. Every finished
trajectory counts in the baseline. Failed rollouts (agent crash, timeout) either count with a
penalty outcome `failed_reward` (in the baseline and the loss) or are dropped from both
(`failed_reward=None`); a failed one without any model call (its session recorded none: the
policy did nothing it could be judged by) and aborted attempts (re-run after a resume or a
redispatch) never count.
"""

from __future__ import annotations

import math
import statistics

from forgerl.rewards.composite import (
    completion_time_rewards,
    duration_s,
    process_turn_rewards,
)
from forgerl.types import Group, RewardWeights, Trajectory


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


def reward_to_go(turn_rewards: list[float], traces: list[int] | None = None) -> list[float]:
    """Suffix sums within a trace: out[t] = Σ_{p≥t, traces[p] = traces[t]} turn_rewards[p]
    (same length; `traces`: each turn's trace, None = one trace; empty in, empty out)."""
    out = [0.0] * len(turn_rewards)
    acc: dict[int, float] = {}
    for t in range(len(turn_rewards) - 1, -1, -1):
        trace = traces[t] if traces is not None else 0
        acc[trace] = acc.get(trace, 0.0) + turn_rewards[t]
        out[t] = acc[trace]
    return out


def outcome_reward(traj: Trajectory, failed_reward: float | None = None) -> float:
    """o_j: the trajectory's reward; `failed_reward` for a failed one; 0.0 when unscored."""
    if traj.status == "failed" and failed_reward is not None:
        return failed_reward
    return traj.reward if traj.reward is not None else 0.0


def composite_rewards(
    trajectories: list[Trajectory], weights: RewardWeights, failed_reward: float | None = None
) -> tuple[list[float], list[list[float]], dict[str, float]]:
    """(o_j, p_{j,t}, component sums) of one group under `weights` (rewards/composite.py).

    o_j: one float per trajectory (w_o · score_j + r_j^time); p_{j,t}: per trajectory one float
    per completion (`process_turn_rewards`); a failed member's score is `failed_reward`.
    The sums: "outcome" (Σ w_o · score), "completion_time" (Σ r^time), "process" (Σ p) and
    "seconds" (Σ rollout wall-clock seconds), for per-step means. Raises ValueError like
    `process_turn_rewards`.
    """
    scores = [outcome_reward(t, failed_reward) for t in trajectories]
    seconds = [duration_s(t) for t in trajectories]
    speed = completion_time_rewards(seconds, scores, weights.completion_time)
    outcome_G = [weights.outcome * s + r for s, r in zip(scores, speed, strict=True)]
    process_G_T = [process_turn_rewards(t, weights.process) for t in trajectories]
    sums = {"outcome": weights.outcome * sum(scores), "completion_time": sum(speed),
            "process": sum(map(sum, process_G_T)), "seconds": sum(seconds)}
    return outcome_G, process_G_T, sums


def trajectory_advantages(
    trajectories: list[Trajectory], normalize_std: bool = False, std_floor: float = 1e-6,
    failed_reward: float | None = None, weights: RewardWeights | None = None,
) -> list[list[float]]:
    """Per-turn advantages Â_{j,t} (module docstring) for the trajectories of one group.

    Returns one list per trajectory, each of length len(traj.completions). The caller picks
    which trajectories form the group (`group_members`); a failed one among them
    gets outcome `failed_reward` (None: its reward, or 0.0). `weights`: the composite reward
    (default: outcome weight 1, no time reward, events unweighted). Raises ValueError on a
    non-finite reward or mismatched `turn_rewards`.
    """
    outcome_G, process_G_T, _ = composite_rewards(
        trajectories, weights or RewardWeights(), failed_reward)
    return reward_advantages(outcome_G, process_G_T, normalize_std, std_floor,
                             [[c.trace for c in t.completions] for t in trajectories])


def reward_advantages(
    outcome_G: list[float], process_G_T: list[list[float]], normalize_std: bool = False,
    std_floor: float = 1e-6, traces_G_T: list[list[int]] | None = None,
) -> list[list[float]]:
    """Â_{j,t} (module docstring) from a group's outcome rewards o_j and per-turn process
    rewards p_{j,t} (`composite_rewards`); one list per member, as long as its p_j.
    `traces_G_T`: the trace of each turn (reward-to-go runs within one; None = one trace per
    member). Raises ValueError on a non-finite reward."""
    traces = traces_G_T or [None] * len(process_G_T)
    rtg_G_T = [reward_to_go(p, k) for p, k in zip(process_G_T, traces, strict=True)]
    adv_G_T = [[a] * len(rtg) for a, rtg in zip(group_advantages(outcome_G), rtg_G_T, strict=True)]
    for t in range(max(map(len, rtg_G_T), default=0)):
        alive = [j for j, rtg in enumerate(rtg_G_T) if len(rtg) > t]
        for j, a in zip(alive, group_advantages([rtg_G_T[j][t] for j in alive]), strict=True):
            adv_G_T[j][t] += a
    returns_G = [o + sum(p) for o, p in zip(outcome_G, process_G_T, strict=True)]
    scale = 1.0
    if normalize_std and len(returns_G) > 1:
        std = statistics.stdev(returns_G)
        scale = 1.0 if std < std_floor else std
    return [[a / scale for a in adv] for adv in adv_G_T]


def group_members(group: Group, failed_reward: float | None = 0.0) -> list[Trajectory]:
    """The trajectories that form `group`'s baseline and loss: every finished one, plus the
    failed ones with a model call when `failed_reward` is not None. Aborted attempts and
    failed ones without a call are never members."""
    return [t for t in group.trajectories if t.status == "finished" or (
        t.status == "failed" and failed_reward is not None and t.completions)]
