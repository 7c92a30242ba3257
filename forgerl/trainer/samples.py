"""Trajectory → token-exact training samples with a loss mask (pure Python, no torch).

Data flow: after advantages (one per turn), each trajectory becomes one or more `Sample`s, which
the prefix tree packs for the loss. Rules (DESIGN.md "Trajectory"; CASES.md C01-C03):

- A trajectory's traces (`Completion.trace`: the agent's chain, a harness's title or compaction
  calls, sub-agents) are kept apart: each has its own samples, and a turn only ever extends a
  sample of its own trace, however the traces' calls interleave.
- When a turn's prompt_ids extend a sample of its trace (prompt + completion ids so far,
  token-for-token; the newest such sample), the turn is appended to it: the inserted tokens
  (turn separator, tool results, next generation header) get loss_mask 0, the sampled
  completion tokens get loss_mask 1 with their behavior logprobs, weight_versions and the
  turn's advantage.
- When the prompt extends no sample of its trace (the first call of the trace, or a fork), a new
  sample starts. It usually shares a prefix with an older one, which the prefix tree
  deduplicates.
- Which traces are trained (`trained_traces`): "broadcast" = every trace with a turn recorded
  `train` (each turn gets its trajectory's advantage, as NeMo-RL/Gym and verl do); "main" = only
  the one of them with the most sampled tokens. A trace not trained is left out entirely: no
  sample, no tokens. Within a trained trace a turn recorded with `train` False (a side call by
  rule or model name, sampling the trainer cannot reproduce) is context only (loss mask 0).
- A turn with token_exact False contributes its tokens with loss_mask 0 only: its ids are not
  the sampled ones, so no logprob of it may enter the loss.
- Each trained token carries its turn's sampling temperature (`TrainingSample.temperatures`);
  the trainer scores it with log_softmax(logits / T), the distribution it was drawn from.
- A greedy turn (temperature 0) is context only (loss_mask 0) and counted in
  `PrefixStats.greedy_turns`: argmax decoding has no sampling distribution to form an
  importance ratio with (its recorded logprobs are those of T = 1, which it did not sample
  from). Training rollouts are sampled at `rollout.temperature > 0`; the greedy eval rollouts
  have task_index < 0 and never enter a training group.
- A turn sampled at T > 0 with any sampling transform (top_p < 1, top_k, min_p, a penalty:
  `SamplingParams.transforms`) is context only too, counted in `PrefixStats.transformed_turns`:
  its recorded logprobs are of the filtered or penalised distribution, which the trainer's
  log_softmax(logits / T) does not reproduce (CASES.md C04, C21: repetition_penalty 1.1 alone
  moves the ratio on unchanged weights to 1.067 and 0.890).

The extension check is done here token-for-token, independent of the gateway's
`extends_previous` flag, and every branch is counted (never silently patched).

Before advantages, `drop_retry_orphans` removes the turns an SDK retry superseded (CASES.md
C17): the client timed out on call R1 while its answer was being recorded (the gateway marks
that turn undelivered), re-sent it and continued from the second answer, so the first answer
is no part of what the agent did.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from forgerl.types import UNDELIVERED, Completion, Routes, Sample, Trajectory


@dataclass
class TrainingSample(Sample):
    """A `Sample` plus the sampling temperature of every token.

    temperatures: length T, float; where loss_mask[t] == 1 the temperature (> 0) that token t
    was sampled at (its completion's `sampling.temperature`), else 1.0 (never used).
    routes: None, or a MoE model's recorded routed experts of the sample's first len(routes)
    tokens, each token's from the earliest of its turns that fed it (`routing_replay`).
    """

    temperatures: list[float] = field(default_factory=list)
    routes: Routes | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.temperatures) != len(self.input_ids):
            raise ValueError(
                f"temperatures has length {len(self.temperatures)}, input_ids {len(self.input_ids)}"
            )


@dataclass
class PrefixStats:
    """How a trajectory's turns were joined: `extensions` turns appended to a sample of their
    trace, `branches` turns that started another sample of their trace (a trace's first turn
    counts as neither); of the turns of trained traces: `greedy_turns` token-exact turns sampled
    at temperature 0, kept out of the loss; `transformed_turns` token-exact turns sampled at
    T > 0 with a sampling transform (top_p, top_k, min_p, penalties), kept out of the loss;
    `truncated_turns` turns that ended at max_tokens (finish "length"), `truncated_masked` those
    of them kept out of the loss (`mask_truncated`); `unrouted_turns` turns without recorded
    routed experts (`Completion.routed_experts`: a dense model, or a reply cut at a streamed
    stop string), which a MoE trainer runs with its own routing."""

    extensions: int = 0
    branches: int = 0
    greedy_turns: int = 0
    transformed_turns: int = 0
    truncated_turns: int = 0
    truncated_masked: int = 0
    unrouted_turns: int = 0


TraceMode = Literal["broadcast", "main"]


def trained_traces(traj: Trajectory, mode: TraceMode = "broadcast") -> set[int]:
    """The traces of `traj` that are trained: each with a turn recorded `train` ("broadcast"),
    or of those the one with the most sampled (completion) ids in such turns ("main"; a tie
    goes to the lower trace index). Empty when no turn is recorded `train`."""
    sampled: dict[int, int] = {}
    for c in traj.completions:
        if c.train:
            sampled[c.trace] = sampled.get(c.trace, 0) + len(c.completion_ids)
    if mode == "main" and sampled:
        return {min(sampled, key=lambda trace: (-sampled[trace], trace))}
    return set(sampled)


def trace_counts(traj: Trajectory, mode: TraceMode = "broadcast") -> tuple[int, int]:
    """(the traces of `traj`, those of them not trained under `mode`: `trained_traces`)."""
    every = {c.trace for c in traj.completions}
    return len(every), len(every - trained_traces(traj, mode))


def _extends(prev_ids: list[int], prompt_ids: list[int]) -> bool:
    n = len(prev_ids)
    return len(prompt_ids) >= n and prompt_ids[:n] == prev_ids


def _new_sample(traj: Trajectory) -> TrainingSample:
    return TrainingSample([], [], [], [], [], task_index=traj.task_index, trajectory_id=traj.id)


def _append(sample: TrainingSample, ids: list[int], turn: Completion | None, adv: float) -> None:
    """Append `ids`: the sampled completion of `turn` (mask 1), or context when turn is None."""
    n = len(ids)
    sample.input_ids += ids
    if turn is None:
        sample.loss_mask += [0] * n
        sample.behavior_logprobs += [0.0] * n
        sample.advantages += [0.0] * n
        sample.weight_versions += [-1] * n
        sample.temperatures += [1.0] * n
    else:
        sample.loss_mask += [1] * n
        sample.behavior_logprobs += turn.logprobs
        sample.advantages += [adv] * n
        sample.weight_versions += turn.weight_versions
        sample.temperatures += [turn.sampling.temperature] * n


def _append_turn(sample: TrainingSample, turn: Completion, advantage: float,
                 stats: PrefixStats, mask_truncated: bool) -> None:
    """Append the part of `turn.prompt_ids` not yet in `sample` (mask 0), then the completion
    (mask 1 when token-exact, sampled at T > 0 without a transform and not a masked truncated
    turn)."""
    _append(sample, turn.prompt_ids[len(sample.input_ids) :], None, 0.0)
    greedy = turn.sampling.temperature <= 0
    transformed = not greedy and bool(turn.sampling.transforms())
    truncated = turn.finish_reason == "length"
    trained = (turn.train and turn.token_exact and not greedy and not transformed
               and not (truncated and mask_truncated))
    _append(sample, turn.completion_ids, turn if trained else None, advantage)
    _add_routes(sample, turn.routed_experts)
    stats.unrouted_turns += turn.routed_experts is None
    stats.greedy_turns += turn.token_exact and greedy
    stats.transformed_turns += turn.token_exact and transformed
    stats.truncated_turns += truncated
    stats.truncated_masked += truncated and mask_truncated


def _add_routes(sample: TrainingSample, routes: Routes | None) -> None:
    """Extend `sample.routes` with the part of a turn's `routes` beyond what it covers."""
    have = sample.routes
    if routes is None or (have is not None and (have.layers, have.top_k) != (
            routes.layers, routes.top_k)) or len(routes) <= (len(have) if have else 0):
        return
    step = routes.layers * routes.top_k
    data = (have.data if have else b"") + routes.data[len(have.data) if have else 0:]
    sample.routes = Routes(data[: len(sample.input_ids) * step], routes.layers, routes.top_k)


def drop_retry_orphans(traj: Trajectory) -> tuple[Trajectory, int]:
    """`traj` without its retry orphans, and how many turns were dropped (CASES.md C17).

    A retry orphan is a turn the gateway marked `UNDELIVERED`: its client left (an SDK
    timeout) while the answer was being recorded, so the agent never saw it and re-sent the
    request; the retry's answer is what the agent continued from. Answers the agent did
    receive are all kept, however often it sent the same prompt (samples to vote on, sibling
    choices of an n > 1 call). `turn_rewards` and `events` lose the orphans' entries (events
    are re-indexed to the kept turns). Returns `traj` itself when nothing is dropped.
    """
    turns = traj.completions
    orphans = {e.turn for e in traj.events if e.kind == UNDELIVERED}
    if not orphans:
        return traj, 0
    keep = [k for k in range(len(turns)) if k not in orphans]
    rewards = None if traj.turn_rewards is None else [traj.turn_rewards[k] for k in keep]
    new_turn = {k: i for i, k in enumerate(keep)}
    events = [replace(e, turn=new_turn[e.turn]) for e in traj.events if e.turn in new_turn]
    kept = replace(traj, completions=[turns[k] for k in keep], turn_rewards=rewards, events=events)
    return kept, len(orphans)


def trajectory_to_samples_with_stats(
    traj: Trajectory, advantages_per_turn: list[float], mask_truncated: bool = False,
    traces: TraceMode = "broadcast",
) -> tuple[list[TrainingSample], PrefixStats]:
    """Like `trajectory_to_samples`, also returning the prefix extension / branch counts.

    mask_truncated: a turn that ended at max_tokens (finish "length", CASES.md C09) is context
    only (loss mask 0) instead of trained with its turn's advantage; penalise such turns
    instead with `[reward] process = { truncated = ... }`. traces: which traces are trained
    (`trained_traces`; the others give no sample).
    """
    if len(advantages_per_turn) != len(traj.completions):
        raise ValueError(
            f"trajectory {traj.id}: {len(advantages_per_turn)} advantages for "
            f"{len(traj.completions)} turns"
        )
    samples: list[TrainingSample] = []
    keep = trained_traces(traj, traces)
    stats = PrefixStats()
    chains: dict[int, list[TrainingSample]] = {}  # trace -> its samples, oldest first
    for turn, adv in zip(traj.completions, advantages_per_turn, strict=True):
        if turn.trace not in keep:
            continue
        chain = chains.setdefault(turn.trace, [])
        sample = next((s for s in reversed(chain) if _extends(s.input_ids, turn.prompt_ids)),
                      None)
        if sample is not None:
            stats.extensions += 1
        else:
            stats.branches += bool(chain)
            sample = _new_sample(traj)
            chain.append(sample)
            samples.append(sample)
        _append_turn(sample, turn, adv, stats, mask_truncated)
    for s in samples:
        if s.loss_mask and s.loss_mask[0]:
            # Position 0 has no preceding logits to predict it from (empty prompt).
            s.loss_mask[0], s.behavior_logprobs[0], s.advantages[0] = 0, 0.0, 0.0
            s.weight_versions[0], s.temperatures[0] = -1, 1.0
    return samples, stats


def trajectory_to_samples(
    traj: Trajectory, advantages_per_turn: list[float]
) -> list[TrainingSample]:
    """Turn one trajectory into training samples (one per run of token-extending turns of a
    trace; every trace with a `train` turn, "broadcast").

    Args:
        traj: the trajectory; its completions are used in order.
        advantages_per_turn: one advantage per completion (`advantages.trajectory_advantages`).

    Returns samples whose fields all have the sample's length T: input_ids, loss_mask (1 on
    sampled (T > 0), token-exact completion tokens of turns recorded `train`),
    behavior_logprobs / advantages (0.0 where mask 0), weight_versions (-1 where mask 0),
    temperatures (1.0 where mask 0). Raises ValueError on a length mismatch.
    """
    return trajectory_to_samples_with_stats(traj, advantages_per_turn)[0]
