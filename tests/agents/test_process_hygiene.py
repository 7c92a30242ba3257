"""CASES.md C24: tool processes die with their call, an agent cannot reach the run's processes,
and an agent killed from outside is told apart from one that failed on its own.

Real processes throughout (`sh`, `sleep`, `setsid`, real SIGKILL). Every process an episode
starts carries a test mark in its environment, so "zero surviving descendants" is checked in
/proc, including processes that left the agent's process group (setsid, a double fork) and were
re-parented away from this test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from forgerl.agents.reaper import Reaper
from forgerl.agents.runner import INFRA_EXIT, AgentResult, infra_cause, run_command_agent

TASK = {"question": "What is 2 + 3?"}
URL, KEY = "http://127.0.0.1:9/v1", "sk-rollout-7"
MARK = "C24_TEST_MARK"

# Background children of every kind: plain `&`, one ignoring SIGTERM, one in its own session
# (setsid), a double fork whose middle process exits at once (the grandchild is re-parented
# away from the agent), all holding the agent's stdout and stderr; then the agent waits.
SPAWNER = """
sleep 100 &
sh -c 'trap "" TERM; sleep 100' &
setsid sleep 100 &
( setsid sh -c 'sleep 100 & exit 0' & )
echo spawned
wait
"""


def marked(mark: str) -> set[int]:
    """Live (not zombie) processes whose environment holds MARK=mark."""
    needle = f"{MARK}={mark}".encode()
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError):
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX":
                found.add(int(entry.name))
    return found


def descendants(root: int) -> set[int]:
    """Live descendants of `root` (by parent pid, from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] not in "ZX":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def settle(mark: str, within_s: float = 2.0) -> set[int]:
    """The marked processes left after up to `within_s` (the kernel finishes a kill)."""
    deadline = time.monotonic() + within_s
    while (left := marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def test_background_children_die_with_a_timed_out_call_x20():
    """20 episodes (four waves of 5 at once), each spawning 5 background processes of every
    kind, with a 1 s timeout: each result is a timeout within 3 s, no marked process survives
    (none of 100), and this test's descendants are back to what they were."""
    mark, before = uuid.uuid4().hex, descendants(os.getpid())
    seen: list[int] = []

    async def wave() -> list[tuple[AgentResult, float]]:
        async def one() -> tuple[AgentResult, float]:
            start = time.monotonic()
            result = await run_command_agent(["sh", "-c", SPAWNER], TASK, URL, KEY, 1.0,
                                             env={MARK: mark})
            return result, time.monotonic() - start

        episodes = asyncio.gather(*(one() for _ in range(5)))
        await asyncio.sleep(0.8)
        seen.append(len(marked(mark)))  # mid-episode: the children really run
        return await episodes

    results = [r for _ in range(4) for r in asyncio.run(wave())]
    assert len(results) == 20
    for result, seconds in results:
        assert result.status == "timeout" and result.returncode == -signal.SIGTERM
        assert 1.0 <= seconds <= 3.0 and result.answer is None
        assert infra_cause(result) is None  # a timeout is the policy's: trained as failed
    assert min(seen) >= 5 * 6  # per episode: sh, 2 sleeps, sh + sleep, setsid sleep, sleep
    assert settle(mark) == set()
    assert descendants(os.getpid()) == before


def test_kill_term_0_by_the_agent_kills_only_its_own_group():
    """An agent running `kill -TERM 0` ends its own process group (a task failure, exit
    -SIGTERM): a sibling in this test's process group and the run's reaper (the processes next
    to the gateway and trainer) keep their pids, and no marked process survives."""
    mark = uuid.uuid4().hex
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    reaper = Reaper()
    reaper.env()  # starts the reaper process
    assert reaper._proc is not None
    # this process group's long-lived members: the test, its parent (pytest's controller under
    # xdist, else the shell) and the sibling; other workers' children come and go on their own
    group = {p for p in (os.getpid(), os.getppid(), sibling.pid) if _pgid(p) == os.getpgrp()}
    assert sibling.pid in group
    try:
        start = time.monotonic()
        result = asyncio.run(run_command_agent(
            ["sh", "-c", "sleep 100 & setsid sleep 100 & kill -TERM 0; sleep 30"], TASK, URL,
            KEY, 10.0, env={MARK: mark}))
        assert time.monotonic() - start < 3.0
        assert result.status == "failed" and result.returncode == -signal.SIGTERM
        assert infra_cause(result) is None
        assert settle(mark) == set()
        assert sibling.poll() is None and reaper._proc.poll() is None
        assert {p for p in group if _pgid(p) == os.getpgrp()} == group  # none was killed
    finally:
        sibling.kill()
        sibling.wait()
        reaper.close()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_an_aborted_session_leaves_no_process():
    """A rollout cancelled mid-episode (Ctrl-C, shutdown, a session aborted by the run): the
    cancellation returns within the grace period and no marked process survives, the setsid
    and double-forked ones included."""
    mark = uuid.uuid4().hex

    async def main() -> None:
        rollout = asyncio.create_task(run_command_agent(
            ["sh", "-c", SPAWNER], TASK, URL, KEY, 60.0, env={MARK: mark}, grace_s=0.5))
        deadline, counts = time.monotonic() + 5.0, [0, 0]
        try:
            while counts[-2:] != [6, 6] and time.monotonic() < deadline:  # all 6 up, no passing
                await asyncio.sleep(0.05)
                counts.append(len(marked(mark)))
        finally:
            rollout.cancel()
            with pytest.raises(asyncio.CancelledError):
                await rollout
        assert counts[-2:] == [6, 6], counts

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 5.0
    assert settle(mark) == set()


@pytest.mark.parametrize(("script", "code", "infra"), [
    ("echo $$ > pid; sleep 30", -signal.SIGKILL, True),  # SIGKILL from outside (this test)
    ("kill -TERM $$; sleep 30", -signal.SIGTERM, False),  # its own signal: a task failure
    (f"exit {INFRA_EXIT}", INFRA_EXIT, True),  # EX_TEMPFAIL: its sandbox failed
    ("exit 3", 3, False),  # an ordinary crash
])
def test_infra_cause_tells_an_outside_kill_from_the_agents_own_failure(tmp_path, script, code,
                                                                       infra):
    async def main() -> AgentResult:
        episode = asyncio.create_task(run_command_agent(["sh", "-c", script], TASK, URL, KEY,
                                                        10.0, cwd=str(tmp_path)))
        if "pid" in script:
            while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
                await asyncio.sleep(0.02)
            os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)
        return await episode

    result = asyncio.run(main())
    assert result.status == "failed" and result.returncode == code
    cause = infra_cause(result)
    assert (cause is not None) == infra
    if code == -signal.SIGKILL:
        assert cause == "agent killed by SIGKILL from outside (OOM killer, sandbox or operator)"


def test_infra_cause_rule_table():
    """The rest of the rule on hand-made results: a finished agent is never an abort, even
    after engine errors; one that could not start is; engine errors make a failure or a
    timeout an abort; a timeout killed by the runner's own SIGKILL is not."""
    def res(status: str, code: int | None, started: bool = True) -> AgentResult:
        return AgentResult(None, status, code, "", 1.0, started)  # type: ignore[arg-type]

    assert infra_cause(res("finished", 0), engine_errors=2) is None
    assert infra_cause(res("failed", None, started=False)) == "agent could not be started"
    assert infra_cause(res("timeout", -signal.SIGKILL)) is None
    assert infra_cause(res("failed", 1), engine_errors=2) == (
        "the engine failed 2 model call(s) of this session")
    assert infra_cause(res("timeout", -signal.SIGTERM), engine_errors=1) == (
        "the engine failed 1 model call(s) of this session")
    assert infra_cause(res("failed", 1)) is None
