"""SQLitePool and PostgresPool behave the same, call for call: a differential test drives both
with one random sequence of DataPool calls (hypothesis) and compares every result and every
read, and the edge values pin what both do: 64-bit task indices and the first int past them,
NUL characters (PostgreSQL's text cannot hold one; SQLite's can), NaN (SQLite stores NULL),
an empty per-policy reward dict, empty completions, NaN/inf logprobs, long token lists."""

from __future__ import annotations

import math
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forgerl.datapool import open_pool
from forgerl.types import Completion

TABLES = "tasks, trajectories, completions, events, meta"


def completion(n: int = 1, logprob: float = -0.5, **fields) -> Completion:
    return Completion(prompt_ids=[1, 2], completion_ids=[7] * n, logprobs=[logprob] * n,
                      weight_versions=[0] * n, weight_version=0,
                      **{"finish_reason": "stop", **fields})


def outcome(call) -> object:
    """What a call gives: its value, or its exception's type (the message may differ)."""
    try:
        return ("ok", call())
    except Exception as e:  # the type is what both backends must agree on
        return ("raised", type(e).__name__)


@pytest.fixture
def pools(tmp_path: Path, pg_url: str):
    sqlite, pg = open_pool(tmp_path / "p.sqlite"), open_pool(pg_url)
    yield sqlite, pg
    sqlite.close(), pg.close()


EDGES = {  # name: (calls on a pool with task 1 and running trajectory "t", the expected outcome)
    "largest task index": (lambda p: (p.add_task(2**63 - 1, {}), p.get_task(2**63 - 1)),
                           ("ok", (None, {}))),
    "smallest task index": (lambda p: (p.add_task(-2**63, {}), p.get_task(-2**63)),
                            ("ok", (None, {}))),
    "task index 2**63": (lambda p: p.add_task(2**63, {}), ("raised", "OverflowError")),
    "reading task 2**63": (lambda p: p.get_task(2**63), ("raised", "OverflowError")),
    "trained at step 2**63": (lambda p: p.mark_trained([1], 2**63), ("raised", "OverflowError")),
    "NUL in a payload": (lambda p: (p.add_task(2, {"q": "a\x00b"}), p.get_task(2)),
                         ("ok", (None, {"q": "a\x00b"}))),
    "NUL in an error": (lambda p: (p.finish_trajectory("t", "failed", error="bad\x00out"),
                                   p.get_trajectory("t").error), ("ok", (None, "bad\\x00out"))),
    "NUL in a trajectory id": (lambda p: p.create_trajectory(1, 0, "a\x00b"),
                               ("raised", "ValueError")),
    "reading a NUL id": (lambda p: p.get_trajectory("a\x00b"), ("raised", "KeyError")),
    "a completion on a NUL id": (lambda p: p.add_completion("a\x00b", completion()),
                                 ("raised", "KeyError")),
    "NUL in an event kind": (lambda p: (p.add_completion("t", completion()),
                                        p.add_event("t", "k\x00")), ("raised", "ValueError")),
    "NUL in a meta key": (lambda p: p.set_meta("k\x00", 1), ("raised", "ValueError")),
    "reading a NUL meta key": (lambda p: p.get_meta("k\x00", "none"), ("ok", "none")),
    "NUL in a finish_reason": (lambda p: [type(r).__name__ for r in p.record_calls([
        ("t", [completion(finish_reason="st\x00p")], [[]]), ("a\x00b", [completion()], [[]]),
        ("t", [completion()], [["tool_error"]])])], ("ok", ["ValueError", "KeyError", "list"])),
    "NaN reward": (lambda p: p.finish_trajectory("t", "finished", reward=math.nan),
                   ("raised", "ValueError")),
    "inf reward": (lambda p: (p.finish_trajectory("t", "finished", reward=-math.inf),
                              p.get_trajectory("t").reward), ("ok", (None, -math.inf))),
    "NaN started_at": (lambda p: p.add_completion("t", completion(started_at=math.nan)),
                       ("raised", "ValueError")),
    "empty per-policy rewards": (lambda p: (p.finish_trajectory(
        "t", "finished", reward=0.0, policy_rewards={}), p.get_trajectory("t").policy_rewards),
                                 ("ok", (None, {}))),
    "empty completion, NaN logprob, long list": (lambda p: (
        p.add_completion("t", completion(0)), p.add_completion("t", completion(2, math.nan)),
        p.add_completion("t", completion(100_000, -math.inf)),
        [c.completion_ids[:3] for c in p.get_trajectory("t").completions]),
        ("ok", (0, 1, 2, [[], [7, 7], [7, 7, 7]]))),
}


