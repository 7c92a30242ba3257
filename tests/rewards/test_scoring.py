"""Out-of-process reward scoring pins (CASES.md C13, hanging and failing verifiers).

Semantics pinned: in a group of 8 where the verifier busy-loops in pure CPU on sample 3 and
raises ValueError on sample 5, with a 1 s per-sample timeout, scoring returns in about 1 s, the
two bad samples get the fallback with status timeout / error (counted), the 6 others get their
exact rewards in input order, and the looping process is killed and reaped (no orphan), along
with any child process it started. Items never fork the caller: their parent is the fork server.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forgerl.rewards.scoring import ScoreResult, score_with_timeout, status_counts, submit


def verifier(sample: int, pid_dir: str) -> float:
    """Sample 3 loops forever (after starting a sleeping child), 5 raises, others give i/8."""
    Path(pid_dir, str(sample)).write_text(str(os.getpid()))
    if sample == 3:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        Path(pid_dir, "child").write_text(str(child.pid))
        while True:
            pass
    if sample == 5:
        raise ValueError("malformed answer")
    return sample / 8


def parent_pid() -> float:
    return float(os.getppid())


def pids_and_modules(x: int) -> tuple[int, int, int, bool]:
    """What `submit` ran: x squared, its own pid and parent pid, and whether reasoning-gym was
    already imported when it started (the fork server preloads it)."""
    return x * x, os.getpid(), os.getppid(), "reasoning_gym" in sys.modules


def refuse(message: str) -> None:
    raise KeyError(message)


def odd_values(kind: str) -> float:
    if kind == "nan":
        return math.nan
    if kind == "exit":
        os._exit(3)
    return 0.25


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent, or a zombie waiting for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def test_c13_hanging_and_failing_verifier(tmp_path):
    items = [(i, str(tmp_path)) for i in range(8)]
    start = time.monotonic()
    results = score_with_timeout(verifier, items, timeout_s=1.0, fallback=-1.0)
    elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 4.0  # 1 s timeout + forks (~0.1 s each); far from "forever"
    expected = [ScoreResult(i / 8, "ok") for i in range(8)]
    expected[3] = ScoreResult(-1.0, "timeout", "no reward in 1.0 s")
    expected[5] = ScoreResult(-1.0, "error", "ValueError: malformed answer")
    assert results == expected
    assert status_counts(results) == {"reward_timeouts": 1, "reward_errors": 1}
    looping = int((tmp_path / "3").read_text())
    assert not Path(f"/proc/{looping}").exists()  # killed and reaped by us
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 2.0
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone(child)


def test_non_finite_or_silent_death_is_an_error():
    results = score_with_timeout(odd_values, [("nan",), ("exit",), ("ok",)], timeout_s=5.0)
    assert [r.status for r in results] == ["error", "error", "ok"]
    assert [r.reward for r in results] == [0.0, 0.0, 0.25]
    assert results[0].error == "reward nan"


def test_more_items_than_workers_keeps_order(tmp_path):
    items = [(i, str(tmp_path)) for i in (0, 1, 2, 4, 6, 7)]
    results = score_with_timeout(verifier, items, timeout_s=5.0, max_workers=2)
    assert [r.reward for r in results] == [0.0, 0.125, 0.25, 0.5, 0.75, 0.875]
    assert all(r.status == "ok" for r in results)


def test_items_are_forked_by_the_fork_server_not_by_the_caller():
    """Forking the run's multi-GB process per item left all its pages copy-on-write; the items'
    parent is multiprocessing's fork server instead, one for every call."""
    first, second = score_with_timeout(parent_pid, [(), ()], timeout_s=30.0)
    assert first.status == second.status == "ok"
    assert first.reward == second.reward != os.getpid()


def test_submit_runs_in_a_fork_server_child_with_reasoning_gym_preloaded():
    """The run makes its tasks this way while it imports torch: in a child of the same fork
    server that later scores (its parent), never in this process; errors come back as raised."""
    square, pid, parent, preloaded = submit(pids_and_modules, 7).result(timeout=60)
    assert square == 49 and pid != os.getpid() and parent != os.getpid() and preloaded
    [scorer_parent] = score_with_timeout(parent_pid, [()], timeout_s=30.0)
    assert scorer_parent.reward == parent  # one fork server for both
    future = submit(refuse, "no such dataset")
    with pytest.raises(KeyError, match="no such dataset"):
        future.result(timeout=60)


def test_submit_leaves_nothing_behind_a_sigkilled_caller():
    """A run killed while its task generation runs: the child, and the fork server, end on
    their own, silently (a pool worker used to wait forever on its own pipe, holding the run's
    stderr, so whoever waited for the run's output hung)."""
    script = ("import time\nfrom forgerl.rewards.scoring import submit\n"
              "submit(time.sleep, 3.0)\ntime.sleep(1.0)\nprint('submitted', flush=True)\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "submitted\n"
    proc.kill()
    _, err = proc.communicate(timeout=30)  # every holder of its stdout / stderr is gone
    assert proc.returncode == -9 and err == ""  # the orphan's failed send says nothing
