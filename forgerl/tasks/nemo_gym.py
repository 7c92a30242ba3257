"""NeMo-Gym resources servers, over their HTTP contract (the `nemo-gym` package needs Python
>= 3.13 and cannot install here; the contract follows nemo_gym 0.7.0's
`base_resources_server.py` and its simple agent's legacy `/run` path). `[tasks] env` is the
resources server's URL, `params.dataset` its JSONL file of tasks (`eval_dataset`: the held-out
one).

    JSONL row                        ─► a task (the whole row is kept)
    responses_create_params.input    ─► the prompt (instructions and developer ─► system)
    responses_create_params.tools    ─► the episode's tools (function tools)
    open                             ─► POST /seed_session {row}; its cookies carry the session
    tool call                        ─► POST /<tool> {arguments}; the reply's body is the tool
                                        message (any status: the server's errors are the model's)
    score                            ─► POST /verify {row, response}: `reward` is the outcome;
                                        `mask_sample` (the server's own failure) ─► aborted_infra
"""

from __future__ import annotations

import json
import random
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from forgerl.config import ConfigError
from forgerl.tasks.base import Environment, EnvironmentError, Episode, Step


class Adapter(Environment):
    standard = "nemo_gym"
    params_known = ("dataset", "eval_dataset", "timeout_s")

    def tasks(self, split, size, seed):
        key = "dataset" if split == "train" else "eval_dataset"
        for need in dict.fromkeys(("dataset", key)):
            if need not in self.params:
                raise ValueError(f"params.{need}: required (the resources server's JSONL tasks"
                                 + (")" if need == "dataset" else "; or set tasks.eval_size = 0)"))
        path = Path(self.params[key])
        path = path if path.is_absolute() else self.base_dir / path
        rows = []
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:  # each row parses, its prompt and tools convert, or the run does not start
                row = json.loads(line)
                if not isinstance(row, dict) or "responses_create_params" not in row:
                    raise ValueError("not an object with responses_create_params")
                _prompt(row["responses_create_params"]), _tools(row["responses_create_params"]
                                                                .get("tools") or [])
            except json.JSONDecodeError as e:
                raise ValueError(f"params.{key}: {path} line {i + 1}: not JSON ({e})") from None
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"params.{key}: {path} line {i + 1}: {e}") from None
            rows.append(row)
        if not rows:
            raise ValueError(f"params.{key}: {path} has no rows")
        order = list(range(len(rows)))
        random.Random(seed).shuffle(order)
        return [{"question": _question(rows[i]), "row": rows[i]} for i in order[:size]]

    async def start(self):
        """The resources server must answer (any HTTP status) before the run starts."""
        try:
            async with httpx.AsyncClient(timeout=10.0) as http:
                await http.get(self.location)
        except httpx.HTTPError as e:
            raise ConfigError(f"tasks.env: no NeMo-Gym resources server at {self.location} "
                              f"({type(e).__name__}: {e})") from None

    async def open(self, task, sandbox=None):
        row = task["row"]
        params = row["responses_create_params"]
        http = httpx.AsyncClient(base_url=self.location.rstrip("/"),
                                 timeout=float(self.params.get("timeout_s", 300)))
        episode = NemoEpisode(prompt=_prompt(params), tools=_tools(params.get("tools") or []),
                              http=http, row=row)
        try:
            await episode.post("/seed_session", row)
        except EnvironmentError:
            await http.aclose()
            raise
        return episode


class NemoEpisode(Episode):
    """A session on the resources server (its cookie in `http`'s jar)."""

    def __init__(self, prompt: list[dict[str, Any]], tools: list[dict[str, Any]],
                 http: httpx.AsyncClient, row: dict[str, Any]) -> None:
        super().__init__(prompt=prompt, tools=tools)
        self.http, self.row = http, row

    async def post(self, path: str, body: dict[str, Any], check: bool = True) -> httpx.Response:
        """POST `body` to the server; EnvironmentError when it cannot be reached or (`check`)
        answers an error."""
        try:
            reply = await self.http.post(path, json=body)
        except httpx.HTTPError as e:
            raise EnvironmentError(f"NeMo-Gym server {self.http.base_url}{path}: "
                                   f"{type(e).__name__}: {e}") from None
        if check and reply.status_code >= 400:
            raise EnvironmentError(f"NeMo-Gym server {path}: {reply.status_code} "
                                   f"{reply.text[:300]}")
        return reply

    async def call(self, name, arguments):
        if name not in {t["function"]["name"] for t in self.tools}:
            return await super().call(name, arguments)
        return Step((await self.post(f"/{name}", arguments, check=False)).text)

    async def score(self, answer, messages):
        response = _response(messages[len(self.prompt):], self.row["responses_create_params"])
        reply = await self.post("/verify", {**self.row, "response": response})
        try:
            verified = reply.json()
            reward = float(verified["reward"])
        except (ValueError, KeyError, TypeError) as e:
            raise EnvironmentError(f"NeMo-Gym /verify answered no reward ({e}): "
                                   f"{reply.text[:200]}") from None
        if verified.get("mask_sample"):
            why = f"{verified.get('failure_kind')} {verified.get('failure_reason')}"
            raise EnvironmentError(f"NeMo-Gym /verify masked the sample: {why}")
        return reward

    async def close(self):
        await self.http.aclose()


def _text(content: Any) -> str:
    """A Responses message content (a string or a list of text parts) as text."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def _prompt(params: dict[str, Any]) -> list[dict[str, Any]]:
    """responses_create_params' instructions and input as chat messages."""
    items = params.get("input") or []
    items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    messages = [{"role": "system", "content": params["instructions"]}] \
        if params.get("instructions") else []
    for item in items:
        if item.get("type", "message") != "message":
            raise ValueError(f"responses_create_params.input: item type {item['type']!r} is not "
                             "supported (messages only)")
        role = "system" if item["role"] in ("developer", "system") else item["role"]
        messages.append({"role": role, "content": _text(item.get("content"))})
    return messages


def _question(row: dict[str, Any]) -> str:
    users = [m["content"] for m in _prompt(row["responses_create_params"]) if m["role"] == "user"]
    return users[-1] if users else json.dumps(row["responses_create_params"])[:500]


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools as chat-completions tools (other tool types: ValueError)."""
    out = []
    for tool in tools:
        if tool.get("type") != "function":
            raise ValueError(f"responses_create_params.tools: {tool.get('type')!r} tools are "
                             "not supported (function tools only)")
        out.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description") or "",
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}})
    return out


def _response(messages: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
    """The episode after its prompt as a Responses API `response` (NeMoGymResponse): output
    messages, function_call and function_call_output items, as NeMo-Gym's agent builds it."""
    output: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant":
            if m.get("content"):
                output.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                               "role": "assistant", "status": "completed", "content": [
                                   {"type": "output_text", "text": m["content"],
                                    "annotations": []}]})
            for call in m.get("tool_calls") or []:
                output.append({"id": f"fc_{call['id']}", "type": "function_call",
                               "call_id": call["id"], "name": call["function"]["name"],
                               "arguments": call["function"]["arguments"] or "{}",
                               "status": "completed"})
        elif m["role"] == "tool":
            output.append({"id": f"fco_{m['tool_call_id']}", "type": "function_call_output",
                           "call_id": m["tool_call_id"], "output": m["content"],
                           "status": "completed"})
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": time.time(),
            "model": params.get("model") or "forgerl", "output": output,
            "parallel_tool_calls": params.get("parallel_tool_calls", True),
            "tool_choice": params.get("tool_choice", "auto"), "tools": params.get("tools") or []}
