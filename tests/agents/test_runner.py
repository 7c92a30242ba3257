"""Black-box agent runner pins: answers, failures, timeouts and cancellation without orphans.

Semantics pinned: a command agent gets the gateway URL, its key and the task (env and stdin) and
its answer is the last non-empty stdout line; a non-zero exit is "failed" with stderr kept; at
the timeout, or when the rollout task is cancelled (Ctrl-C), the agent's whole process group,
grandchildren included, is killed and reaped, even when they ignore SIGTERM. A callable agent
gets the same result type. Real processes throughout, no mocks.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from forgerl.agents.runner import (
    LOG_KEEP,
    AgentResult,
    run_agent,
    run_callable_agent,
    run_command_agent,
)

TASK = {"question": "What is 2 + 3?", "answer": "5"}
URL, KEY = "http://127.0.0.1:9/v1", "sk-rollout-7"


def write(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return [sys.executable, str(path)]


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a zombie is dead, awaiting its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_dead(pid: int, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not alive(pid)


# An agent that spawns a grandchild ignoring SIGTERM, records both pids, then hangs.
HANGING = """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN) if "--stubborn" in sys.argv else None
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    print("partial output", flush=True)
    time.sleep(600)
"""


async def wait_pids(path: Path) -> tuple[int, int]:
    while not path.exists():
        await asyncio.sleep(0.02)
    leader, child = path.read_text().split()
    return int(leader), int(child)


def test_answer_is_last_nonempty_stdout_line(tmp_path):
    agent = write(
        tmp_path,
        "agent.py",
        """
        import json, os, sys
        task = json.loads(sys.stdin.read())
        assert task == json.loads(os.environ["FORGERL_TASK"])
        print("thinking about", task["question"])
        print(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])
        print(os.environ["ANTHROPIC_BASE_URL"], os.environ["EXTRA"])
        print("  5  ")
        print("")
        print("log line on stderr", file=sys.stderr)
    """,
    )
    result = asyncio.run(
        run_command_agent(agent, TASK, URL, KEY, 10.0, cwd=str(tmp_path), env={"EXTRA": "x"})
    )
    assert result.status == "finished" and result.returncode == 0
    assert result.answer == "5"
    assert result.stderr_tail == "log line on stderr\n"
    assert 0.0 < result.seconds < 10.0


def test_env_and_stdin_reach_the_agent(tmp_path):
    agent = write(
        tmp_path,
        "echo.py",
        """
        import json, os, sys
        print(json.dumps([os.environ[k] for k in
              ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY")]
              + [json.loads(sys.stdin.read())]))
    """,
    )
    result = asyncio.run(run_command_agent(agent, TASK, URL, KEY, 10.0))
    assert json.loads(result.answer) == [URL, KEY, "http://127.0.0.1:9", KEY, TASK]


def test_crashing_agent_is_failed_with_stderr(tmp_path):
    agent = write(
        tmp_path,
        "crash.py",
        """
        print("42")
        raise ValueError("tool exploded")
    """,
    )
    result = asyncio.run(run_command_agent(agent, TASK, URL, KEY, 10.0))
    assert result.status == "failed"
    assert result.returncode == 1
    assert result.answer is None
    assert "ValueError: tool exploded" in result.stderr_tail


def test_a_chatty_agents_log_keeps_its_head_and_tail(tmp_path):
    """3 MB of stderr per episode leave LOG_KEEP bytes in the log file (a chatty agent wrote
    6.1 GB in 28 s): its first and last halves around a line naming the cut; a second episode
    appends after the first, cut alike; the result's tail is the stream's real end."""
    agent = write(tmp_path, "chatty.py", """
        import sys
        sys.stderr.write("HEAD" + "a" * 1_500_000 + "b" * 1_500_000 + "TAIL")
        print(5)
    """)
    log = tmp_path / "logs" / "r.log"
    for episode in (1, 2):
        result = asyncio.run(run_command_agent(agent, TASK, URL, KEY, 30.0, log_path=log))
        assert result.status == "finished" and result.stderr_tail.endswith("b" * 100 + "TAIL")
        text = log.read_text()
        marker = f"\n[... {3_000_008 - LOG_KEEP} bytes of stderr cut ...]\n"
        assert len(text) == episode * (LOG_KEEP + len(marker))
        assert text.startswith("HEAD" + "a" * 100) and text.endswith("b" * 100 + "TAIL")
        assert text.count(marker) == episode and text.count("HEAD") == episode


def test_missing_program_is_failed():
    result = asyncio.run(run_command_agent(["/nonexistent/agent"], TASK, URL, KEY, 10.0))
    assert result.status == "failed" and result.returncode is None and result.answer is None
    assert "/nonexistent/agent" in result.stderr_tail


@pytest.mark.parametrize("stubborn", [False, True])
def test_hanging_agent_and_grandchild_killed_at_timeout(tmp_path, stubborn):
    pids = tmp_path / "pids"
    agent = write(tmp_path, "hang.py", HANGING) + [str(pids)] + (["--stubborn"] if stubborn else [])
    start = time.monotonic()
    result = asyncio.run(run_command_agent(agent, TASK, URL, KEY, 1.0, grace_s=0.5))
    elapsed = time.monotonic() - start
    leader, child = (int(p) for p in pids.read_text().split())
    assert result.status == "timeout" and result.answer is None
    # SIGTERM kills a default leader; a stubborn one needs the SIGKILL after the grace.
    assert result.returncode == (-9 if stubborn else -15)
    assert 1.0 <= elapsed < (2.5 if stubborn else 2.0)
    assert not alive(leader)  # reaped by the runner: no zombie left either
    assert wait_dead(child)  # the SIGTERM-ignoring grandchild got SIGKILL


def test_finished_agent_leftover_child_is_killed(tmp_path):
    pidfile = tmp_path / "bg"
    agent = write(
        tmp_path,
        "daemon.py",
        f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        print("7")
    """,
    )
    result = asyncio.run(run_command_agent(agent, TASK, URL, KEY, 10.0))
    assert result.status == "finished" and result.answer == "7"
    assert wait_dead(int(pidfile.read_text()))


