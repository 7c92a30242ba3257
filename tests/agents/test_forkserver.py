"""The agent fork server (`[agent] preload`; unset: the script's installed imports): a Python
script agent forked from a process that already imported its heavy modules keeps the
command-agent contract of a plain process: stdin task, environment, cwd, argv, answer on the
last stdout line, stderr appended to its log, exit codes, its own process group killed whole at
the timeout, the reaper's tag in /proc/PID/environ; and the controller runs a real
openai-client agent through it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time

import pytest

from forgerl.agents.forkserver import ForkServer
from forgerl.agents.runner import run_command_agent

AGENT = textwrap.dedent('''
    import json, os, subprocess, sys, time
    task = json.loads(sys.stdin.read())
    print("started", file=sys.stderr)
    mode = task["question"]
    if mode == "crash":
        raise RuntimeError("boom")
    if mode == "exit3":
        sys.exit(3)
    if mode == "hang":  # a grandchild in the same group, then hang
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(child.pid, flush=True)
        time.sleep(60)
    print("noise")
    print(json.dumps([os.environ["OPENAI_API_KEY"], os.getcwd(), sys.argv[1:],
                      "email.mime.text" in sys.modules, os.getpgid(0) == os.getpid()]))
''')


def _run(coro):
    return asyncio.run(coro)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    return path


def test_forked_agent_keeps_the_command_contract(tmp_path, script):
    async def main():
        server = await ForkServer.start(["email.mime.text"], dict(os.environ))
        cmd = [sys.executable, str(script), "--flag", "x"]
        log = tmp_path / "logs" / "a.log"
        try:
            ok = await run_command_agent(cmd, {"question": "ok"}, "http://h/v1", "key-1", 30,
                                         cwd=str(tmp_path), log_path=log, forkserver=server)
            crash = await run_command_agent(cmd, {"question": "crash"}, "u", "k", 30,
                                            log_path=log, forkserver=server)
            exit3 = await run_command_agent(cmd, {"question": "exit3"}, "u", "k", 30,
                                            forkserver=server)
            many = await asyncio.gather(*(run_command_agent(
                cmd, {"question": "ok"}, "u", f"k{i}", 30, forkserver=server) for i in range(8)))
            plain = await run_command_agent(cmd, {"question": "ok"}, "u", "k", 30)
        finally:
            await server.close()
        return ok, crash, exit3, many, plain

    ok, crash, exit3, many, plain = _run(main())
    assert (ok.status, ok.returncode) == ("finished", 0)
    # the preloaded module is already there; the agent leads its own process group
    assert json.loads(ok.answer) == ["key-1", str(tmp_path), ["--flag", "x"], True, True]
    assert (crash.status, crash.returncode, crash.answer) == ("failed", 1, None)
    assert "RuntimeError: boom" in crash.stderr_tail and "forkserver" not in crash.stderr_tail
    assert (exit3.status, exit3.returncode) == ("failed", 3)
    assert [json.loads(r.answer)[0] for r in many] == [f"k{i}" for i in range(8)]
    assert json.loads(plain.answer)[3] is False  # exec'd: nothing preloaded
    text = (tmp_path / "logs" / "a.log").read_text()
    assert text.count("started") == 2 and "RuntimeError: boom" in text


def test_timeout_kills_the_forked_group_and_the_reaper_tag_is_visible(script):
    async def main():
        server = await ForkServer.start([], {**os.environ, "FORGERL_RUN_TOKEN": "tok123"})
        try:
            cmd = [sys.executable, str(script)]
            task = asyncio.ensure_future(run_command_agent(
                cmd, {"question": "hang"}, "u", "k", 2.0, forkserver=server, grace_s=0.5))
            await asyncio.sleep(1.0)
            (pid,) = server.children  # the agent, forked and still running
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            group = _group(pid)
            return await task, environ, group
        finally:
            await server.close()

    start = time.monotonic()
    result, environ, group = _run(main())
    assert b"FORGERL_RUN_TOKEN=tok123" in environ
    assert result.status == "timeout" and result.returncode == -15
    assert time.monotonic() - start < 10
    assert len(group) == 2  # the agent and its grandchild, both gone
    time.sleep(0.2)
    assert not [p for p in group if os.path.exists(f"/proc/{p}") and _state(p) != "Z"]


def _group(pgid: int) -> list[int]:
    """Live pids whose process group is `pgid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                pids.append(int(entry))
    return pids


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_bad_preload_is_refused_and_a_dead_server_falls_back_to_exec(script):
    async def main():
        with pytest.raises(OSError, match="no_such_module_xyz"):
            await ForkServer.start(["no_such_module_xyz"], dict(os.environ))
        server = await ForkServer.start([], dict(os.environ))
        await server.close()
        return await run_command_agent([sys.executable, str(script)], {"question": "ok"},
                                       "u", "k", 30, forkserver=server)

    result = _run(main())
    assert result.status == "finished" and json.loads(result.answer)[0] == "k"


def test_script_imports_lists_only_installed_top_level_packages(tmp_path, monkeypatch):
    from forgerl.agents.forkserver import script_imports

    (tmp_path / "tools.py").write_text("raise SystemExit('never imported by the server')\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the agent's own module is findable, yet local
    agent = tmp_path / "agent.py"
    agent.write_text(textwrap.dedent('''
        import json, os
        from openai import OpenAI
        import numpy.linalg as la, tools
        from . import sibling
        import openai.types
        try:
            import anthropic
        except ImportError:
            pass
        def later():
            import torch
    '''))
    (tmp_path / "broken.py").write_text("import openai\ndef (:\n")
    assert script_imports(str(agent)) == ("openai", "numpy")
    assert script_imports(str(tmp_path / "broken.py")) == ()
    assert script_imports(str(tmp_path / "missing.py")) == ()


@pytest.mark.parametrize("preload", [None, "[]"])
def test_controller_runs_the_openai_example_agent_forked_unless_preload_is_empty(tmp_path,
                                                                                 preload):
    """Unset `[agent] preload`: the fork server preloads what the script imports (openai);
    `preload = []`: every rollout is a plain `python agent.py`."""
    from forgerl.controller import start_services
    from tests.test_controller import EXAMPLE_AGENT, tiny_config

    config = tiny_config(tmp_path / "run", "--max_steps", "1", "--tasks.eval_size", "0",
                         "--agent.command", json.dumps(["python", str(EXAMPLE_AGENT)]),
                         "--agent.max_turns", "2", "--model.max_model_len", "2048",
                         *(["--agent.preload", preload] if preload else []))

    async def main():
        async with start_services(config) as s:
            s.admit()
            batch = await s.next_batch()
            group = s.pool.get_group(batch[0])
            servers = {k: v.result() for k, v in s.forkservers.items()}
            assert all(v is not None and v.proc.returncode is None for v in servers.values())
        return group, servers

    group, servers = _run(main())
    assert [t.status for t in group.trajectories] == ["finished"] * 4, group.trajectories[0].error
    assert all(t.completions for t in group.trajectories)
    assert list(servers) == ([("openai",)] if preload is None else [])
    assert all(v.proc.returncode is not None for v in servers.values())  # stopped with the run
