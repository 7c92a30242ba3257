"""The data pool on both backends (SQLitePool, PostgresPool on a real server): exact
round-trips, task lifecycle, crash durability, concurrent writer processes; SQLite's WAL mode.

Pins: every field of `Completion` / `Trajectory` comes back bit-exact (float64 logprobs, int ids,
per-token weight versions, sampling params); the file is in WAL mode with synchronous=FULL;
writes after a trajectory ended are refused; trained marks are exactly-once; a writer process
killed with SIGKILL mid-loop leaves every completion it reported committed intact (the durability
half of CASES.md C12; SQLite's file also passes `integrity_check`); and two processes writing the
same trajectories at once leave dense turn indices and lose nothing.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from forgerl.datapool import open_pool
from forgerl.datapool.sqlite import SQLitePool
from forgerl.types import Completion, Routes, SamplingParams

REPO = Path(__file__).resolve().parents[2]


def make_completion(i: int) -> Completion:
    """A completion whose every field depends on `i` (awkward floats included)."""
    n = 3 + i % 5
    return Completion(
        prompt_ids=[151644, 198, 77091, i, 2**31 - 1],
        completion_ids=[1000 + i + t for t in range(n)],
        logprobs=[-(t + 1) / 3.0 - i * 1e-17 for t in range(n)],
        weight_versions=[i // 2 + (t >= 1) for t in range(n)],
        weight_version=i // 2,
        finish_reason="tool_calls" if i % 2 else "length",
        sampling=SamplingParams(temperature=0.7, top_p=1.0, max_tokens=64 + i,
                                stop_token_ids=(151645, 2), seed=i),
        started_at=1_700_000_000.123456789 + i,
        ended_at=1_700_000_001.987654321 + i,
        token_exact=i % 3 != 0,
        extends_previous=i % 2 == 1,
        trace=i // 2,
        train=i != 2,
        request={"protocol": "messages", "ignored": ["metadata"], "i": i},
    )


@pytest.fixture(params=["sqlite", "postgres"])
def where(request: pytest.FixtureRequest, db_path: Path) -> str:
    """Where a pool lives: the SQLite file, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return str(db_path)
    return request.getfixturevalue("pg_url")


def test_completion_and_trajectory_round_trip_exactly(where):
    pool = open_pool(where)
    pool.add_task(3, {"question": "2+2?", "answer": 4})
    tid = pool.create_trajectory(3, rollout_index=1, trajectory_id="traj-a")
    assert tid == "traj-a"
    sent = [make_completion(i) for i in range(4)]
    assert [pool.add_completion(tid, c) for c in sent] == [0, 1, 2, 3]
    pool.finish_trajectory(tid, "finished", reward=0.1 + 0.2, turn_rewards=[0.1, -1e-300, 0, 2])
    pool.close()

    pool = open_pool(where)  # a fresh connection reads what the first one committed
    traj = pool.get_trajectory(tid)
    assert traj.completions == sent
    assert traj.completions[0].logprobs[0] == -1 / 3.0  # bit-exact float64
    assert traj.completions[1].sampling.stop_token_ids == (151645, 2)
    assert (traj.task_index, traj.rollout_index, traj.status) == (3, 1, "finished")
    assert traj.reward == 0.30000000000000004
    assert traj.turn_rewards == [0.1, -1e-300, 0, 2]
    assert traj.error is None
    assert 0 < traj.started_at <= traj.ended_at
    assert pool.get_task(3) == {"question": "2+2?", "answer": 4}
    pool.close()
    pool.close()  # idempotent


def test_wal_mode_and_full_sync(db_path):
    pool = SQLitePool(db_path)
    other = sqlite3.connect(db_path)
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert pool._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # 2 == FULL
    other.close()
    pool.close()


