"""Completion text -> tool calls, for the Hermes `<tool_call>{json}</tool_call>` format.

Data flow: the gateway decodes the sampled ids and parses them here only to answer the client;
the recorded token ids never depend on the parse. A parse never raises: a block with invalid
JSON, a missing name or an undeclared tool stays in `content` as text and is reported in
`errors` (CASES.md C05). An unclosed `<tool_call>` (a reply truncated by max_tokens, C09) also
stays as text; the gateway keeps that turn's finish_reason "length".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from forgerl.gateway.conversation import ToolCall

# A block body never contains another opening tag: an unclosed block must not swallow the next
# valid one (C05).
BLOCK = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.DOTALL)


@dataclass
class ParsedReply:
    """content: the text outside valid tool-call blocks (None when empty and calls were found).
    tool_calls: `ToolCall`s (id "call_" + 24 hex digits, arguments JSON text), in reply order.
    errors: one line per block kept as text."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _parse_block(body: str, declared: set[str] | None) -> tuple[ToolCall | None, str]:
    """One block body -> (tool call, "") or (None, error message)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"invalid JSON in <tool_call>: {e.msg} at char {e.pos}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, "<tool_call> is not an object with a string 'name'"
    name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    if args is None or args == "":  # a call with no arguments (CASES.md C14)
        args = {}
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f"arguments of {name!r} are not a JSON object"
    if not isinstance(args, dict):
        return None, f"arguments of {name!r} are not a JSON object"
    if declared is not None and name not in declared:
        return None, f"tool {name!r} was not declared in the request"
    return ToolCall(name, json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}"), ""


def parse_tool_calls(text: str, declared: set[str] | None = None) -> ParsedReply:
    """Split a reply into text and Hermes tool calls (several per reply, in order).

    declared: the tool names the request offered; None accepts any name.
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    kept: list[str] = []
    pos = 0
    for m in BLOCK.finditer(text):
        kept.append(text[pos : m.start()])
        call, err = _parse_block(m.group(1).strip(), declared)
        if call is None:
            kept.append(m.group(0))
            errors.append(err)
        else:
            calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    for _ in range(sum(seg.count("<tool_call>") for seg in kept) - len(errors)):
        errors.append("unclosed <tool_call> (reply truncated?)")
    content = "".join(kept).strip() if calls else "".join(kept)
    return ParsedReply(content=content or (None if calls else ""), tool_calls=calls, errors=errors)