def test_cancellation_kills_the_process_group(tmp_path):
    pids = tmp_path / "pids"
    agent = [*write(tmp_path, "hang.py", HANGING), str(pids), "--stubborn"]

    async def main() -> tuple[int, int]:
        rollout = asyncio.create_task(run_command_agent(agent, TASK, URL, KEY, 60.0, grace_s=0.3))
        leader, child = await wait_pids(pids)
        assert alive(leader) and alive(child)
        rollout.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rollout
        return leader, child

    start = time.monotonic()
    leader, child = asyncio.run(main())
    assert time.monotonic() - start < 10.0
    assert not alive(leader)
    assert wait_dead(child)


def test_callable_agent_paths():
    async def good(task: dict, base_url: str, api_key: str) -> str:
        assert (base_url, api_key) == (URL, KEY)
        return f" {task['answer']}\n"

    async def bad(task: dict, base_url: str, api_key: str) -> str:
        raise KeyError("no such tool")

    async def slow(task: dict, base_url: str, api_key: str) -> str:
        await asyncio.sleep(60)
        return "never"

    async def main() -> list[AgentResult]:
        return [
            await run_callable_agent(good, TASK, URL, KEY, 5.0),
            await run_callable_agent(bad, TASK, URL, KEY, 5.0),
            await run_callable_agent(slow, TASK, URL, KEY, 0.2),
            await run_agent(good, TASK, URL, KEY, 5.0),
        ]

    ok, failed, timed_out, dispatched = asyncio.run(main())
    assert (ok.answer, ok.status, ok.returncode) == ("5", "finished", None)
    assert failed.status == "failed" and "KeyError: 'no such tool'" in failed.stderr_tail
    assert timed_out.status == "timeout" and 0.2 <= timed_out.seconds < 3.0
    assert dispatched == AgentResult("5", "finished", None, "", dispatched.seconds)
