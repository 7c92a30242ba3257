"""Scheduler policies as pure state machines (Forge §3.1) and the C10 staleness case.

Pins: windowed FIFO never trains a group beyond [head, head+W-1] and its window moves only when
the head is trained; FIFO trains in queue order; FFFO trains in finish order; every admitted task
is trained exactly once; with `max_off_policy_steps` = L no trained group's off-policy lag exceeds
L (admission pauses, nothing is discarded); state() / from_state() round-trips mid-run.
CASES.md C10 in our words: on a fake clock with one slow task among quick ones, windowed FIFO still
trains the slow task promptly, trains every task equally often, and the trained tasks' durations
match the admitted ones'.
"""

from __future__ import annotations

import json
from collections import Counter
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.scheduling import simulate
from forgerl.scheduler import policies as policies_module
from forgerl.scheduler.policies import (
    Fffo,
    Fifo,
    Scheduler,
    WindowedFifo,
    admissible,
    make_policy,
    resolve_window,
)


def test_select_by_hand():
    finished = [5, 2, 0, 3]  # finish order
    assert WindowedFifo(3).select(finished, set(), head=0, k=4) == [0, 2, 3]
    # head 0 taken → window [1, 2]; 1 unfinished so 3 and 5 stay outside.
    assert WindowedFifo(2).select(finished, set(), head=0, k=4) == [0, 2]
    # 1 already trained: the window slides 0 → 2 → 3 → 4 as heads are taken.
    assert WindowedFifo(2).select(finished, {1}, head=0, k=4) == [0, 2, 3, 5]
    assert WindowedFifo(2).select(finished, {1}, head=0, k=2) == [0, 2]
    assert Fifo().select(finished, set(), head=0, k=4) == [0]
    assert Fifo().select([1, 0, 2], set(), head=0, k=2) == [0, 1]
    assert Fffo().select(finished, set(), head=0, k=3) == [5, 2, 0]
    assert resolve_window(0.5, 8) == 4 and resolve_window(0.01, 8) == 1
    assert resolve_window(16, 4) == 16
    with pytest.raises(ValueError):
        WindowedFifo(0)
    # the config's `type` names; the window counts only for windowed_fifo
    assert make_policy("fifo", 7) == Fifo() and make_policy("fffo") == Fffo()
    assert make_policy("windowed_fifo", 3) == WindowedFifo(3)
    with pytest.raises(ValueError, match="unknown scheduler policy 'lifo'"):
        make_policy("lifo", 2)
    with pytest.raises(ValueError, match="unknown scheduler policy 'windowed_fifo'"):
        make_policy("windowed_fifo")  # no W


def test_admission_bound_by_hand():
    # FIFO, k=4, L=1, trainer at version 1, tasks 4..7 admitted at version 0.
    admitted = {4: 0, 5: 0, 6: 0, 7: 0}
    assert admissible(admitted, 8, 1, 1, 4, 1, 1)  # 8: C=4 → 1 + 1 - 1 = 1 ≤ 1
    full = admitted | {8: 1, 9: 1, 10: 1, 11: 1}
    assert not admissible(full, 12, 1, 1, 4, 1, 1)  # 12: C=8 → 1 + 2 - 1 = 2 > 1
    # Windowed W=4: 8 would let 4,8,9,10 train before 7 (7 admitted at 0): 1 + 1 - 0 > 1.
    assert not admissible(admitted, 8, 1, 1, 4, 4, 1)
    # L=0 is synchronous: one batch of k at a time.
    sched = Scheduler(Fifo(), batch_size=2, max_off_policy_steps=0, max_in_flight=10)
    assert sched.admit(0) == [0, 1]
    assert sched.admit(0) == []


def test_next_batch_is_a_query_and_training_is_checked():
    sched = Scheduler(WindowedFifo(4), batch_size=2, max_in_flight=4)
    assert sched.admit(0) == [0, 1, 2, 3]
    sched.on_group_finished(2, 0)
    assert sched.next_batch() is None
    sched.on_group_finished(1, 0)
    sched.on_group_finished(1, 0)  # idempotent
    assert sched.next_batch(2) == [1, 2] == sched.next_batch()
    with pytest.raises(ValueError):
        sched.next_batch(3)
    with pytest.raises(ValueError):
        sched.on_trained([0, 1], 1)  # 0 is not finished
    sched.on_trained([1, 2], 1)
    assert sched.queue.head == 0  # head not consumed → window does not slide
    assert sched.metrics()["off_policy_lag_max"] == 0
    assert sched.admit(1) == [4, 5]