def test_errors_and_lifecycle(where):
    pool = open_pool(where)
    with pytest.raises(KeyError):
        pool.get_task(0)
    pool.add_task(0, {"q": 1})
    pool.add_task(0, {"q": 1})  # idempotent
    with pytest.raises(ValueError):
        pool.add_task(0, {"q": 2})
    with pytest.raises(KeyError):
        pool.add_completion("nope", make_completion(0))
    with pytest.raises(KeyError):
        pool.get_trajectory("nope")
    assert pool.task_indices("queued") == [0]
    a = pool.create_trajectory(0, 0)
    b = pool.create_trajectory(0, 1)
    padded = make_completion(0)
    padded.logprobs.pop()  # CASES.md C01: never stored without one logprob per sampled id
    with pytest.raises(ValueError, match=r"len\(completion_ids\) \(\d+\) != len\(logprobs\)"):
        pool.add_completion(a, padded)
    assert pool.get_trajectory(a).completions == []
    assert len(a) == 32 and a != b
    assert pool.task_indices("running") == [0]
    with pytest.raises(ValueError):
        pool.create_trajectory(0, 2, trajectory_id=a)
    with pytest.raises(ValueError):
        pool.finish_trajectory(a, "running")
    pool.finish_trajectory(a, "failed", error="agent crashed")
    with pytest.raises(ValueError):
        pool.add_completion(a, make_completion(0))
    with pytest.raises(ValueError):
        pool.finish_trajectory(a, "finished", reward=1.0)
    assert pool.finish_group(0) == [b]  # timeout finalisation aborts the straggler
    assert [t.status for t in pool.get_group(0).trajectories] == ["failed", "aborted"]
    assert pool.finished_group_task_indices() == [0]
    pool.mark_trained([0], step=5)
    with pytest.raises(ValueError):
        pool.mark_trained([0], step=6)
    with pytest.raises(KeyError):
        pool.mark_trained([9], step=6)
    assert pool.stats() == {
        "tasks_queued": 0, "tasks_running": 0, "tasks_finished": 0, "tasks_trained": 1,
        "trajectories_running": 0, "trajectories_finished": 0, "trajectories_failed": 1,
        "trajectories_aborted": 1, "trajectories_aborted_infra": 0, "completions": 0,
        "completion_tokens": 0,
    }
    pool.set_meta("scheduler", {"head": 1, "lags": [0, 1.5]})
    assert pool.get_meta("scheduler") == {"head": 1, "lags": [0, 1.5]}
    assert pool.get_meta("missing", 7) == 7
    pool.close()
    with pytest.raises(ValueError):
        pool.get_task(0)


def test_reset_commit_and_revert(where):
    pool = open_pool(where)
    for i in range(3):
        pool.add_task(i, {"i": i})
    done = pool.create_trajectory(1, 0)
    pool.add_completion(done, make_completion(1))
    pool.finish_trajectory(done, "finished", reward=1.0)
    partial = pool.create_trajectory(1, 1)
    pool.add_completion(partial, make_completion(2))
    pool.finish_trajectory(pool.create_trajectory(2, 0), "finished", reward=0.0)
    pool.finish_group(2)
    eval_id = pool.create_trajectory(-1, 0)  # eval session: no task row
    assert pool.reset_in_flight() == [1]
    assert pool.get_trajectory(partial).status == "aborted"
    assert pool.get_trajectory(eval_id).status == "aborted"
    assert pool.get_trajectory(done).status == "finished"  # finished work is kept
    assert pool.missing_rollouts(1, group_size=3) == [1, 2]
    assert pool.task_indices("queued") == [0, 1]
    assert pool.task_indices("finished") == [2]  # a finished group is trained, never re-run
    pool.commit_trained([2], step=4, meta={"scheduler": {"v": 5}})
    assert pool.get_meta("scheduler") == {"v": 5}
    with pytest.raises(ValueError):  # all or nothing: neither the mark nor the meta change
        pool.commit_trained([0, 2], step=5, meta={"scheduler": {"v": 6}})
    assert pool.get_meta("scheduler") == {"v": 5}
    assert pool.task_indices("trained") == [2]
    pool.untrain([2, 0])  # 0 is not trained: unchanged
    assert pool.finished_group_task_indices() == [2] and pool.task_indices("queued") == [0, 1]
    pool.discard([done, partial, "nope"], "lost weights")  # partial is aborted already
    assert pool.get_trajectory(done).status == "aborted"
    assert pool.get_trajectory(done).error == "lost weights"
    assert pool.missing_rollouts(1, group_size=3) == [0, 1, 2]
    pool.finish_group(1)
    pool.discard([pool.get_group(2).trajectories[0].id], "lost weights")
    assert pool.task_indices("queued") == [0, 2]  # a finished group goes back to the queue
    pool.close()


