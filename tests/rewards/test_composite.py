"""Composite rewards (issue 11 item 2): outcome + process events + completion time, by hand.

A 3-member group with weights outcome 1, completion_time 0.5, invalid_tool_call -0.1:
  A: 3 turns, score 1, 10 s, one invalid tool call on turn 0
  B: 2 turns, score 1, 20 s
  C: 3 turns, score 0,  5 s, two invalid tool calls on turn 1
Time reward: successful median m = 15 s; A 0.5 * (15-10)/15 = +1/6, B 0.5 * (15-20)/15 = -1/6,
C failed the task, 0 (being fast at the wrong answer earns nothing).
Outcome o = (7/6, 5/6, 0), mean 2/3 -> centred (1/2, 1/6, -2/3), the same at every turn.
Process rewards-to-go: A (-0.1, 0, 0), B (0, 0), C (-0.2, -0.2, 0); per-position baselines
t0 mean(-0.1, 0, -0.2) = -0.1, t1 mean(0, 0, -0.2) = -1/15, t2 mean(0, 0) = 0.
"""

from __future__ import annotations

import pytest

from forgerl.datapool.sqlite import SQLitePool
from forgerl.rewards.composite import completion_time_rewards, process_turn_rewards
from forgerl.trainer.advantages import trajectory_advantages
from forgerl.trainer.trainer import Trainer
from forgerl.types import Completion, Event, Group, RewardWeights, SamplingParams, Trajectory
from tests.factories import completion, trajectory

WEIGHTS = RewardWeights(outcome=1.0, completion_time=0.5, process={"invalid_tool_call": -0.1})
EXPECTED = {
    "A": [0.5, 0.5 + 1 / 15, 0.5],
    "B": [1 / 6 + 0.1, 1 / 6 + 1 / 15],
    "C": [-2 / 3 - 0.1, -2 / 3 - 0.2 + 1 / 15, -2 / 3],
}


def _turns(n: int) -> list[Completion]:
    """n turns, each extending the last: turn k has 3 + 2k prompt ids."""
    return [completion([1, 2, 3] + [4, 5] * k, [4, 5], [-0.5, -0.6]) for k in range(n)]


def _group() -> list[Trajectory]:
    """A, B, C as in the module docstring: rollouts 0, 1, 2 that took 10 s, 20 s and 5 s."""
    return [
        trajectory("A", _turns(3), 1.0, rollout=0, started_at=100.0, ended_at=110.0,
                   events=[Event(0, "invalid_tool_call")]),
        trajectory("B", _turns(2), 1.0, rollout=1, started_at=100.0, ended_at=120.0),
        trajectory("C", _turns(3), 0.0, rollout=2, started_at=100.0, ended_at=105.0,
                   events=[Event(1, "invalid_tool_call"), Event(1, "invalid_tool_call")]),
    ]


def test_completion_time_reward_by_hand():
    assert completion_time_rewards([10.0, 20.0, 5.0], [1.0, 1.0, 0.0], 0.5) == pytest.approx(
        [1 / 6, -1 / 6, 0.0])
    assert completion_time_rewards([10.0, 40.0], [1.0, 1.0], 0.5) == [0.3, -0.3]  # m = 25
    assert completion_time_rewards([10.0, 10.0, 100.0], [1.0] * 3, 0.5) == [0.0, 0.0, -0.5]
    assert completion_time_rewards([10.0, 20.0], [1.0, 0.0], 0.5) == [0.0, 0.0]  # one success
    assert completion_time_rewards([10.0, 20.0], [1.0, 1.0], 0.0) == [0.0, 0.0]  # off


def test_process_rewards_add_agent_turn_rewards_and_weighted_events():
    t = trajectory("A", _turns(3), 1.0, started_at=100.0, ended_at=101.0,
                   events=[Event(0, "invalid_tool_call"), Event(2, "unknown_kind", 4.0)])
    t.turn_rewards = [0.3, 0.0, 0.1]
    assert process_turn_rewards(t, WEIGHTS.process) == pytest.approx([0.2, 0.0, 0.1])
    t.events.append(Event(5, "invalid_tool_call"))
    with pytest.raises(ValueError, match="turn 5 of 3"):
        process_turn_rewards(t, WEIGHTS.process)