def test_max_in_flight_caps_generating_groups_only():
    # A straggler at the head (0): finished groups beyond the window wait in the pool without
    # holding a generation slot, so admission continues while the trainer waits for task 0.
    sched = Scheduler(WindowedFifo(2), batch_size=1, max_in_flight=2)
    assert sched.admit(0) == [0, 1]
    sched.on_group_finished(1, 0)
    assert sched.admit(0) == [2]
    sched.on_group_finished(2, 0)
    assert sched.admit(0) == [3] and sched.admit(0) == []
    assert sched.next_batch() == [1]  # window [0, 1]
    sched.on_trained([1], 1)
    assert sched.next_batch() is None  # 2 is outside the window [0, 1] until 0 is trained
    assert sched.metrics()["groups_in_flight"] == 2 and sched.metrics()["groups_ready"] == 1
    sched.on_group_finished(0, 0)
    assert sched.admit(1) == [4]
    assert sched.next_batch() == [0]
    # With a lag bound L the backlog is capped at (L + 1) k admitted, untrained groups.
    bounded = Scheduler(Fffo(), batch_size=2, max_off_policy_steps=1, max_in_flight=1)
    admitted = []
    for _ in range(10):
        admitted += (new := bounded.admit(0))
        for i in new:
            bounded.on_group_finished(i, 0)
    assert admitted == [0, 1, 2, 3]
    # The controller's cap: no more untrained tasks than the steps left can train.
    capped = Scheduler(Fifo(), batch_size=2, max_off_policy_steps=1)
    assert capped.admit(0, max_untrained=2) == [0, 1] and capped.admit(0, max_untrained=2) == []
    for i in (0, 1):
        capped.on_group_finished(i, 0)
    capped.on_trained(capped.next_batch(), 1)
    assert capped.admit(1, max_untrained=2) == [2, 3]  # the last step's k tasks
    assert capped.admit(1, max_untrained=0) == []


events = st.lists(st.tuples(st.sampled_from(["finish", "train"]), st.integers(0, 10**6)),
                  min_size=1, max_size=120)
policies = st.one_of(st.just(Fifo()), st.just(Fffo()), st.integers(1, 9).map(WindowedFifo))


@settings(deadline=None, max_examples=150)
@given(policy=policies, k=st.integers(1, 4), lag=st.one_of(st.none(), st.integers(0, 3)),
       in_flight=st.integers(1, 12), events=events)
def test_policy_invariants(policy, k, lag, in_flight, events):
    bypass = AssertionError("liveness bypass in a run whose settings never changed")
    with patch.object(policies_module.log, "warning", side_effect=bypass):
        _check_invariants(policy, k, lag, in_flight, events)


def _check_invariants(policy, k, lag, in_flight, events):
    sched = Scheduler(policy, k, lag, max_in_flight=in_flight, num_tasks=40)
    admitted_at: dict[int, int] = {}
    trained: list[int] = []
    finish_order: list[int] = []
    for kind, r in events:
        for i in sched.admit(sched.version):
            admitted_at[i] = sched.version
        running = sched.queue.in_flight()
        if kind == "finish" and running:
            i = running[r % len(running)]
            sched.on_group_finished(i, min(admitted_at[i] + r % 2, sched.version))  # newer tokens
            finish_order.append(i)
        batch = sched.next_batch()
        if kind != "train" or batch is None:
            continue
        head = sched.queue.head
        if policy.window is not None:  # each pick lies in the window of the head at that time
            done = set(trained)
            for i in batch:
                assert head <= i < head + policy.window
                done.add(i)
                while head in done:
                    head += 1
        if isinstance(policy, Fffo):
            ready = [i for i in finish_order if i not in trained]
            assert batch == ready[:k]
        old_head = sched.queue.head
        sched.on_trained(batch, sched.version + 1)
        if old_head not in batch:
            assert sched.queue.head == old_head  # slides only when the head is consumed
        trained += batch
        if lag is not None:
            assert all(0 <= x <= lag for x in sched.last_lags.values())
        sched = Scheduler.from_state(json.loads(json.dumps(sched.state())))
    assert len(trained) == len(set(trained))  # exactly once
    assert set(trained) <= set(admitted_at)
    if isinstance(policy, Fifo):
        assert trained == list(range(len(trained)))
    # Drain: with every group finished, everything admitted is trained (nothing discarded).
    for _ in range(400):
        for i in sched.admit(sched.version):
            admitted_at[i] = sched.version
        running = sched.queue.in_flight()
        for i in running:
            sched.on_group_finished(i, admitted_at[i])
        if (batch := sched.next_batch()) is None:
            if running:
                continue  # max_in_flight < k: a step's groups take several admission rounds
            break
        sched.on_trained(batch, sched.version + 1)
        trained += batch
        if lag is not None:
            assert max(sched.last_lags.values()) <= lag
    assert len(trained) == len(set(trained))
    assert sorted(trained) == list(range(len(trained)))  # no gap: nothing skipped
    assert len(sched.queue.admitted) < k or sched.queue.next_index == 40


