"""Traces in the trainer: each trace of a trajectory is its own sample chain (issue 46 item 3).

Pins: a turn extends a sample of its own trace even when another trace's call came in between
(an interleaved side call no longer breaks the agent's chain); a turn recorded `train` False is
context (loss mask 0); a trace with no trained turn gives no sample; `[reward] traces`
"broadcast" trains every trained trace with the trajectory's advantage, "main" only the trace
with the most sampled tokens; process reward-to-go runs within a trace; a failed rollout without
any model call is no group member. Every number below is computed by hand. Ids are ChatML-like.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from forgerl.trainer.advantages import group_members, reward_advantages, reward_to_go
from forgerl.trainer.samples import trace_counts, trained_traces, trajectory_to_samples_with_stats
from forgerl.trainer.trainer import Trainer
from forgerl.types import Group
from tests.factories import completion, trajectory

START, END, NL = 1, 2, 9
P1 = [START, 50, NL, 60, END, NL, START, 70, NL]  # agent: system + user + header (9 ids)
C1 = [10, 11, END]
INSERT = [NL, START, 80, NL, 42, END, NL, START, 70, NL]  # tool result + next header (10 ids)
C2 = [20, END]
C3 = [30, 31, 32, END]
PT = [START, 50, NL, 99, END, NL, START, 70, NL]  # the title generator's own system prompt
CT = [40, END]
PS = [START, 50, NL, 98, END, NL, START, 70, NL]  # a compaction call, trained
CS = [45, END]


def agent_and_side_calls():
    """Turns in recording order: agent 1 (trace 0), title (trace 1, train False), agent 2,
    compaction (trace 2), agent 3; agent turns k+1 extend turn k token for token."""
    p2 = P1 + C1 + INSERT
    p3 = p2 + C2 + INSERT
    return [
        completion(P1, C1, [-0.5, -0.7, -0.1]),
        replace(completion(PT, CT, [-0.3, -0.2]), trace=1, train=False),
        completion(p2, C2, [-0.2, -0.3]),
        replace(completion(PS, CS, [-0.4, -0.6]), trace=2),
        completion(p3, C3, [-0.1, -0.2, -0.3, -0.4]),
    ]


def test_an_interleaved_side_call_does_not_break_the_agent_chain():
    traj = trajectory("a", agent_and_side_calls(), 1.0)
    samples, stats = trajectory_to_samples_with_stats(traj, [0.5] * 5)
    agent, compaction = samples
    assert agent.input_ids == P1 + C1 + INSERT + C2 + INSERT + C3  # id for id, one sample
    assert agent.loss_mask == [0] * 9 + [1] * 3 + [0] * 10 + [1] * 2 + [0] * 10 + [1] * 4
    assert agent.behavior_logprobs == ([0.0] * 9 + [-0.5, -0.7, -0.1] + [0.0] * 10
                                       + [-0.2, -0.3] + [0.0] * 10 + [-0.1, -0.2, -0.3, -0.4])
    assert compaction.input_ids == PS + CS and compaction.loss_mask == [0] * 9 + [1, 1]
    assert (stats.extensions, stats.branches) == (2, 0)  # a trace's first turn is neither
    assert CT[0] not in [i for s in samples for i in s.input_ids]  # the title trace: no sample
    assert trained_traces(traj) == {0, 2} and trace_counts(traj) == (3, 1)


def test_an_untrained_turn_in_a_trained_trace_is_context_only():
    turns = agent_and_side_calls()
    turns[2] = replace(turns[2], train=False)  # e.g. sampling the trainer cannot reproduce
    (agent, _), _ = trajectory_to_samples_with_stats(trajectory("a", turns, 1.0), [0.5] * 5)
    assert agent.input_ids == P1 + C1 + INSERT + C2 + INSERT + C3
    assert agent.loss_mask == [0] * 9 + [1] * 3 + [0] * 10 + [0] * 2 + [0] * 10 + [1] * 4
    assert agent.advantages[22:24] == [0.0, 0.0] and agent.weight_versions[22:24] == [-1, -1]
    title_only = trajectory("t", [turns[1]], 1.0)
    assert trajectory_to_samples_with_stats(title_only, [0.5])[0] == []  # nothing fed


@pytest.mark.parametrize("mode", ["broadcast", "main"])
def test_broadcast_trains_every_trained_trace_main_only_the_longest(mode):
    """Group of two: A (three traces, reward 1) and B (one turn, reward 0): Â = ±0.5."""
    a = trajectory("a", agent_and_side_calls(), 1.0, rollout=0)
    b = trajectory("b", [completion(P1, C1)], 0.0, rollout=1)
    members = group_members(Group(0, [a, b]))
    advs_a, advs_b = reward_advantages([1.0, 0.0], [[0.0] * 5, [0.0]],
                                       traces_G_T=[[c.trace for c in t.completions]
                                                   for t in members])
    assert advs_a == [0.5] * 5 and advs_b == [-0.5]
    samples, _ = trajectory_to_samples_with_stats(a, advs_a, traces=mode)
    trained = {tuple(s.input_ids[i] for i, m in enumerate(s.loss_mask) if m): sorted(
        {x for x, m in zip(s.advantages, s.loss_mask, strict=True) if m}) for s in samples}
    agent_tokens = (*C1, *C2, *C3)  # 9 sampled ids against 2 in the compaction trace
    if mode == "broadcast":
        assert trained == {agent_tokens: [0.5], tuple(CS): [0.5]}
        assert trace_counts(a, mode) == (3, 1)
    else:
        assert trained == {agent_tokens: [0.5]}
        assert trace_counts(a, mode) == (3, 2)
    (sample_b,), _ = trajectory_to_samples_with_stats(b, advs_b, traces=mode)
    assert sample_b.advantages == [0.0] * 9 + [-0.5] * 3


def test_one_trace_per_rollout_trains_the_same_tokens_either_way():
    """A trajectory with one trace (the calculator job's shape: every call extends the last)
    gives identical samples under "broadcast" and "main"."""
    turns = [t for t in agent_and_side_calls() if t.trace == 0]
    traj = trajectory("a", turns, 1.0)
    broadcast, _ = trajectory_to_samples_with_stats(traj, [0.5, 0.25, 0.125])
    main, _ = trajectory_to_samples_with_stats(traj, [0.5, 0.25, 0.125], traces="main")
    assert broadcast == main and len(main) == 1 and sum(main[0].loss_mask) == 9


def test_reward_to_go_runs_within_a_trace():
    # turns: agent, title, agent, compaction (event -0.2), agent (+0.1)
    traces = [0, 1, 0, 2, 0]
    assert reward_to_go([0.0, 0.0, 0.0, -0.2, 0.1], traces) == [0.1, 0.0, 0.1, -0.2, 0.1]
    assert reward_to_go([0.0, 0.0, 0.0, -0.2, 0.1]) == pytest.approx([-0.1] * 4 + [0.1])
    # outcome ±0.5; turn 0: rtg 0.1 vs B's 0.0 -> ±0.05; later turns only A reached: + 0
    advs = reward_advantages([1.0, 0.0], [[0.0, 0.0, 0.0, -0.2, 0.1], [0.0]],
                             traces_G_T=[traces, [0]])
    assert advs == [pytest.approx([0.55, 0.5, 0.5, 0.5, 0.5]), pytest.approx([-0.55])]


def test_a_failed_rollout_without_a_call_is_no_group_member():
    """It says nothing of the policy: neither penalised into the baseline nor trained; a
    failed rollout with calls still counts under the penalty."""
    a = trajectory("a", [completion(P1, C1)], 1.0)
    none = trajectory("n", [], None, rollout=1, status="failed")
    crashed = trajectory("c", [completion(P1, C1)], None, rollout=2, status="failed")
    assert [t.id for t in group_members(Group(0, [a, none, crashed]))] == ["a", "c"]
    assert [t.id for t in group_members(Group(0, [a, none, crashed]), None)] == ["a"]


def test_step_metrics_count_traces(tiny_model):
    a = trajectory("a", agent_and_side_calls(), 1.0, rollout=0)
    b = trajectory("b", [completion(P1, C1)], 0.0, rollout=1)
    for mode, untrained in (("broadcast", 1.0), ("main", 2.0)):
        metrics = Trainer(tiny_model, device="cpu", traces=mode).prepare([Group(0, [a, b])]).metrics
        assert (metrics["traces_per_trajectory"], metrics["traces_untrained"]) == (2.0, untrained)