def test_three_turn_group_advantages_by_hand():
    advs = trajectory_advantages(_group(), weights=WEIGHTS)
    for got, tid in zip(advs, "ABC", strict=True):
        assert got == pytest.approx(EXPECTED[tid], abs=1e-12), tid


def test_events_survive_the_pool_and_the_trainer_logs_each_component(tmp_path, tiny_model):
    pool = SQLitePool(tmp_path / "pool.sqlite")
    pool.add_task(0, {"question": "q"})
    ids = []
    for t in _group():
        tid = pool.create_trajectory(0, t.rollout_index)
        for c in t.completions:
            pool.add_completion(tid, c)
        with pytest.raises(ValueError, match="no turn 7"):
            pool.add_event(tid, "invalid_tool_call", turn=7)
        for e in t.events:
            assert pool.add_event(tid, e.kind, e.value, turn=e.turn) == e.turn
        pool.finish_trajectory(tid, "finished", reward=t.reward)
        ids.append(tid)
    with pytest.raises(ValueError, match="is finished, not running"):
        pool.add_event(ids[0], "late")
    # Durations as recorded by the controller (the pool stamps real start/end times).
    stored = [pool.get_trajectory(tid) for tid in ids]
    for t, seconds in zip(stored, (10.0, 20.0, 5.0), strict=True):
        t.started_at, t.ended_at = 100.0, 100.0 + seconds
    assert [e.turn for e in stored[2].events] == [1, 1]
    advs = trajectory_advantages(stored, weights=WEIGHTS)
    for got, tid in zip(advs, "ABC", strict=True):
        assert got == pytest.approx(EXPECTED[tid], abs=1e-12), tid
    batch = Trainer(tiny_model, device="cpu", rewards=WEIGHTS).prepare([Group(0, stored)])
    m = batch.metrics
    assert m["reward_outcome_mean"] == pytest.approx(2 / 3)
    assert m["reward_completion_time_mean"] == pytest.approx(0.0, abs=1e-12)  # +1/6 - 1/6 + 0
    assert m["reward_process_mean"] == pytest.approx(-0.1)
    assert m["rollout_seconds_mean"] == pytest.approx(35 / 3)
    assert m["events_invalid_tool_call"] == 3.0
    pool.close()


def test_a_truncated_turn_is_trained_masked_or_penalised(tiny_model):
    """CASES.md C09: a turn cut at max_tokens (finish "length") is counted; [trainer]
    truncated_turns = "mask" keeps it out of the loss, [reward] process.truncated penalises it
    (on its own turn, reward-to-go from there), and the finished episode keeps its score."""
    from forgerl.trainer.samples import trajectory_to_samples_with_stats

    t = trajectory("A", _turns(2), 1.0, started_at=100.0, ended_at=101.0)
    t.completions[0] = Completion([1, 2, 3], [4, 5], [-0.5, -0.6], [0, 0], 0, "length",
                                  sampling=SamplingParams(temperature=1.0))
    assert process_turn_rewards(t, {"truncated": -0.5}) == [-0.5, 0.0]
    (trained,), stats = trajectory_to_samples_with_stats(t, [0.3, 0.3])
    (masked,), mstats = trajectory_to_samples_with_stats(t, [0.3, 0.3], mask_truncated=True)
    assert trained.input_ids == [1, 2, 3, 4, 5, 4, 5]  # turn 2's prompt is 1 2 3 4 5
    assert trained.loss_mask == [0, 0, 0, 1, 1, 1, 1]
    assert masked.loss_mask == [0, 0, 0, 0, 0, 1, 1]
    assert (stats.truncated_turns, stats.truncated_masked) == (1, 0)
    assert (mstats.truncated_turns, mstats.truncated_masked) == (1, 1)
    other = trajectory("B", _turns(2), 0.0, rollout=1, started_at=100.0, ended_at=101.0)
    m = Trainer(tiny_model, device="cpu", mask_truncated=True).prepare([Group(0, [t, other])])
    assert (m.metrics["truncated_turns"], m.metrics["truncated_turns_masked"]) == (1.0, 1.0)
    assert m.metrics["reward_outcome_mean"] == 0.5