def test_an_infra_abort_is_kept_final_and_run_again(where):
    """C24: "aborted_infra" is a final status that keeps the trajectory's completions and error
    (nothing lost), refuses later writes, counts in stats, and leaves its rollout index to be
    run again by a redispatch pass or a resume."""
    pool = open_pool(where)
    pool.add_task(0, {"q": 0})
    killed, ok = pool.create_trajectory(0, 0), pool.create_trajectory(0, 1)
    pool.add_completion(killed, make_completion(3))
    pool.finish_trajectory(killed, "aborted_infra", error="infrastructure: agent killed")
    pool.finish_trajectory(ok, "finished", reward=1.0)
    got = pool.get_trajectory(killed)
    assert (got.status, got.reward, got.error) == ("aborted_infra", None,
                                                   "infrastructure: agent killed")
    assert got.completions == [make_completion(3)]
    with pytest.raises(ValueError):
        pool.add_completion(killed, make_completion(4))
    assert pool.missing_rollouts(0, group_size=2) == [0]
    assert pool.stats()["trajectories_aborted_infra"] == 1
    pool.close()


def test_concurrent_threads_get_distinct_turns(where):
    pool = open_pool(where)
    tid = pool.create_trajectory(0, 0)
    turns: list[int] = []

    def writer(k: int) -> None:
        for j in range(20):
            turns.append(pool.add_completion(tid, make_completion(k * 100 + j)))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(turns) == list(range(80))
    assert len(pool.get_trajectory(tid).completions) == 80
    pool.close()


CHILD = """
import sys
from forgerl.datapool import open_pool
from tests.datapool.test_sqlite import make_completion
pool = open_pool(sys.argv[1])
tid = pool.create_trajectory(0, 0, trajectory_id="t")
i = 0
while True:
    pool.add_completion(tid, make_completion(i))
    i += 1
    print(i, flush=True)
"""


def test_sigkill_mid_write_loses_no_committed_completion(where):
    child = subprocess.Popen([sys.executable, "-c", CHILD, where], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    reported = 0
    while reported < 200:
        reported = int(child.stdout.readline())
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    for line in child.stdout.read().split():  # lines written before the kill
        reported = int(line)
    assert child.returncode == -signal.SIGKILL

    if not where.startswith("postgresql://"):
        raw = sqlite3.connect(where)
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        raw.close()
    pool = open_pool(where)
    completions = pool.get_trajectory("t").completions
    # Committed before the print, so at most one commit can be unreported.
    assert reported <= len(completions) <= reported + 1
    assert completions == [make_completion(i) for i in range(len(completions))]
    pool.close()


WRITER = """
import sys
from forgerl.datapool import open_pool
from tests.datapool.test_sqlite import make_completion
pool, k = open_pool(sys.argv[1]), int(sys.argv[2])
print("ready", flush=True)
sys.stdin.readline()  # both writers start together
for j in range(30):
    c = make_completion(1000 * k + j)
    if j % 2:  # a group commit of two calls on two of the shared trajectories
        got = pool.record_calls([(f"s{j % 3}", [c], [["tool_error"]]),
                                 (f"s{(j + 1) % 3}", [c], [[]])])
        assert all(isinstance(turns, list) for turns in got), got
    else:
        pool.add_completion(f"s{j % 3}", c)
    pool.create_trajectory(k, j, trajectory_id=f"own-{k}-{j}")
print("done", flush=True)
"""


def test_two_writer_processes_keep_turns_dense_and_lose_nothing(where):
    """Two processes write completions (single and group commits) to the same three
    trajectories and create trajectories at once: every write lands exactly once, each
    trajectory's turns are 0..n-1, and every created trajectory got its own seq."""
    pool = open_pool(where)
    for t in range(3):
        pool.create_trajectory(-1, t, trajectory_id=f"s{t}")
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, where, str(k)], cwd=REPO,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for k in (1, 2)]
    assert [w.stdout.readline() for w in writers] == ["ready\n"] * 2
    for w in writers:
        w.stdin.write("go\n")
        w.stdin.flush()
    for w in writers:
        assert w.communicate(timeout=120)[0] == "done\n" and w.returncode == 0
    stored = [pool.get_trajectory(f"s{t}").completions for t in range(3)]
    assert sum(len(c) for c in stored) == 2 * (15 + 2 * 15)  # per writer: 15 single, 15 x 2
    turns = pool._read("SELECT trajectory_id, turn FROM completions ORDER BY trajectory_id, turn")
    for t in range(3):
        assert [turn for tid, turn in turns if tid == f"s{t}"] == list(range(len(stored[t])))
    expected = sorted(
        c.logprobs[0] for k in (1, 2) for j in range(30)
        for c in [make_completion(1000 * k + j)] * (1 + j % 2))
    assert sorted(c.logprobs[0] for cs in stored for c in cs) == expected  # bit-exact
    seqs = pool._read("SELECT seq FROM trajectories ORDER BY seq")
    assert [s for (s,) in seqs] == list(range(3 + 60))
    assert sum(e.kind == "tool_error" for t in range(3)
               for e in pool.get_trajectory(f"s{t}").events) == 2 * 15
    pool.close()


