"""Context edits a client asks the server to apply (Anthropic `context_management.edits`).

Data flow: protocols/anthropic.py builds a `Conversation`; `apply_edits` rewrites its messages
before anything is rendered and notes what it did (`request["applied"]`: [{"type", "cleared"}]).
The turn records the edited messages, so an edited context matches no earlier turn and is a new
branch of the session's tree (nothing recorded is re-encoded: token exactness holds).
`clear_thinking_20251015` keeps the reasoning of the last `keep.value` assistant turns having
some (default 1; "all": a no-op). `clear_tool_uses_20250919`, once the prompt has more than
`trigger.value` tokens (default 100,000), replaces the results of every tool call but the last
`keep.value` (default 3) and those of `exclude_tools` by `CLEARED` (`clear_tool_inputs`: true
or tool names, also their arguments by "{}"), unless that saves under `clear_at_least.value`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field

from forgerl.gateway import telemetry
from forgerl.gateway.conversation import Conversation, Message
from forgerl.gateway.errors import GatewayError, Loose, unsupported

CLEARED = "[tool result cleared to save context]"


class Amount(Loose):  # {"type": "input_tokens" | "tool_uses" | "thinking_turns", "value": N}
    type: str
    value: int = Field(ge=0)


class Edit(Loose):  # one entry of context_management.edits
    type: str
    trigger: Amount | None = None
    keep: Amount | Literal["all"] | None = None
    clear_at_least: Amount | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


def apply_edits(conv: Conversation, edits: Sequence[Edit],
                count: Callable[[Conversation], int]) -> Conversation:
    """`conv` with `edits` applied in order (module docstring) and noted in its `request`.
    count: the prompt tokens of a conversation (`Gateway.prompt_tokens` of the session). Raises
    GatewayError 400 naming an unknown edit type."""
    applied = []
    for i, edit in enumerate(edits):
        if edit.type == "clear_thinking_20251015":
            conv, cleared = _clear_thinking(conv, edit)
        elif edit.type == "clear_tool_uses_20250919":
            conv, cleared = _clear_tool_uses(conv, edit, count)
        else:
            raise unsupported(f"context_management.edits.{i}.type", f"unknown edit {edit.type!r}")
        applied.append({"type": edit.type, "cleared": cleared})
    if not applied:
        return conv
    telemetry.note(applied=applied)
    return dataclasses.replace(conv, request={**conv.request, "applied": applied})


def _clear_thinking(conv: Conversation, edit: Edit) -> tuple[Conversation, int]:
    if edit.keep == "all":
        return conv, 0
    keep = 1 if edit.keep is None else edit.keep.value
    turns = [k for k, m in enumerate(conv.messages) if m.reasoning is not None]
    drop = set(turns[: max(0, len(turns) - keep)])
    msgs = tuple(dataclasses.replace(m, reasoning=None, reasoning_signature=None)
                 if k in drop else m for k, m in enumerate(conv.messages))
    return dataclasses.replace(conv, messages=msgs), len(drop)


def _tokens(count: Callable[[Conversation], int], conv: Conversation) -> float:
    try:
        return count(conv)
    except GatewayError as e:  # surely over the context: more than any trigger
        if e.code != "context_length_exceeded":
            raise
        return math.inf


def _clear_tool_uses(conv: Conversation, edit: Edit, count: Callable[[Conversation], int]
                     ) -> tuple[Conversation, int]:
    before = _tokens(count, conv)
    if before <= (100_000 if edit.trigger is None else edit.trigger.value):
        return conv, 0
    keep = edit.keep.value if isinstance(edit.keep, Amount) else 3
    calls = [c for m in conv.messages for c in m.tool_calls]
    old = {c.id for c in calls[: max(0, len(calls) - keep)]
           if c.name not in (edit.exclude_tools or ())}
    inputs = edit.clear_tool_inputs or ()

    def cleared(m: Message) -> Message:
        if m.role == "tool" and m.tool_call_id in old:
            return dataclasses.replace(m, content=CLEARED)
        return dataclasses.replace(m, tool_calls=tuple(
            dataclasses.replace(c, arguments="{}") if c.id in old and (
                inputs is True or c.name in inputs) else c for c in m.tool_calls))

    edited = dataclasses.replace(conv, messages=tuple(cleared(m) for m in conv.messages))
    least = edit.clear_at_least
    if not old or (least and before - _tokens(count, edited) < least.value):
        return conv, 0
    return edited, len(old)
