"""verifiers (prime-rl's environment format, `verifiers` 0.4.0, its v1 API) as a task source.

verifiers pins mcp and openai versions ForgeRL's venv does not have, so the environment runs in
its own venv (`.venv-verifiers`, scripts/setup_verifiers.sh; `[tasks] python` names another) in a
worker process, scripts/verifiers_worker.py, that speaks JSON lines on stdin/stdout:

    [tasks] env ─► the taskset id (an installed package, `owner/name`, or a package folder),
                   loaded by verifiers' own loader; [tasks] params ─► its TasksetConfig fields
    task ─► TaskData (prompt, system_prompt, the row's fields), "question" = its prompt text
    episode tools ─► the task's and the taskset's Toolsets' @vf.tool functions, served by an
                     in-process MCP server (the `mcp` package), named `<server>_<tool>`
    score ─► the task's rubric (@vf.reward functions, weighted, and judges) on a verifiers Trace
             of the conversation: the trace's reward

A worker that cannot start, dies or answers an error for an episode is an infrastructure failure
(EnvironmentError); a tool's own error is the tool message the model sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
from pathlib import Path
from typing import Any

from forgerl.tasks.base import Environment, EnvironmentError, Episode, Step

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "scripts" / "verifiers_worker.py"
VENV_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
TIMEOUT_S = 300.0
"""Longest wait for one worker answer (a tool call, a rubric with a judge)."""


class VerifiersEpisode(Episode):
    """One episode held by the worker (its task, toolsets and rollout state)."""

    def __init__(self, adapter: Adapter, episode: int, prompt: list, tools: list) -> None:
        super().__init__(prompt=prompt, tools=tools)
        self.adapter, self.episode = adapter, episode

    async def call(self, name: str, arguments: dict[str, Any]) -> Step:
        answer = await self.adapter.request("call", episode=self.episode, name=name,
                                            arguments=arguments)
        return Step(answer["content"])

    async def score(self, answer: str | None, messages: list[dict[str, Any]]) -> float:
        """The rubric's weighted reward (verifiers' `Trace.reward`)."""
        result = await self.adapter.request("score", episode=self.episode, messages=messages)
        return float(result["reward"])

    async def close(self) -> None:
        await self.adapter.request("close", episode=self.episode)


class Adapter(Environment):
    standard = "verifiers"

    def __init__(self, location: str, params: dict[str, Any], base_dir: Path,
                 python: str | None = None) -> None:
        local = base_dir / location
        super().__init__(str(local.resolve()) if local.is_dir() else location, params, base_dir,
                         python or str(VENV_PYTHON))
        self._proc: asyncio.subprocess.Process | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self._broken: str | None = None

    def _argv(self) -> list[str]:
        if not Path(self.python).exists():  # type: ignore[arg-type]
            raise ValueError(f"no verifiers venv at {self.python}: run scripts/setup_verifiers.sh "
                             "(or set tasks.python to a Python that has verifiers 0.4)")
        return [str(self.python), str(WORKER), self.location, json.dumps(self.params)]

    def tasks(self, split: str, size: int, seed: int) -> list[dict[str, Any]]:
        """The taskset's tasks of `split` (see docs/environments/verifiers.md), in a worker."""
        line = json.dumps({"id": 0, "op": "tasks", "split": split, "size": size, "seed": seed})
        try:
            done = subprocess.run(self._argv(), input=line + "\n", capture_output=True,
                                  text=True, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise ValueError(f"verifiers: no task list in {TIMEOUT_S} s") from None
        lines = done.stdout.splitlines()
        first = json.loads(lines[0]) if lines else {"fatal": _last(done.stderr)}
        if "fatal" in first:
            raise ValueError(f"verifiers: {first['fatal']}")
        answer = json.loads(lines[1]) if len(lines) > 1 else {"error": _last(done.stderr)}
        if "error" in answer:
            raise ValueError(f"verifiers: {answer['error']}")
        return answer["result"]

    async def start(self) -> None:
        """Start the worker; a failure is kept and every episode is an infrastructure abort."""
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self._argv(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                limit=1 << 26)
            first = json.loads(await self._proc.stdout.readline() or '{"fatal": "no answer"}')
        except (ValueError, OSError) as e:
            first = {"fatal": str(e)}
        if "fatal" in first:
            self._broken = f"verifiers worker did not start: {first['fatal']}"
            return
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        """Hand each answer line to its request; when the worker exits, fail the rest."""
        assert self._proc is not None and self._proc.stdout is not None
        while line := await self._proc.stdout.readline():
            answer = json.loads(line)
            if (future := self._waiting.pop(answer.get("id"), None)) and not future.done():
                future.set_result(answer)
        self._broken = f"verifiers worker exited (status {await self._proc.wait()})"
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(EnvironmentError(self._broken))
        self._waiting.clear()

    async def request(self, op: str, **args: Any) -> Any:
        """One worker request's result; EnvironmentError when the worker failed or errs."""
        if self._broken or self._proc is None or self._proc.stdin is None:
            raise EnvironmentError(self._broken or "verifiers worker not started")
        rid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        try:
            self._proc.stdin.write((json.dumps({"id": rid, "op": op, **args}) + "\n").encode())
            await self._proc.stdin.drain()
            answer = await asyncio.wait_for(future, TIMEOUT_S)
        except OSError as e:  # the pipe broke: the worker is gone
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._proc.wait(), 10)
            raise EnvironmentError(f"verifiers worker exited (status {self._proc.returncode})"
                                   ) from e
        except TimeoutError as e:
            raise EnvironmentError(f"verifiers worker: no answer to {op} in {TIMEOUT_S} s") from e
        finally:
            self._waiting.pop(rid, None)
        if "error" in answer:
            raise EnvironmentError(f"verifiers {op}: {answer['error']}")
        return answer["result"]

    async def open(self, task: dict[str, Any], sandbox: Any = None) -> Episode:
        opened = await self.request("open", task=task)
        return VerifiersEpisode(self, opened["episode"], opened["prompt"], opened["tools"])

    async def stop(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                await asyncio.wait_for(self._proc.wait(), 10)
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        if self._reader is not None:
            await self._reader
        self._proc, self._reader = None, None


def _last(stderr: str) -> str:
    """The last line of a worker's stderr (its exception), or a note that it said nothing."""
    lines = [x for x in stderr.splitlines() if x.strip()]
    return lines[-1] if lines else "the worker exited without a word"
