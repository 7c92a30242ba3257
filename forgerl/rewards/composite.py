"""Composite rewards (Forge §4.2): outcome, per-turn process rewards and completion time.

Data flow: the verifier's score is a trajectory's `reward` (outcome); the gateway and the agent
add process `Event`s to its turns (e.g. "invalid_tool_call"), and the agent may report its own
per-turn `turn_rewards`; the trainer combines them per group here, then `advantages.py` turns
the group's composite rewards into per-turn advantages with reward-to-go. For trajectory j of a
group with weights (w_o, w_time, w_k per event kind):

    outcome  o_j = w_o · score_j + r_j^time
    process  p_{j,t} = turn_rewards_{j,t} + Σ_{events e on turn t} w_{kind(e)} · value(e)
             (a turn that ended at max_tokens, finish "length", counts as one "truncated"
             event: CASES.md C09's "penalised" option)
    time     r_j^time = w_time · clip((m - d_j) / m, -1, 1)  for a successful j (score_j > 0),
             d_j = ended_at - started_at (wall-clock seconds: model calls, tool execution and
             sub-agents), m the median d over the group's successful members; 0 for the
             others and when fewer than two members succeeded (no speed to compare at equal
             accuracy).

The time term lands in the trajectory-level outcome, so its reward-to-go is the same at every
turn; with w_time = 0 and no weighted events this is the plain outcome + turn_rewards case.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from forgerl.types import Trajectory


def duration_s(traj: Trajectory) -> float:
    """Wall-clock seconds of a rollout, ended_at - started_at (0.0 when either is unset)."""
    if traj.started_at <= 0 or traj.ended_at <= 0:
        return 0.0
    return max(0.0, traj.ended_at - traj.started_at)


def completion_time_rewards(
    durations_s: list[float], scores: list[float], weight: float
) -> list[float]:
    """r^time per member: weight · clip((median - d) / median, -1, 1) for members with score
    > 0 (median over those), else 0. All zeros when weight is 0, fewer than two members
    succeeded or their median is 0. Raises ValueError on mismatched lengths."""
    if len(durations_s) != len(scores):
        raise ValueError(f"{len(durations_s)} durations for {len(scores)} scores")
    winners = [d for d, s in zip(durations_s, scores, strict=True) if s > 0]
    if weight == 0 or len(winners) < 2:
        return [0.0] * len(scores)
    m = statistics.median(winners)
    if m <= 0:
        return [0.0] * len(scores)
    return [weight * min(1.0, max(-1.0, (m - d) / m)) if s > 0 else 0.0
            for d, s in zip(durations_s, scores, strict=True)]


def process_turn_rewards(traj: Trajectory, weights: Mapping[str, float]) -> list[float]:
    """p_{j,t} for each turn: the agent's `turn_rewards` (zeros if none) plus its weighted
    events, plus weights["truncated"] on each finish-"length" turn. Raises ValueError on a
    turn_rewards length mismatch, an event on a missing turn or a non-finite result."""
    n = len(traj.completions)
    out = list(traj.turn_rewards) if traj.turn_rewards is not None else [0.0] * n
    if len(out) != n:
        raise ValueError(f"trajectory {traj.id}: len(turn_rewards) ({len(out)}) != "
                         f"len(completions) ({n})")
    for e in traj.events:
        if not 0 <= e.turn < n:
            raise ValueError(f"trajectory {traj.id}: event {e.kind!r} on turn {e.turn} of {n}")
        out[e.turn] += weights.get(e.kind, 0.0) * e.value
    for t, turn in enumerate(traj.completions):
        if turn.finish_reason == "length":
            out[t] += weights.get("truncated", 0.0)
    if not all(math.isfinite(x) for x in out):
        raise ValueError(f"trajectory {traj.id}: non-finite process rewards {out}")
    return out
