"""OpenEnv (`openenv` 0.10): environments served by OpenEnv's FastAPI app (`create_app`), played
with OpenEnv's own client (`GenericEnvClient`: reset / step over its WebSocket session).

openenv pins fastmcp<4 and so mcp<2, which ForgeRL's venv cannot hold: the client runs in a
worker process under `[tasks] python` (default: `.venv-openenv`, scripts/setup_openenv.sh),
scripts/openenv_worker.py, speaking JSON lines. docs/environments/openenv.md has the mapping:

    [tasks] env      a server URL, or "module:app" served here (uvicorn, 127.0.0.1, free port)
    a task           reset keyword arguments: params.tasks / params.eval_tasks, else {"seed": n}
    prompt           the reset observation as text (params.observation_field, else its only
                     non-empty field when text, else its JSON), after params.system
    tools            the MCP tools (list_tools), else the action schema as one tool ("step")
    a call           a step: its reward a process reward, `done` finishes with the outcome
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from forgerl.config import ConfigError
from forgerl.tasks.base import Environment, EnvironmentError, Episode, Split, Step

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "scripts" / "openenv_worker.py"
VENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"


class OpenEnvEpisode(Episode):
    """One OpenEnv session (a WebSocket of the worker's client), reset to the task."""

    def __init__(self, adapter: Adapter, opened: dict[str, Any]) -> None:
        obs, tools = opened["observation"], opened["tools"]
        system = adapter.params.get("system")
        prompt = [{"role": "system", "content": system}] if system else []
        super().__init__([*prompt, {"role": "user", "content": adapter.text(obs)}],
                         [_function(t) for t in tools])
        self.adapter, self.id, self.mcp = adapter, opened["episode"], opened["mcp"]
        self.names = {t["name"] for t in tools}

    async def call(self, name: str, arguments: dict[str, Any]) -> Step:
        if name not in self.names:
            return await super().call(name, arguments)
        action = ({"type": "call_tool", "tool_name": name, "arguments": arguments}
                  if self.mcp else arguments)
        reply = await self.adapter.request("step", episode=self.id, action=action)
        if "error" in reply:
            return Step(f"error: the environment rejected the action: {reply['error']}")
        obs = reply["observation"]
        content = _tool_text(obs) if self.mcp else self.adapter.text(obs)
        reward = None if reply["reward"] is None else float(reply["reward"])
        return Step(content, reward, bool(reply["done"]))

    async def close(self) -> None:
        await self.adapter.request("close", episode=self.id)


class Adapter(Environment):
    """`[tasks] source = "openenv"`; `params`: tasks, eval_tasks, reset, tools ("auto", "mcp",
    "action"), action_tool, observation_field, system, timeout, start_timeout, path (see
    docs/environments/openenv.md)."""

    standard = "openenv"
    params_known = ("tasks", "eval_tasks", "reset", "tools", "action_tool", "observation_field",
                    "system", "timeout", "start_timeout", "path")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.url: str | None = None
        self._server: asyncio.subprocess.Process | None = None
        self._worker: asyncio.subprocess.Process | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids, self._reader = itertools.count(), None

    def tasks(self, split: Split, size: int, seed: int) -> list[dict[str, Any]]:
        key = "eval_tasks" if split == "eval" else "tasks"
        if (listed := self.params.get(key)) is not None:
            if not listed or not isinstance(listed, list) or not all(
                    isinstance(t, dict) for t in listed):
                raise ConfigError(f"tasks.params.{key}: a list of tables of reset arguments")
            kwargs = [dict(t) for t in itertools.islice(itertools.cycle(listed), size)]
        else:
            kwargs = [{**self.params.get("reset", {}), "seed": seed + i} for i in range(size)]
        return [{"question": f"reset {json.dumps(k, sort_keys=True)}", "reset": k}
                for k in kwargs]

    async def start(self) -> None:
        python = self.python or (str(VENV_PYTHON) if VENV_PYTHON.exists() else None)
        if python is None or shutil.which(python) is None:
            raise ConfigError(f"tasks.python: no OpenEnv venv at {python or VENV_PYTHON} (run "
                              "scripts/setup_openenv.sh, or name a python that has openenv)")
        if "://" in self.location:
            self.url = self.location.rstrip("/")
        else:
            await self._serve(python)
        await self._healthy(self.params.get("start_timeout", 120.0) if self._server else 5.0)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._worker = await asyncio.create_subprocess_exec(
            python, str(WORKER), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env, limit=1 << 26)
        self._reader = asyncio.create_task(self._read())

    async def _serve(self, python: str) -> None:
        """Serve the app `module:attr` of `[tasks] env` on a free loopback port."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        path = [str((self.base_dir / p).resolve()) for p in self.params.get("path", ["."])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self._server = await asyncio.create_subprocess_exec(
            python, "-m", "uvicorn", self.location, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"

    async def _healthy(self, wait_s: float) -> None:
        """Wait for the server's /health; ConfigError (tasks.env) when it never answers."""
        error, deadline = "", time.monotonic() + wait_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if self._server is not None and self._server.returncode is not None:
                    error = f"the server exited ({self._server.returncode}; its log is above)"
                    break
                try:
                    if (await http.get(f"{self.url}/health")).status_code == 200:
                        return
                    error = "/health did not answer 200"
                except httpx.HTTPError as e:
                    error = f"{type(e).__name__}: {e}"
                await asyncio.sleep(0.1)
        await self.stop()
        raise ConfigError(f"tasks.env: no OpenEnv server at {self.location} ({error})")

    async def open(self, task: dict[str, Any], sandbox: Any = None) -> Episode:
        p = self.params
        reply = await self.request(
            "open", url=self.url, reset=task.get("reset", {}), tools=p.get("tools", "auto"),
            action_tool=p.get("action_tool", "step"), timeout=p.get("timeout", 60.0))
        if "error" in reply:
            raise EnvironmentError(f"reset failed: {reply['error']}")
        return OpenEnvEpisode(self, reply)

    def text(self, obs: dict[str, Any]) -> str:
        """An observation as the text the model reads (see the module doc)."""
        if (field := self.params.get("observation_field")) is not None:
            return str(obs.get(field, ""))
        shown = {k: v for k, v in obs.items() if k != "metadata" and v not in (None, "", [], {})}
        texts = [v for v in shown.values() if isinstance(v, str)]
        return texts[0] if len(shown) == 1 and texts else json.dumps(shown, default=str)

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """One worker request; EnvironmentError when the worker is gone or the failure is not
        the policy's (a rejected action comes back as {"error", "policy": true})."""
        if self._worker is None or self._worker.returncode is not None:
            raise EnvironmentError("the OpenEnv worker is not running")
        rid = next(self._ids)
        future = self._pending[rid] = asyncio.get_running_loop().create_future()
        assert self._worker.stdin is not None
        try:
            self._worker.stdin.write(json.dumps({"id": rid, "op": op, **fields}).encode() + b"\n")
            await self._worker.stdin.drain()
        except (ConnectionError, RuntimeError) as e:
            self._pending.pop(rid, None)
            raise EnvironmentError(f"the OpenEnv worker is gone ({e})") from e
        reply = await future
        if "error" in reply and not (op == "step" and reply.get("policy")):
            raise EnvironmentError(f"{op}: {reply['error']}")
        return reply

    async def _read(self) -> None:
        assert self._worker is not None and self._worker.stdout is not None
        while line := await self._worker.stdout.readline():
            reply = json.loads(line)
            if (future := self._pending.pop(reply["id"], None)) and not future.done():
                future.set_result(reply)
        for future in self._pending.values():
            if not future.done():
                future.set_result({"error": "the OpenEnv worker exited"})
        self._pending.clear()

    async def stop(self) -> None:
        for proc in (self._worker, self._server):
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 5.0)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        if self._reader is not None:
            await self._reader
        self._worker = self._server = self._reader = None


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """An OpenEnv/MCP tool (name, description, input_schema) as an OpenAI function tool."""
    schema = tool.get("input_schema") or tool.get("inputSchema") or {"type": "object"}
    return {"type": "function", "function": {"name": tool["name"], "description":
            tool.get("description") or "", "parameters": schema}}


def _tool_text(obs: dict[str, Any]) -> str:
    """A CallToolObservation as text: the result's text blocks, else its data; or the error."""
    if error := obs.get("error"):
        return f"error: {error.get('message', error)}"
    result = obs.get("result")
    if isinstance(result, dict):
        blocks = [b["text"] for b in result.get("content") or [] if b.get("type") == "text"]
        return "\n".join(blocks) if blocks else json.dumps(result.get("data"), default=str)
    return result if isinstance(result, str) else json.dumps(result, default=str)