def c10_duration(i: int) -> float:
    return 3.0 if i % 8 == 7 else 0.5


def test_c10_slow_task_is_not_starved():
    lag_bound = 3  # the slow group spans 3 train steps; L=2 makes the trainer run ahead of it
    sched = Scheduler(WindowedFifo(4), batch_size=2, max_off_policy_steps=lag_bound,
                      group_size=4)
    res = simulate(sched, c10_duration, slots=16, train_time=1.0, steps=20)
    trained = res.trained
    assert len(trained) == 40 == len(set(trained))
    items = Counter(i % 8 for i in trained)
    assert set(items) == set(range(8)) and max(items.values()) - min(items.values()) <= 1
    # Every slow task is trained in the step that starts next after its group finished: its
    # step ends at most two train steps (2.0) after it finished.
    step_of = {i: s for s, batch in enumerate(res.batches) for i in batch}
    for i in (7, 15, 23, 31, 39):
        assert 0 < res.trained_at[step_of[i]] - res.finished_at[i] <= 2.0
    assert max(res.lags.values()) <= lag_bound
    # Nothing discarded: the trained tasks are exactly the queue prefix 0..39.
    assert sorted(trained) == list(range(40))
    # Durations of trained tasks match those admitted (same multiset over the prefix).
    assert sorted(c10_duration(i) for i in trained) == sorted(
        c10_duration(i) for i in res.admitted[:40])


def test_c10_fffo_for_contrast_is_biased():
    sched = Scheduler(Fffo(), batch_size=2, max_off_policy_steps=None, max_in_flight=16,
                      group_size=4)
    res = simulate(sched, c10_duration, slots=16, train_time=1.0, steps=20)
    first = res.trained[:8]
    assert 7 not in first  # FFFO trains quick tasks from later epochs before slow task 7


def test_resume_keeps_the_queue_and_takes_settings_from_the_config(caplog):
    from forgerl.config import FffoConfig, RolloutConfig, SchedulerConfig, WindowedFifoConfig

    old = Scheduler.build(SchedulerConfig(policy=WindowedFifoConfig(), max_off_policy_steps=1),
                          RolloutConfig(tasks_per_step=2))  # W=4, L=1
    assert old.admit(0) == [0, 1, 2, 3]
    old.on_group_finished(1, 0)
    old.on_group_finished(0, 0)
    old.on_trained(old.next_batch(), 1)
    state = json.loads(json.dumps(old.state()))
    new = Scheduler.build(SchedulerConfig(policy=FffoConfig(), max_off_policy_steps=3),
                          RolloutConfig(tasks_per_step=3), state=state)
    assert (new.policy, new.batch_size, new.max_off_policy_steps) == (Fffo(), 3, 3)
    assert new.max_in_flight == 12 and new.version == 1
    assert new.queue.head == 2 and sorted(new.queue.admitted) == [2, 3]
    assert "batch_size" in caplog.text and "(2, 3)" in caplog.text
    for i in (2, 3):
        new.on_group_finished(i, 0)
    assert new.next_batch() is None  # k = 3 now
    new.admit(1)
    new.on_group_finished(4, 1)
    assert new.next_batch() == [2, 3, 4]


