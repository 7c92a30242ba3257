"""Trajectory → token-exact training samples with a loss mask (pure Python, no torch).

Data flow: after advantages (one per turn), each trajectory becomes one or more `Sample`s, which
the prefix tree packs for the loss. Rules (DESIGN.md "Trajectory"; CASES.md C01-C03):

- When turn k+1's prompt_ids extend turn k's prompt_ids + completion_ids token-for-token, the
  turn is appended to the current sample: the inserted tokens (turn separator, tool results,
  next generation header) get loss_mask 0, the sampled completion tokens get loss_mask 1 with
  their behavior logprobs, weight_versions and the turn's advantage.
- When the prompt does not extend (the agent rewrote its context), a new sample starts. It
  usually shares a prefix with the old one, which the prefix tree deduplicates.
- A turn with token_exact False contributes its tokens with loss_mask 0 only: its ids are not
  the sampled ones, so no logprob of it may enter the loss.

The extension check is done here token-for-token, independent of the gateway's
`extends_previous` flag, and every branch is counted (never silently patched).
"""

from __future__ import annotations

from dataclasses import dataclass

from forgerl.types import Completion, Sample, Trajectory


@dataclass
class PrefixStats:
    """How a trajectory's turns were joined: `extensions` turns appended to the previous
    sample, `branches` turns that started a new sample (the first turn counts as neither)."""

    extensions: int = 0
    branches: int = 0


def _extends(prev_ids: list[int], prompt_ids: list[int]) -> bool:
    n = len(prev_ids)
    return len(prompt_ids) >= n and prompt_ids[:n] == prev_ids


def _new_sample(traj: Trajectory) -> Sample:
    return Sample([], [], [], [], [], task_index=traj.task_index, trajectory_id=traj.id)


def _append(
    sample: Sample, ids: list[int], mask: int, lps: list[float], adv: float, versions: list[int]
) -> None:
    sample.input_ids += ids
    sample.loss_mask += [mask] * len(ids)
    sample.behavior_logprobs += lps if mask else [0.0] * len(ids)
    sample.advantages += [adv if mask else 0.0] * len(ids)
    sample.weight_versions += versions if mask else [-1] * len(ids)


def _append_turn(sample: Sample, turn: Completion, advantage: float) -> None:
    """Append the part of `turn.prompt_ids` not yet in `sample` (mask 0), then the completion."""
    _append(sample, turn.prompt_ids[len(sample.input_ids) :], 0, [], 0.0, [])
    mask = 1 if turn.token_exact else 0
    _append(sample, turn.completion_ids, mask, turn.logprobs, advantage, turn.weight_versions)


def trajectory_to_samples_with_stats(
    traj: Trajectory, advantages_per_turn: list[float]
) -> tuple[list[Sample], PrefixStats]:
    """Like `trajectory_to_samples`, also returning the prefix extension / branch counts."""
    if len(advantages_per_turn) != len(traj.completions):
        raise ValueError(
            f"trajectory {traj.id}: {len(advantages_per_turn)} advantages for "
            f"{len(traj.completions)} turns"
        )
    samples: list[Sample] = []
    stats = PrefixStats()
    for k, (turn, adv) in enumerate(zip(traj.completions, advantages_per_turn, strict=True)):
        if samples and _extends(samples[-1].input_ids, turn.prompt_ids):
            stats.extensions += 1
        else:
            stats.branches += int(k > 0)
            samples.append(_new_sample(traj))
        _append_turn(samples[-1], turn, adv)
    for s in samples:
        if s.loss_mask and s.loss_mask[0]:
            # Position 0 has no preceding logits to predict it from (empty prompt).
            s.loss_mask[0], s.behavior_logprobs[0], s.advantages[0] = 0, 0.0, 0.0
            s.weight_versions[0] = -1
    return samples, stats


def trajectory_to_samples(traj: Trajectory, advantages_per_turn: list[float]) -> list[Sample]:
    """Turn one trajectory into training samples (one per run of token-extending turns).

    Args:
        traj: the trajectory; its completions are used in order.
        advantages_per_turn: one advantage per completion (`advantages.trajectory_advantages`).

    Returns samples whose fields all have the sample's length T: input_ids, loss_mask (1 on
    sampled, token-exact completion tokens), behavior_logprobs / advantages (0.0 where mask 0),
    weight_versions (-1 where mask 0). Raises ValueError on a length mismatch.
    """
    return trajectory_to_samples_with_stats(traj, advantages_per_turn)[0]
