"""Resume after SIGKILL keeps every buffered rollout and trains nothing twice (CASES.md C12).

A child process drives a real `Scheduler` + `SQLitePool` (one rollout per task, generation batch
4) with a fake training step that commits the trained marks and the scheduler state in one
transaction, reports its first batch, starts the next tasks' rollouts and is then killed with
SIGKILL. The test resumes in-process: finished-but-untrained groups are trained first with their
stored ids, logprobs and weight versions intact, the tasks that were in flight are re-run (their
partial trajectories aborted), and the order continues [2,3], [4,5], [6,7] (variant: batch 4
ends the epoch on a boundary and the next epoch starts cleanly at task 8).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from forgerl.datapool.sqlite import SQLitePool
from forgerl.scheduler.policies import Scheduler
from forgerl.types import Completion

REPO = Path(__file__).resolve().parents[2]


def completion(i: int, version: int) -> Completion:
    return Completion(prompt_ids=[1, 2, i], completion_ids=[10 + i, 2],
                      logprobs=[-0.1 * (i + 1), -1 / 3], weight_versions=[version, version],
                      weight_version=version, finish_reason="stop")


def run_rollout(pool: SQLitePool, sched: Scheduler, i: int, finish: bool = True) -> None:
    pool.add_task(i, {"item": i % 8})
    tid = pool.create_trajectory(i, 0)
    pool.add_completion(tid, completion(i, sched.version))
    if finish:
        pool.finish_trajectory(tid, "finished", reward=float(i))
        pool.finish_group(i)
        sched.on_group_finished(i, sched.version)


def train(pool: SQLitePool, sched: Scheduler) -> list[int] | None:
    """Fake optimizer step: consume the batch, commit marks + scheduler state atomically."""
    batch = sched.next_batch()
    if batch is not None:
        sched.on_trained(batch, sched.version + 1)
        pool.commit_trained(batch, sched.version, {"scheduler": sched.state()})
    return batch


CHILD = """
import sys, time
from forgerl.datapool.sqlite import SQLitePool
from forgerl.scheduler.policies import Scheduler, WindowedFifo
from tests.scheduler.test_resume import run_rollout, train
pool = SQLitePool(sys.argv[1])
sched = Scheduler(WindowedFifo(4), batch_size=int(sys.argv[2]), max_in_flight=4)
for i in sched.admit(sched.version):
    run_rollout(pool, sched, i)
print(train(pool, sched), flush=True)
for i in sched.admit(sched.version):  # in flight when the kill comes
    run_rollout(pool, sched, i, finish=False)
print("started", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(("k", "first", "after"), [
    (2, [0, 1], [[2, 3], [4, 5], [6, 7]]),
    (4, [0, 1, 2, 3], [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]),
])
def test_resume_after_sigkill(db_path, k, first, after):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(db_path), str(k)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == str(first)
    assert child.stdout.readline().strip() == "started"
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)

    pool = SQLitePool(db_path)
    in_flight = pool.task_indices("running")
    assert in_flight == [4, 5, 6, 7]  # max_in_flight=4 caps generating groups only
    sched = Scheduler.from_state(pool.get_meta("scheduler"))
    assert sched.resume(pool) == in_flight
    assert all(t.status == "aborted" for i in in_flight for t in pool.get_group(i).trajectories)
    batches = []
    while len(batches) < len(after):
        for i in sched.admit(sched.version):
            run_rollout(pool, sched, i)
        if k == 2 and not batches:  # buffered groups 2, 3 kept their exact tokens
            for i in (2, 3):
                (traj,) = pool.get_group(i).trajectories
                assert traj.completions == [completion(i, 0)] and traj.status == "finished"
        batches.append(train(pool, sched))
    assert batches == after
    trained = sorted(first + [i for b in after for i in b])
    assert pool.task_indices("trained") == trained  # each exactly once
    for i in in_flight:  # re-run: the aborted attempt plus one finished rollout
        assert [t.status for t in pool.get_group(i).trajectories] == ["aborted", "finished"]
    with pytest.raises(ValueError):
        pool.mark_trained([first[0]], step=99)
    if k == 4:
        assert [pool.get_task(i)["item"] for i in after[1]] == [0, 1, 2, 3]  # epoch 2
    pool.close()


def test_rerun_task_is_stamped_no_newer_than_its_kept_rollouts(db_path):
    """A re-run task keeps its finished rollouts: its dispatch version (what the lag bound
    counts from) is their oldest token's version, not the version at the re-run."""
    from forgerl.scheduler.policies import Fffo

    pool = SQLitePool(db_path)
    sched = Scheduler(Fffo(), batch_size=1, max_off_policy_steps=5, max_in_flight=1)
    assert sched.admit(0) == [0]
    pool.add_task(0, {"item": 0})
    kept = pool.create_trajectory(0, 0)
    pool.add_completion(kept, completion(0, 1))  # tokens of weight_version 1
    pool.finish_trajectory(kept, "finished", reward=1.0)
    pool.add_completion(pool.create_trajectory(0, 1), completion(0, 2))  # killed mid-rollout
    sched.version = 3  # the restored weights
    assert sched.resume(pool) == [0] and sched.kept_versions == {0: 1}
    assert sched.admit(3) == [0] and sched.queue.admitted == {0: 1}
    assert sched.kept_versions == {}
    pool.close()