@pytest.mark.parametrize(("before", "after"), [
    # (policy, k, L) saved → (policy, k, L) on resume
    (("fffo", 4, 1), ("fifo", 2, 1)),
    (("fffo", 4, 1), ("fffo", 2, 1)),
    (("fffo", 2, 2), ("fffo", 2, 0)),
])
def test_resume_with_new_settings_never_stalls(before, after, caplog):
    """Tasks admitted under the old settings may break the new bound; the run still trains
    every task exactly once (the liveness rule in `admit` warns and admits)."""
    from forgerl.config import RolloutConfig, SchedulerConfig

    def build(policy, k, lag, state=None):
        config = SchedulerConfig(policy={"type": policy}, max_off_policy_steps=lag)
        return Scheduler.build(config, RolloutConfig(tasks_per_step=k), state=state)

    old = build(*before)
    admitted = old.admit(0)
    for i in admitted[1:]:  # task 0 is a straggler, still generating at the save
        old.on_group_finished(i, 0)
    old.on_trained(old.next_batch(), 1)
    new = build(*after, state=json.loads(json.dumps(old.state())))
    new.queue.num_tasks = 12
    for i in new.queue.in_flight():  # what resume(pool) does with the tasks in flight
        new.queue.requeue(i)
    trained = list(range(1, before[1] + 1))
    for _ in range(50):
        for i in new.admit(new.version):
            new.on_group_finished(i, new.version)
        if (batch := new.next_batch()) is not None:
            new.on_trained(batch, new.version + 1)
            trained += batch
    assert sorted(trained) == list(range(12))
    assert "beyond max_off_policy_steps" in caplog.text


def test_the_default_overlaps_generation_with_training():
    """The default (FIFO, L = 2, k = 2): after step 1, each step admits the k tasks of the step
    after next, which generate while the next step trains; every trained group's lag is <= 2."""
    from forgerl.config import RolloutConfig, SchedulerConfig

    sched = Scheduler.build(SchedulerConfig(), RolloutConfig())
    assert (sched.policy, sched.batch_size, sched.max_off_policy_steps) == (Fifo(), 2, 2)
    assert sched.max_in_flight == 6
    assert sched.admit(0) == [0, 1, 2, 3, 4, 5]
    admitted, lags = [], []
    for step in range(1, 6):
        assert sched.next_batch() is None  # step `step`'s groups are still generating
        for i in sorted(sched.queue.in_flight())[:2]:  # the head's two groups finish first
            sched.on_group_finished(i, sched.queue.admitted[i])
        batch = sched.next_batch()
        sched.on_trained(batch, step)
        lags.append(sorted(sched.last_lags.values()))
        admitted.append(sched.admit(step))  # dispatched while step `step + 1` trains
    # hand-computed: tasks 2k(s+2), 2k(s+2)+1 join after step s, two steps ahead of training
    assert admitted == [[6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    # tasks 0-5 started at version 0: lags 0, 1, 2; later ones started two versions early: 2
    assert lags == [[0, 0], [1, 1], [2, 2], [2, 2], [2, 2]]


@pytest.mark.parametrize("policy, after_step", [
    (Fifo(), [[6, 7], [8, 9], [10, 11]]),
    (WindowedFifo(2), [[], [], [6, 7, 8, 9, 10, 11]]),
    (WindowedFifo(4), [[], [], [6, 7, 8, 9, 10, 11]]),
    (Fffo(), [[], [], [6, 7, 8, 9, 10, 11]]),
])
def test_which_policies_overlap_generation_with_training_at_lag_2(policy, after_step):
    # k = 2, L = 2, every admitted group finished before each step: FIFO admits k tasks after
    # every step, which generate while the next step trains. A window W >= 2 (FFFO: W = inf)
    # could train a later group before an earlier one, so the bound only holds once every
    # admitted task is trained: it admits (L + 1) k tasks every L + 1 steps, and between those
    # bursts the engine idles while the trainer trains (the old default, W = 4 at L = 1, did
    # the same every 2 steps)
    sched = Scheduler(policy, batch_size=2, max_off_policy_steps=2)
    assert sched.admit(0) == [0, 1, 2, 3, 4, 5]
    admitted = []
    for step in range(1, 4):
        for i in sched.queue.in_flight():
            sched.on_group_finished(i, sched.queue.admitted[i])
        sched.on_trained(sched.next_batch(), step)
        admitted.append(sched.admit(step))
    assert admitted == after_step