@pytest.mark.parametrize("name", list(EDGES))
def test_edge_values_behave_the_same_on_both_backends(pools, name):
    call, expected = EDGES[name]
    got = []
    for pool in pools:
        pool.add_task(1, {"q": 1})
        pool.create_trajectory(1, 0, "t")
        got.append(outcome(lambda pool=pool: call(pool)))
        assert pool.stats()["tasks_running"] == 1  # the pool is still usable
    assert got == [expected, expected]


TID = st.sampled_from(["a", "b", "ümlaut ✓", "x\x00y"])  # "": a new uuid, not comparable
TEXT = st.one_of(TID, st.just(""))
INDEX = st.sampled_from([0, 1, -1, 2**63 - 1, -2**63, 2**63])
REAL = st.sampled_from([0.5, -1.0, math.inf, math.nan, None])
CALLS = st.one_of(
    st.tuples(st.just("add_task"), INDEX, st.dictionaries(TEXT, TEXT, max_size=2)),
    st.tuples(st.just("create_trajectory"), INDEX, st.integers(0, 2), TID),
    st.tuples(st.just("add_completion"), TID, st.integers(0, 3), TEXT, REAL),
    st.tuples(st.just("add_event"), TID, TEXT, st.sampled_from([None, 0, 1])),
    st.tuples(st.just("finish_trajectory"), TID, st.sampled_from(["finished", "failed"]),
              REAL, st.one_of(st.none(), TEXT)),
    st.tuples(st.just("mark_trained"), st.lists(INDEX, max_size=2), INDEX),
    st.tuples(st.just("finish_group"), INDEX),
    st.tuples(st.just("reset_in_flight")),
    st.tuples(st.just("discard"), st.lists(TID, max_size=2), TEXT),
    st.tuples(st.just("untrain"), st.lists(INDEX, max_size=2)),
    st.tuples(st.just("set_meta"), TEXT, st.one_of(st.integers(), TEXT)),
)


def apply(pool, call: tuple) -> object:
    name, *args = call
    if name == "add_completion":
        tid, n, reason, start = args
        args = [tid, completion(n, finish_reason=reason, started_at=0.0 if start is None
                                else start)]
    elif name == "finish_trajectory":
        tid, status, reward, error = args
        return outcome(lambda: pool.finish_trajectory(tid, status, reward=reward, error=error))
    return outcome(lambda: getattr(pool, name)(*args))


def reads(pool, tids: set[str]) -> list[object]:
    """Everything a reader sees (trajectory timestamps are the pool's clock: left out)."""
    out: list[object] = [pool.stats(), pool.task_indices(), pool.finished_group_task_indices()]
    for i in pool.task_indices():
        group = pool.get_group(i)
        out += [pool.get_task(i), pool.missing_rollouts(i, 3),
                [(t.id, t.status, t.error, repr(t.reward), t.completions, t.events)
                 for t in group.trajectories]]
    out += [outcome(lambda t=t: pool.get_trajectory(t).status) for t in sorted(tids)]
    out += [pool.get_meta(k) for k in ("a", "b", "ümlaut ✓", "")]
    return out


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(CALLS, max_size=12))
def test_a_random_call_sequence_gives_the_same_results_and_reads(pools, calls):
    sqlite, pg = pools
    with psycopg.connect(pg.url, autocommit=True) as conn:  # each example starts empty
        conn.execute(f"TRUNCATE {TABLES}")
    for table in TABLES.split(", "):
        sqlite._conn.execute(f"DELETE FROM {table}")
    tids = {c[3] for c in calls if c[0] == "create_trajectory"}
    for call in calls:
        assert apply(sqlite, call) == apply(pg, call), call
    assert repr(reads(sqlite, tids)) == repr(reads(pg, tids))
