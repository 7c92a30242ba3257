"""White-box agents whose context management is an action the model takes (Forge §2.2).

Data flow: a white-box agent (an async callable, `forgerl.controller.run(config, agent=fn)`)
keeps its chat history in a `ManagedContext` and offers the model `CM_TOOLS` beside its own
tools. `run_tool_loop` calls the gateway, runs the tools the model calls, and applies a CM call
to the history:

- `compact(summary)`: every message after the head (system + task) is dropped but the
  assistant message that calls compact (and its tool results), the compact result holding the
  model's summary;
- `forget_tool_outputs()`: the content of every earlier tool result is replaced by
  "[dropped]", but the results the calling message directly follows (the ones the model is
  reading in this turn).

The next prompt then no longer extends the recorded one, so the gateway renders it from scratch
and the trajectory gets a new branch (a new training sample, `trainer/samples.py`) that shares
the untouched head with the old one (merged by the prefix tree, trained once). The CM call is
the last completion of the old branch and is trained there like any other action, with its
turn's advantage. `truncate_oldest` is the fixed, non-learned baseline: it drops the oldest
turns once the history passes a message budget.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

CM_TOOLS = [
    {"type": "function", "function": {
        "name": "compact",
        "description": "Replace the conversation so far by your summary of what matters.",
        "parameters": {"type": "object", "properties": {"summary": {"type": "string"}},
                       "required": ["summary"]}}},
    {"type": "function", "function": {
        "name": "forget_tool_outputs",
        "description": "Drop the content of earlier tool results (keeps the ones just read).",
        "parameters": {"type": "object", "properties": {}}}},
]
CM_NAMES = frozenset(t["function"]["name"] for t in CM_TOOLS)
DROPPED = "[dropped]"


@dataclass
class ManagedContext:
    """An agent's chat history (OpenAI message dicts): `head` always kept, `body` managed.

    cm_actions: CM calls applied so far, by name. tokens: prompt + completion tokens of the
    last model call `run_tool_loop` made (its usage; 0 before one or without usage), what a
    harness compares with its context budget.
    """

    head: list[dict[str, Any]]
    body: list[dict[str, Any]] = field(default_factory=list)
    cm_actions: dict[str, int] = field(default_factory=dict)
    tokens: int = 0

    @property
    def messages(self) -> list[dict[str, Any]]:
        """What the next model call sends: head + body."""
        return [*self.head, *self.body]

    def apply(self, call: dict[str, Any], arguments: dict[str, Any]) -> str:
        """Apply one CM tool call (an OpenAI tool-call dict, already appended to `body` inside
        its assistant message); returns the tool result text. Raises ValueError for a tool
        that is not a CM tool."""
        name = call["function"]["name"]
        last = max((i for i, m in enumerate(self.body) if m["role"] == "assistant"), default=0)
        if name == "compact":  # keep the calling message and the results already given to it
            self.body = self.body[last:]
            result = f"Context compacted. Your summary: {arguments.get('summary', '')}"
        elif name == "forget_tool_outputs":  # keep the results the calling message follows
            while last > 0 and self.body[last - 1]["role"] == "tool":
                last -= 1
            old = [m for m in self.body[:last] if m["role"] == "tool" and m["content"] != DROPPED]
            for m in old:
                m["content"] = DROPPED
            result = f"Dropped {len(old)} tool outputs."
        else:
            raise ValueError(f"{name!r} is not a context-management tool")
        self.cm_actions[name] = self.cm_actions.get(name, 0) + 1
        return result

    def truncate_oldest(self, max_body_messages: int) -> None:
        """The fixed baseline: drop the oldest body messages beyond the budget, starting the
        kept part at an assistant message (never an orphaned tool result)."""
        cut = max(0, len(self.body) - max_body_messages)
        while cut < len(self.body) and self.body[cut]["role"] == "tool":
            cut += 1
        self.body = self.body[cut:]


Tool = Callable[[dict[str, Any]], Awaitable[str]]


async def run_tool_loop(client: Any, model: str, ctx: ManagedContext, tools: list[dict],
                        execute: dict[str, Tool], max_turns: int, max_tokens: int,
                        truncate_to: int | None = None,
                        cm_tools: frozenset[str] = CM_NAMES) -> str:
    """Chat until the model replies without tool calls or `max_turns` calls are used; returns
    the last reply's text. `client`: an `openai.AsyncOpenAI`. CM tools (`CM_TOOLS`, offered
    beside `tools`) change `ctx`; other calls run `execute[name](arguments)`; an unknown tool or
    bad arguments answer the model with an error text. `truncate_to`: apply the fixed baseline
    (`truncate_oldest`) before each call instead of (or as well as) learned CM. `cm_tools`: the
    CM tools offered (default all; a CM tool not offered is an unknown tool)."""
    reply = ""
    for _ in range(max_turns):
        if truncate_to is not None:
            ctx.truncate_oldest(truncate_to)
        response = await client.chat.completions.create(
            model=model, messages=ctx.messages, max_tokens=max_tokens,
            tools=[*tools, *(t for t in CM_TOOLS if t["function"]["name"] in cm_tools)])
        message, usage = response.choices[0].message, response.usage
        ctx.tokens = usage.total_tokens if usage is not None else 0
        reply = message.content or ""
        calls = [c.model_dump(include={"id", "type", "function"}) for c in message.tool_calls or []]
        ctx.body.append({"role": "assistant", "content": reply,
                         **({"tool_calls": calls} if calls else {})})
        if not calls:
            break
        for call in calls:
            name = call["function"]["name"]
            try:
                args = json.loads(call["function"]["arguments"] or "{}")
                if name in cm_tools:
                    result = ctx.apply(call, args)
                elif name in execute:
                    result = await execute[name](args)
                else:
                    result = f"error: unknown tool {name!r}"
            except (ValueError, TypeError, KeyError) as e:
                result = f"error: {e}"
            ctx.body.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return reply