def test_pool_written_before_traces_gets_the_new_columns(db_path):
    """A pool file from before `trace`, `train` and `request` existed opens, and its rows read
    with their defaults (trace 0, trained, no request notes); new rows keep their values."""
    db = sqlite3.connect(db_path)
    db.executescript(
        "CREATE TABLE completions (trajectory_id TEXT NOT NULL, turn INTEGER NOT NULL,"
        " prompt_ids BLOB NOT NULL, completion_ids BLOB NOT NULL, logprobs BLOB NOT NULL,"
        " weight_versions BLOB NOT NULL, weight_version INTEGER NOT NULL,"
        " finish_reason TEXT NOT NULL, sampling TEXT NOT NULL, started_at REAL NOT NULL,"
        " ended_at REAL NOT NULL, token_exact INTEGER NOT NULL,"
        " extends_previous INTEGER NOT NULL, PRIMARY KEY (trajectory_id, turn));"
    )
    db.close()
    pool = SQLitePool(db_path)
    pool.add_task(0, {})
    tid = pool.create_trajectory(0, rollout_index=0, trajectory_id="old")
    pool.add_completion(tid, make_completion(1))
    pool.close()
    db = sqlite3.connect(db_path)
    db.execute("INSERT INTO completions (trajectory_id, turn, prompt_ids, completion_ids,"
               " logprobs, weight_versions, weight_version, finish_reason, sampling,"
               " started_at, ended_at, token_exact, extends_previous) SELECT trajectory_id, 1,"
               " prompt_ids, completion_ids, logprobs, weight_versions, weight_version,"
               " finish_reason, sampling, started_at, ended_at, token_exact, extends_previous"
               " FROM completions WHERE turn=0")
    db.commit()
    db.close()
    pool = SQLitePool(db_path)
    first, old_row = pool.get_trajectory(tid).completions
    assert first == make_completion(1)
    assert (old_row.trace, old_row.train, old_row.request) == (0, True, {})
    assert old_row.routed_experts is None  # the routed_experts column was added too
    pool.close()


def test_routed_experts_round_trip_as_one_blob(where):
    """A MoE turn's routes come back equal (a uint8 blob behind a 4-byte header); a dense
    turn's are NULL."""
    pool = open_pool(where)
    pool.add_task(0, {})
    tid = pool.create_trajectory(0, rollout_index=0, trajectory_id="moe")
    moe = make_completion(1)
    moe.routed_experts = Routes(bytes(range(7)) * 12, layers=3, top_k=2)  # 14 tokens
    pool.add_completion(tid, moe)
    pool.add_completion(tid, make_completion(2))
    got, dense = pool.get_trajectory(tid).completions
    assert got == moe and len(got.routed_experts) == 14 and dense.routed_experts is None
    blob = pool._read("SELECT routed_experts FROM completions WHERE turn=0", ())[0][0]
    assert len(blob) == 4 + 84
    pool.close()
