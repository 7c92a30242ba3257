"""Run one black-box agent episode: a subprocess in any language, or an async Python callable.

The agent is a pure trajectory producer (DESIGN.md): it only gets the gateway's `base_url` and a
per-rollout `api_key` (the session), plus the task. Its final answer is what the reward scores;
the completions it produced were already recorded by the gateway.

A command agent gets the OpenAI variables (`OPENAI_BASE_URL`, `OPENAI_API_KEY`), the Anthropic
ones (`ANTHROPIC_BASE_URL` without the `/v1` suffix, `ANTHROPIC_API_KEY`) and `FORGERL_TASK`
(the task as JSON) in its environment, and the same JSON on stdin. Its answer is the last
non-empty stdout line. It runs in its own process group; on timeout or cancellation the whole
group (the agent and every process it spawned) gets SIGTERM, then SIGKILL after a grace period.
When an episode ends, however it ends, every process whose environment holds its
`FORGERL_EPISODE=<token>` gets SIGKILL too (`reaper.kill_tagged`), so a child that left the
group (`setsid`, a double fork) dies with its call (CASES.md C24). Only a process that cleared
its environment, or a fork server agent's fork without exec, escapes until the run's end;
in a sandbox with namespaces (`sandbox.py`) none does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal

from forgerl.agents.reaper import kill_tagged
from forgerl.agents.sandbox import exited, feed_stdin, read_tail, signal_group, terminate_group

if TYPE_CHECKING:
    from forgerl.agents.forkserver import ForkServer
    from forgerl.agents.sandbox import Sandbox

AgentStatus = Literal["finished", "failed", "timeout"]
AgentFn = Callable[[dict, str, str], Awaitable[str | None]]

STDOUT_KEEP = 65536  # bytes of stdout kept: the answer is on the last line, logs may be long
STDERR_KEEP = 4000  # characters of stderr kept for the trajectory's error field
LOG_KEEP = 1 << 20  # bytes of one episode's stderr kept in its log file (first and last half)
EPISODE_VAR = "FORGERL_EPISODE"  # tags every process of one command episode (module docstring)
INFRA_EXIT = 75  # EX_TEMPFAIL (sysexits.h): an agent's "my infrastructure failed, not me"


@dataclass(frozen=True)
class AgentResult:
    """Outcome of one agent episode.

    answer: the final answer (last non-empty stdout line, or the callable's return value);
        None when the agent failed, timed out or printed nothing.
    status: "finished" (exit code 0 / callable returned), "failed" (non-zero exit, could not
        start, or raised) or "timeout" (killed after `timeout_s`).
    returncode: the process exit code (negative = killed by that signal); None for callables and
        for commands that could not start.
    stderr_tail: the last 4000 characters of stderr, or of the callable's traceback.
    seconds: wall-clock duration of the episode.
    started: False when the command could not be started (status "failed").
    """

    answer: str | None
    status: AgentStatus
    returncode: int | None
    stderr_tail: str
    seconds: float
    started: bool = True


def infra_cause(result: AgentResult, engine_errors: int = 0) -> str | None:
    """Why an episode is an infrastructure abort (status "aborted_infra": stored, never
    trained, no baseline member; CASES.md C24), or None when the outcome is the agent's own.

    Infrastructure, unless the agent finished: it could not be started; SIGKILL that the
    runner did not send (the OOM killer, a sandbox teardown, an operator; an agent killing
    itself so is counted alike); exit code INFRA_EXIT (75, EX_TEMPFAIL: "my sandbox died");
    `engine_errors` > 0 (the gateway answered a call of this session 500 `engine_error`).
    Everything else is a task failure, trained under `trainer.failed_rollouts`: a non-zero
    exit, an exception, a timeout, any other signal (SIGTERM from the agent's own
    `kill -TERM 0`, SIGSEGV: the sender cannot be told from an exit status). A failing reward
    function is no abort: its fallback reward is counted (C13).
    """
    if result.status == "finished":
        return None
    if not result.started:
        return "agent could not be started"
    if result.returncode == -signal.SIGKILL and result.status == "failed":
        return "agent killed by SIGKILL from outside (OOM killer, sandbox or operator)"
    if result.returncode == INFRA_EXIT:
        return f"agent exit code {INFRA_EXIT} (EX_TEMPFAIL: its infrastructure failed)"
    if engine_errors:
        return f"the engine failed {engine_errors} model call(s) of this session"
    return None


def agent_env(task: dict, base_url: str, api_key: str) -> dict[str, str]:
    """The variables that point an agent at the gateway and give it the task."""
    anthropic_url = base_url.rstrip("/").removesuffix("/v1")
    return {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": api_key,
        "ANTHROPIC_BASE_URL": anthropic_url,
        "ANTHROPIC_API_KEY": api_key,
        "FORGERL_TASK": json.dumps(task),
    }


async def run_agent(
    agent: list[str] | AgentFn,
    task: dict,
    base_url: str,
    api_key: str,
    timeout_s: float,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    forkserver: ForkServer | None = None,
    sandbox: Sandbox | None = None,
) -> AgentResult:
    """Run a command agent (list of argv strings; `cwd`, `env`, `log_path`, `forkserver`,
    `sandbox` apply) or an async callable agent; see `run_command_agent` and
    `run_callable_agent`."""
    if isinstance(agent, list):
        return await run_command_agent(agent, task, base_url, api_key, timeout_s, cwd, env,
                                       log_path=log_path, forkserver=forkserver, sandbox=sandbox)
    return await run_callable_agent(agent, task, base_url, api_key, timeout_s)


async def run_command_agent(
    command: list[str],
    task: dict,
    base_url: str,
    api_key: str,
    timeout_s: float,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    grace_s: float = 2.0,
    log_path: Path | None = None,
    forkserver: ForkServer | None = None,
    sandbox: Sandbox | None = None,
) -> AgentResult:
    """Run `command` as one agent episode and return its answer and status.

    The process inherits this environment plus `env` plus `agent_env(...)`, reads the task JSON
    on stdin, and starts a new session (its own process group). Its stderr is appended to
    `log_path` when given (the file keeps the first and last LOG_KEEP / 2 bytes of each
    episode's; the result keeps the tail), else piped.
    At `timeout_s` seconds, or when the calling task is cancelled, the group gets SIGTERM,
    then SIGKILL `grace_s` seconds later;
    a finished agent's leftover children get SIGKILL too. Cancellation re-raises
    `asyncio.CancelledError` after the group is dead. Never raises for agent faults. With
    `forkserver` (a Python script agent, `[agent] preload`) the process is forked from it
    instead of exec'd (same contract; a plain process when the server is gone). With `sandbox`
    the command runs inside it (`Sandbox.wrap`; `cwd` is a path inside, default its workdir;
    no fork server); a SIGKILL of the sandbox's init counts as a SIGKILL from outside.
    """
    start = time.monotonic()
    if sandbox is not None:
        command, cwd, forkserver = sandbox.wrap(command, cwd), str(sandbox.workdir), None
    full_env = {**os.environ, **(env or {}), **agent_env(task, base_url, api_key),
                EPISODE_VAR: secrets.token_hex(8)}
    log = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = log_path.open("ab")
    try:
        return await _run_command(command, task, full_env, timeout_s, cwd, grace_s, log, start,
                                  forkserver)
    finally:
        if log is not None:
            log.close()


async def _run_command(command: list[str], task: dict, full_env: dict[str, str],
                       timeout_s: float, cwd: str | None, grace_s: float,
                       log: BinaryIO | None, start: float,
                       forkserver: ForkServer | None = None) -> AgentResult:
    """`run_command_agent` once its stderr destination is open (`log`, or a pipe if None)."""
    log_start = os.fstat(log.fileno()).st_size if log is not None else 0

    async def fork_or_exec():
        if forkserver is not None:
            with contextlib.suppress(OSError):
                return await forkserver.spawn(command, full_env, cwd,
                                              None if log is None else log.fileno())
        return await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=log or asyncio.subprocess.PIPE, cwd=cwd, env=full_env,
            start_new_session=True)

    def sweep() -> None:  # the episode's processes, also those that left its group
        kill_tagged(full_env[EPISODE_VAR], var=EPISODE_VAR)

    spawn = asyncio.ensure_future(fork_or_exec())
    try:
        proc = await asyncio.shield(spawn)  # a cancel mid-spawn must not lose the process
    except asyncio.CancelledError:
        try:
            with contextlib.suppress(OSError):
                await terminate_group(await spawn, grace_s)
        finally:
            sweep()
        raise
    except OSError as exc:
        return AgentResult(None, "failed", None, f"cannot start {command!r}: {exc}", 0.0,
                           started=False)

    out_buf, err_buf = bytearray(), bytearray()
    readers = {
        asyncio.create_task(read_tail(proc.stdout, out_buf, STDOUT_KEEP)),
        asyncio.create_task(read_tail(proc.stderr, err_buf, STDERR_KEEP)),
        asyncio.create_task(feed_stdin(proc, json.dumps(task).encode())),
    }
    status: AgentStatus = "finished"
    try:
        async with asyncio.timeout(timeout_s):
            await exited(proc)
    except TimeoutError:
        status = "timeout"
        await terminate_group(proc, grace_s)
    except asyncio.CancelledError:
        try:
            await terminate_group(proc, grace_s)
        finally:  # even when cancelled again (asyncio.run's shutdown cancels every task)
            sweep()
            for reader in readers:
                reader.cancel()
        raise
    signal_group(proc.pid, signal.SIGKILL)  # no orphans, even of a finished agent
    await asyncio.to_thread(sweep)
    # The pipes close once the episode's processes are gone; one that left the group and
    # cleared its environment, still holding them, only costs us its unread output.
    _, pending = await asyncio.wait(readers, timeout=grace_s)
    for reader in pending:
        reader.cancel()
    if log is not None:  # the episode's part of the log file
        with open(log.name, "rb") as f:
            f.seek(max(log_start, os.fstat(f.fileno()).st_size - STDERR_KEEP))
            err_buf += f.read()
        _cut_log(log.name, log_start)
    out, err = (b.decode("utf-8", errors="replace") for b in (out_buf, err_buf))
    if status == "finished" and proc.returncode != 0:
        status = "failed"
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    answer = lines[-1] if status == "finished" and lines else None
    return AgentResult(answer, status, proc.returncode, err, time.monotonic() - start)


def _cut_log(path: str, start: int) -> None:
    """Cut one episode's stderr in the log at `path` (from byte `start`) to its first and last
    LOG_KEEP / 2 bytes, with a line saying how much was cut (a chatty agent can fill a disk)."""
    size = os.path.getsize(path)
    if size - start <= LOG_KEEP:
        return
    half = LOG_KEEP // 2
    with open(path, "r+b") as f:
        f.seek(size - half)
        tail = f.read(half)
        f.seek(start + half)
        f.write(f"\n[... {size - start - 2 * half} bytes of stderr cut ...]\n".encode() + tail)
        f.truncate()


async def run_callable_agent(
    fn: AgentFn, task: dict, base_url: str, api_key: str, timeout_s: float
) -> AgentResult:
    """Await `fn(task, base_url, api_key)` with a timeout; exceptions become status "failed".

    Cancellation propagates (the callable is cancelled with the caller).
    """
    start = time.monotonic()
    try:
        answer = await asyncio.wait_for(fn(task, base_url, api_key), timeout_s)
    except TimeoutError:
        return AgentResult(None, "timeout", None, "", time.monotonic() - start)
    except Exception:
        tail = traceback.format_exc()[-STDERR_KEEP:]
        return AgentResult(None, "failed", None, tail, time.monotonic() - start)
    text = None if answer is None else str(answer).strip() or None
    return AgentResult(text, "finished", None, "", time.monotonic() - start)
