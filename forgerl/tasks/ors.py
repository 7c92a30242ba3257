"""Open Reward Standard environments (`[tasks] source = "ors"`), on the protocol's own SDK
(`ors-sdk`: its `AsyncORS` client, sessions and tool conversion; the `ors` extra).

    [tasks] env = "http://host:port" (the ORS server), params = {environment = "name",
            split = "train", eval_split = "test"}
    tasks        ─► POST /{environment}/tasks of the split; each task keeps its task_spec
    open(task)   ─► a session (create + task_spec), GET prompt ─► the user message (text blocks),
                    GET tools ─► OpenAI function tools
    call(n, a)   ─► POST /{environment}/call ─► Step(text blocks, reward, finished)
    close        ─► the session is deleted

A tool the server refuses (unknown tool, arguments that fail its input model) is the policy's
mistake: the Step says so. Anything else that fails (server unreachable, session gone, the
tool's code raised) is an EnvironmentError, an infrastructure abort.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
from typing import Any

from ors.client import ORS, AsyncORS, ImageBlock, Task, ToolCallError

from forgerl.tasks.base import Environment, EnvironmentError, Episode, Split, Step


class Adapter(Environment):
    """`location` is the server's base URL; `params`: `environment` (its name on the server,
    required), `split` / `eval_split` (the server's split names for training and held-out
    tasks; default "train" / "test")."""

    standard = "ors"
    params_known = ("environment", "split", "eval_split")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.client: AsyncORS | None = None

    @property
    def name(self) -> str:
        name = self.params.get("environment")
        if not isinstance(name, str) or not name:
            raise TypeError("environment: required, the ORS environment's name on the server "
                            '(params = {environment = "NAME"})')
        return name

    def tasks(self, split: Split, size: int, seed: int) -> list[dict[str, Any]]:
        """The server's tasks of the split `params.split` ("train") or `params.eval_split`
        ("test"), a seeded sample of up to `size`; "question" is the spec's "question" when it
        is a string, else the spec as sorted JSON. Raises ValueError (one line) when the server
        cannot be reached, refuses the split or has no tasks in it."""
        name, ors_split = self.name, self.params.get(
            "split" if split == "train" else "eval_split", "train" if split == "train" else "test")
        try:
            with ORS(base_url=self.location) as client:
                listed = client.environment(name).list_tasks(ors_split)
        except Exception as e:
            raise ValueError(f"ORS server {self.location}, environment {name!r}, split "
                             f"{ors_split!r}: {_line(e)}") from None
        if not listed:
            raise ValueError(f"ORS server {self.location}, environment {name!r}: split "
                             f"{ors_split!r} has no tasks")
        order = list(range(len(listed)))
        random.Random(seed).shuffle(order)
        return [{"question": _question(listed[i].task_spec), "ors_env": listed[i].environment_name,
                 "task_spec": dict(listed[i].task_spec), "split": ors_split, "index": i}
                for i in sorted(order[:size])]

    async def start(self) -> None:
        self.client = AsyncORS(base_url=self.location)

    async def open(self, task: dict[str, Any], sandbox: Any = None) -> Episode:
        """A session on the task's spec; its prompt's text blocks as one user message and its
        tools (task tools included) as OpenAI function tools."""
        if self.client is None:
            await self.start()
        assert self.client is not None
        spec = Task(environment_name=task.get("ors_env", self.name), task_spec=task["task_spec"])
        session = self.client.environment(self.name).session(task=spec)
        try:
            await session.__aenter__()
            blocks = await session.get_prompt()
            tools = await session.list_tools(format="openai")
        except Exception as e:
            with contextlib.suppress(Exception):  # delete what was created on the server
                await session.__aexit__(None, None, None)
            raise EnvironmentError(f"ORS server {self.location}: {_line(e)}") from e
        return OrsEpisode(prompt=[{"role": "user", "content": _text(blocks)}],
                          tools=[_chat_tool(t) for t in tools], session=session,
                          location=self.location)

    async def stop(self) -> None:
        """Close the client's connections (the SDK keeps one aiohttp session per base URL)."""
        client, self.client = self.client, None
        if client is not None and client._environments_api is not None:
            for http in client._environments_api._clients.values():  # no public close in 0.1.0
                await http.close()


class OrsEpisode(Episode):
    """One ORS session: `call` runs a tool on it, `close` deletes it."""

    def __init__(self, *, session: Any, location: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.session, self.location = session, location

    async def call(self, name: str, arguments: dict[str, Any]) -> Step:
        try:
            out = await self.session.call_tool(name, arguments)
        except ToolCallError as e:  # the server's RunToolError: unknown tool, invalid input
            return Step(f"error: {re.sub(r'^[(]sid=[^)]*[)] ', '', str(e))}")
        except Exception as e:
            raise EnvironmentError(f"ORS server {self.location}: tool {name!r}: {_line(e)}") from e
        return Step(_text(out.blocks), out.reward, out.finished)

    async def close(self) -> None:
        await self.session.__aexit__(None, None, None)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """The SDK's OpenAI tool (Responses shape: name, description, parameters at the top, the
    schema already sanitized for OpenAI) in the chat-completions shape."""
    parameters = tool.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": tool["name"], "description":
            tool.get("description") or "", "parameters": parameters}}


def _text(blocks: list[Any]) -> str:
    """Text blocks joined by blank lines; an image block (the policy reads text only) is named
    in its place, never dropped silently."""
    return "\n\n".join(f"[image block ({b.mimeType}) not shown: ForgeRL policies read text]"
                       if isinstance(b, ImageBlock) else b.text for b in blocks)


def _question(spec: Any) -> str:
    question = spec.get("question") if isinstance(spec, dict) else None
    return question if isinstance(question, str) else json.dumps(spec, sort_keys=True)


def _line(e: BaseException) -> str:
    """An exception as one line: its type and its message's first non-empty line."""
    first = next((s.strip() for s in str(e).splitlines() if s.strip()), "")
    return f"{type(e).__name__}: {first}" if first else type(e).__name__
