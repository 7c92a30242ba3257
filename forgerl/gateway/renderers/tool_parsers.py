"""Completion text -> tool calls, one parser per model family's tool-call format.

Data flow: the gateway decodes the sampled ids and parses them here only to answer the client;
the recorded token ids never depend on the parse. The renderer names its parser
(`Renderer.parser`): ChatML and Qwen-family templates use `hermes`, Llama 3.x `llama3_json`,
Mistral `mistral` (`detect_parser` reads the chat template; `[gateway] tool_parser` overrides).

    hermes       <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>   (several per reply)
    llama3_json  {"name": ..., "parameters": {...}}, the whole reply, maybe after <|python_tag|>
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abc123XYZ"}, ...]

A parse never raises: a call with invalid JSON, a missing name or an undeclared tool stays in
`content` as text and is reported in `errors` (CASES.md C05; a mistral list with a valid call
keeps only that call and reports the rest). An unclosed `<tool_call>` (a reply truncated by
max_tokens, C09) also stays as text; the gateway keeps that turn's finish_reason "length".
Streaming: a hermes call is recognised as soon as its block closes; llama3_json and mistral calls
have no closing string, so a stream with tools holds their reply back and parses it once, when
it ends (`replies.HeldReply`), giving the same content and calls as the non-streamed reply.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from forgerl.gateway.conversation import ToolCall

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG, MISTRAL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"

# A block body never contains another opening tag: an unclosed block must not swallow the next
# valid one (C05).
BLOCK = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>", re.DOTALL)


@dataclass
class ParsedReply:
    """content: the text outside valid tool calls (None when empty and calls were found; with
    calls, trailing whitespace and line breaks that start text after a call stripped).
    tool_calls: `ToolCall`s (arguments JSON text), in reply order; ids "call_" + 24 hex digits
    (mistral: the model's 9-character id, else 9 random letters and digits).
    errors: one line per call kept as text."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _hermes_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, declared: set[str] | None, call_id: str) -> tuple[ToolCall | None, str]:
    """One decoded call object -> (tool call, "") or (None, error message)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, "tool call is not an object with a string 'name'"
    name, args = obj["name"], obj.get("arguments", obj.get("parameters", {}))
    if args is None or args == "":  # a call with no arguments (CASES.md C14)
        args = {}
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # malformed, too deep, a > 4,300-digit integer
            return None, f"arguments of {name!r} are not a JSON object"
    if not isinstance(args, dict):
        return None, f"arguments of {name!r} are not a JSON object"
    if declared is not None and name not in declared:
        return None, f"tool {name!r} was not declared in the request"
    return ToolCall(name, json.dumps(args, ensure_ascii=False), call_id), ""


def _loads(body: str) -> tuple[Any, str]:
    """(decoded JSON, "") or (None, error message)."""
    try:
        return json.loads(body), ""
    except json.JSONDecodeError as e:
        return None, f"invalid JSON in tool call: {e.msg} at char {e.pos}"
    except (ValueError, RecursionError) as e:  # nested too deeply, a > 4,300-digit integer
        return None, f"invalid JSON in tool call: {e}"


def parse_tool_calls(text: str, declared: set[str] | None = None) -> ParsedReply:
    """Split a reply into text and Hermes tool calls (several per reply, in order).

    declared: the tool names the request offered; None accepts any name.
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    kept: list[str] = []
    pos, lead = 0, ""
    for m in BLOCK.finditer(text):
        kept.append(text[pos : m.start()])
        obj, err = _loads(m.group(1).strip())
        call, err = (None, err) if err else _call(obj, declared, _hermes_id())
        if call is None:
            kept.append(m.group(0))
            errors.append(err)
        else:
            if not calls:
                lead = "".join(kept)  # the text before the first call
            calls.append(call)
        pos = m.end()
    kept.append(text[pos:])
    for _ in range(sum(seg.count(CALL_OPEN) for seg in kept) - len(errors)):
        errors.append("unclosed <tool_call> (reply truncated?)")
    content = "".join(kept)
    if calls:  # trailing whitespace goes, and line breaks that start text after a call; a
        # space there is the model's (CASES.md C14: " All done.")
        content = (content.lstrip("\r\n") if not lead.strip() else content).rstrip()
    return ParsedReply(content=content or (None if calls else ""), tool_calls=calls, errors=errors)


def parse_llama3_json(text: str, declared: set[str] | None = None) -> ParsedReply:
    """A Llama 3.x reply that is one JSON call object (`parameters` or `arguments`), maybe after
    text and `<|python_tag|>`; a reply not starting with "{" (after the tag) is plain text."""
    head, tag, body = text.partition(PYTHON_TAG)
    if not tag:
        head, body = "", text
    if not body.strip().startswith("{"):
        return ParsedReply(text)
    obj, err = _loads(body.strip())
    call, err = (None, err) if err else _call(obj, declared, _hermes_id())
    if call is None:
        return ParsedReply(text, errors=[err])
    return ParsedReply(head.strip() or None, [call])


def _mistral_id(obj: Any) -> str:
    given = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(given, str) and len(given) == 9 and given.isalnum():
        return given  # Mistral templates insist on 9 alphanumeric characters
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def parse_mistral(text: str, declared: set[str] | None = None) -> ParsedReply:
    """A Mistral reply: optional text, then `[TOOL_CALLS]` and a JSON list of call objects."""
    head, tag, body = text.partition(MISTRAL_CALLS)
    if not tag:
        return ParsedReply(text)
    objs, err = _loads(body.strip())
    if err:
        return ParsedReply(text, errors=[err])
    calls, errors = [], []
    for obj in objs if isinstance(objs, list) else [objs]:
        call, err = _call(obj, declared, _mistral_id(obj))
        if call is None:
            errors.append(err)
        else:
            calls.append(call)
    if not calls:
        return ParsedReply(text, errors=errors)
    return ParsedReply(head.strip() or None, calls, errors)


@dataclass(frozen=True)
class ToolParser:
    """One family's tool-call format: how to parse it, stream it and force it.

    parse: `(text, declared names or None) -> ParsedReply`, never raising. open / close: the
    strings around one call (streaming recognises a call when `close` arrives; a reply limited
    to one call stops after `close`); None: no such string. prefix_any / prefix_named: reply
    text that opens a call of any tool / of tool `{name}` up to the brace of its arguments
    object (tool_choice "required" / named: the arguments cannot start with a non-object);
    None: the format cannot be forced. multiple: a reply may hold several calls.
    """

    name: str
    parse: Callable[[str, set[str] | None], ParsedReply]
    open: str | None = None
    close: str | None = None
    prefix_any: str | None = None
    prefix_named: str | None = None
    multiple: bool = True

    def call_prefix(self, name: str | None) -> str | None:
        """The prefill that makes the reply a call of tool `name` (any tool when None), or None
        when this format cannot be forced."""
        text = self.prefix_any if name is None else self.prefix_named
        if text is None:
            return None
        return text.replace("{name}", json.dumps(name, ensure_ascii=False))


HERMES = ToolParser("hermes", parse_tool_calls, CALL_OPEN, CALL_CLOSE, f"{CALL_OPEN}\n",
                    f'{CALL_OPEN}\n{{"name": {{name}}, "arguments": {{')
LLAMA3_JSON = ToolParser("llama3_json", parse_llama3_json, prefix_any='{"name": ',
                         prefix_named='{"name": {name}, "parameters": {', multiple=False)
MISTRAL = ToolParser("mistral", parse_mistral)  # its opener is a control token: never prefilled
PARSERS = {p.name: p for p in (HERMES, LLAMA3_JSON, MISTRAL)}


def detect_parser(template: str) -> ToolParser:
    """The parser a chat template's tool section asks for (hermes when it names none)."""
    if MISTRAL_CALLS in template:
        return MISTRAL
    if CALL_OPEN in template:
        return HERMES
    return LLAMA3_JSON if PYTHON_TAG in template or '"parameters"' in template else HERMES
