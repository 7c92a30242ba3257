"""Anthropic Messages over the gateway core: wire schema in, `Conversation`, wire JSON out.

Data flow: POST /v1/messages body --`parse`--> (`MessagesRequest`, `Conversation`) -->
`Gateway.complete` (core.py: renders, dispatches, records, parses) --`respond`--> a `message`
object, or with `stream: true` the SSE events message_start, content_block_start / _delta
(`text_delta`, `input_json_delta`, `thinking_delta` + `signature_delta`) / _stop per block,
message_delta (stop_reason, stop_sequence, usage), message_stop. POST /v1/messages/count_tokens
answers the `input_tokens` the next call would render (`count_tokens`), recording nothing.

Honoured: system (string or text blocks, joined by "\\n"), messages with content as a string or
blocks: text, tool_use (id, name, input), tool_result (tool_use_id, content as a string or text
blocks; `is_error: true` renders the result as "Error: {content}", ChatML having no error slot),
thinking (the internal `reasoning`, its signature kept as sent, unchecked); tools with
input_schema; tool_choice auto / any (a prefilled tool call) / tool (a named, prefilled call) /
none, `disable_parallel_tool_use`; max_tokens (required); stop_sequences (stop_reason
"stop_sequence" and the matched `stop_sequence`); temperature; top_p (< 1 refused for training
sessions, C04); thinking disabled / adaptive (the policy decides; ChatML renders no reasoning).
Accepted without effect: metadata, service_tier, speed, inference_geo, user_profile_id,
workspace_id, cache_control (top level and on blocks; the engine keeps its own prefix cache),
citations on text blocks, the `anthropic-version` and `anthropic-beta` headers.
Refused with a 400 naming the field: top_k, thinking enabled (no thinking budget control),
output_config format / effort, container, diagnostics, mcp_servers, context_management, server
tools (a `type` other than "custom"), blocks other than the above (image, document,
redacted_thinking, server tool blocks, ...), a final assistant message (prefill), and unknown
top-level fields. Errors are Anthropic-shaped (errors.GatewayError.anthropic_response).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from forgerl.gateway.conversation import (
    Conversation,
    ForcedTool,
    Message,
    Sampling,
    Tool,
    ToolCall,
    ToolChoice,
)
from forgerl.gateway.core import Choice, Gateway, Result
from forgerl.gateway.errors import parse_body, unsupported
from forgerl.gateway.sessions import Session

# ---- request schema (blocks allow extra fields such as cache_control; the top level forbids) --


class _Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Loose):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Loose):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Loose):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Block] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Loose):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class OtherBlock(_Loose):  # a block the gateway does not read (image, document, ...)
    type: str


def _block_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in ("text", "tool_use", "tool_result", "thinking") else "other"


Block = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_kind),
]
ToolResultBlock.model_rebuild()


def _as_blocks(v: Any) -> Any:
    return [{"type": "text", "text": v}] if isinstance(v, str) else v


class MessageIn(_Loose):
    """One input message; a string `content` is one text block."""

    role: Literal["user", "assistant"]
    content: list[Block]

    _blocks = field_validator("content", mode="before")(_as_blocks)


class ToolDecl(_Loose):
    """A declared tool; custom tools (type absent or "custom") need `input_schema`."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoiceIn(_Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Loose):
    type: str


class PromptRequest(BaseModel):
    """The fields POST /v1/messages/count_tokens takes (what renders the prompt)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDecl] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingConfig | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    output_config: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    context_management: dict[str, Any] | None = None


class MessagesRequest(PromptRequest):
    """POST /v1/messages body (module docstring). The session's temperature / max_tokens
    override the request's; max_tokens is clamped to the context left after the prompt."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    container: Any = None
    diagnostics: dict[str, Any] | None = None


REFUSED = {
    "mcp_servers": "the gateway connects to no MCP servers; declare the tools instead",
    "context_management": "the gateway does not edit the context (it would break token reuse)",
    "container": "the gateway runs no containers",
    "diagnostics": "the gateway reports no prompt-cache diagnostics",
    "top_k": "the recorded logprobs are over the full vocabulary",
}


# ---- request -> Conversation ----------------------------------------------------------------


def _text(blocks: list[Any], where: str) -> str:
    for j, b in enumerate(blocks):
        if not isinstance(b, TextBlock):
            raise unsupported(f"{where}.{j}.type", f"block {b.type!r}: only text is read here")
    return "\n".join(b.text for b in blocks)


def _user(m: MessageIn, where: str) -> list[Message]:
    """tool_result blocks become tool messages, runs of text blocks user messages, in order."""
    out: list[Message] = []
    texts: list[str] = []
    for j, b in enumerate(m.content):
        if isinstance(b, TextBlock):
            texts.append(b.text)
            continue
        if not isinstance(b, ToolResultBlock):
            raise unsupported(f"{where}.content.{j}.type",
                              f"block {b.type!r} is not read in a user message")
        if texts:
            out.append(Message("user", "\n".join(texts)))
            texts = []
        content = b.content if isinstance(b.content, str) else _text(
            b.content or [], f"{where}.content.{j}.content")
        out.append(Message("tool", f"Error: {content}" if b.is_error else content,
                           tool_call_id=b.tool_use_id))
    if texts or not out:
        out.append(Message("user", "\n".join(texts)))
    return out


def _assistant(m: MessageIn, where: str) -> Message:
    texts: list[str] = []
    calls: list[ToolCall] = []
    thinking: list[ThinkingBlock] = []
    for j, b in enumerate(m.content):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            calls.append(ToolCall(b.name, json.dumps(b.input, ensure_ascii=False), b.id))
        elif isinstance(b, ThinkingBlock) and not thinking:
            thinking.append(b)
        else:
            why = ("one thinking block per assistant message (one reasoning field)"
                   if isinstance(b, ThinkingBlock) else f"block {b.type!r} is not read")
            raise unsupported(f"{where}.content.{j}.type", why)
    t = thinking[0] if thinking else None
    return Message("assistant", "\n".join(texts), tuple(calls), None, t and t.thinking,
                   t and t.signature)


def _messages(req: PromptRequest) -> tuple[Message, ...]:
    out: list[Message] = []
    system = req.system if isinstance(req.system, str) or req.system is None else _text(
        list(req.system), "system")
    if system:
        out.append(Message("system", system))
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if m.role == "assistant" and i == len(req.messages) - 1:
            raise unsupported(where, "a final assistant message (prefill) is not supported")
        out += _user(m, where) if m.role == "user" else [_assistant(m, where)]
    return tuple(out)


def _tools(req: PromptRequest) -> tuple[Tool, ...]:
    tools = []
    for i, t in enumerate(req.tools or ()):
        if t.type not in (None, "custom"):
            raise unsupported(f"tools.{i}.type", f"server tool {t.type!r} ({t.name!r}): the "
                              "gateway runs no server tools; declare a custom tool")
        if t.input_schema is None:
            raise unsupported(f"tools.{i}.input_schema", f"tool {t.name!r} needs input_schema")
        tools.append(Tool(t.name, t.description, t.input_schema))
    return tuple(tools)


def _refuse_unsupported(req: PromptRequest) -> None:
    for name, why in REFUSED.items():
        if getattr(req, name, None) is not None:
            raise unsupported(name, why)
    if req.thinking is not None and req.thinking.type not in ("disabled", "adaptive"):
        raise unsupported("thinking.type", f"{req.thinking.type!r}: the served policy has no "
                          'thinking budget control (use "disabled" or "adaptive")')
    for key, value in (req.output_config or {}).items():
        if value is not None:
            raise unsupported(f"output_config.{key}", "structured output needs constrained "
                              "decoding and effort a control the policy lacks")


def to_conversation(req: PromptRequest) -> Conversation:
    """The internal form of a validated request. Raises GatewayError 400 for a refused field or
    block (module docstring)."""
    _refuse_unsupported(req)
    choice: ToolChoice = "auto"
    tc = req.tool_choice
    if tc is not None and tc.type == "tool":
        if tc.name is None:
            raise unsupported("tool_choice.name", 'type "tool" needs a name')
        choice = ForcedTool(tc.name)
    elif tc is not None:
        choice = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
    sampling = Sampling(req.temperature, req.top_p, req.max_tokens, tuple(
        req.stop_sequences or ())) if isinstance(req, MessagesRequest) else Sampling()
    return Conversation(
        model=req.model, messages=_messages(req), tools=_tools(req), tool_choice=choice,
        parallel_tool_calls=not (tc and tc.disable_parallel_tool_use), sampling=sampling,
        param_names={"stop": "stop_sequences"})


def parse(raw: bytes) -> tuple[MessagesRequest, Conversation]:
    """Validate a POST /v1/messages body and translate it; raises GatewayError 400."""
    req = parse_body(raw, MessagesRequest)
    return req, to_conversation(req)


def count_tokens(gateway: Gateway, session: Session, raw: bytes) -> dict[str, int]:
    """POST /v1/messages/count_tokens: the prompt ids the next call would send (with the
    session's recorded ids reused, and a forced tool call's prefill), counted; nothing is
    recorded or dispatched. Raises GatewayError (400 body / refused field, 404 model)."""
    conv = to_conversation(parse_body(raw, PromptRequest))
    tools = gateway.check(conv)
    plan = session.plan(conv.messages, tools, gateway.renderer)
    prefill = gateway.renderer.encode(gateway.prefill(conv))
    return {"input_tokens": len(plan.prompt_ids) + len(prefill)}


# ---- Result -> response ---------------------------------------------------------------------


def _input(arguments: str) -> dict[str, Any]:
    with contextlib.suppress(json.JSONDecodeError):
        value = json.loads(arguments or "{}")
        return value if isinstance(value, dict) else {}
    return {}


def content_blocks(reply: Message) -> list[dict[str, Any]]:
    """The reply as content blocks: thinking (when it has reasoning), text, tool_use."""
    blocks: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": reply.reasoning,
                       "signature": reply.reasoning_signature or ""})
    if reply.content:
        blocks.append({"type": "text", "text": reply.content})
    blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)}
               for c in reply.tool_calls]
    return blocks


def stop_reason(choice: Choice, stops: tuple[str, ...], text: str) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a choice; `text` is its kept ids decoded. A "stop"
    finish is a stop sequence when one occurs in the text (the core cut it there), the one
    completing first; else the end of the turn."""
    named = {"tool_calls": "tool_use", "length": "max_tokens"}
    if choice.finish_reason in named:
        return named[choice.finish_reason], None
    found = [(text.find(s) + len(s), s) for s in stops if s in text]
    return ("stop_sequence", min(found)[1]) if found else ("end_turn", None)


def message_json(mid: str, model: str, result: Result, reason: tuple[str, str | None]
                 ) -> dict[str, Any]:
    """An Anthropic `message` object for the single choice of `result`."""
    c = result.choices[0]
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content":
            content_blocks(c.reply), "stop_reason": reason[0], "stop_sequence": reason[1],
            "usage": {"input_tokens": result.prompt_tokens,
                      "output_tokens": len(c.completion.completion_ids)}}


def _sse(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def _block_events(index: int, block: dict[str, Any]) -> Iterator[str]:
    kind = block["type"]
    if kind == "text":
        start, deltas = {**block, "text": ""}, [{"type": "text_delta", "text": block["text"]}]
    elif kind == "thinking":
        start = {"type": "thinking", "thinking": "", "signature": ""}
        deltas = [{"type": "thinking_delta", "thinking": block["thinking"]},
                  {"type": "signature_delta", "signature": block["signature"]}]
    else:
        start = {**block, "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
    yield _sse("content_block_start", index=index, content_block=start)
    for d in deltas:
        yield _sse("content_block_delta", index=index, delta=d)
    yield _sse("content_block_stop", index=index)


def message_events(message: dict[str, Any]) -> Iterator[str]:
    """The SSE events of a finished `message` object, in the order the Messages API sends
    them; the SDK's accumulated final message equals `message`."""
    usage = message["usage"]
    head = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}}
    yield _sse("message_start", message=head)
    for i, block in enumerate(message["content"]):
        yield from _block_events(i, block)
    yield _sse("message_delta", delta={"stop_reason": message["stop_reason"],
                                       "stop_sequence": message["stop_sequence"]}, usage=usage)
    yield _sse("message_stop")


def respond(req: MessagesRequest, conv: Conversation, result: Result, gateway: Gateway
            ) -> JSONResponse | StreamingResponse:
    """The HTTP answer: a `message` object, or with `stream: true` its SSE events (replayed
    from the finished `Result`: the core has no token-streaming call yet)."""
    c = result.choices[0]
    text = gateway.renderer.decode(c.completion.completion_ids)
    message = message_json(f"msg_{uuid.uuid4().hex}", req.model, result,
                           stop_reason(c, conv.sampling.stop, text))
    if not req.stream:
        return JSONResponse(message)
    return StreamingResponse(message_events(message), media_type="text/event-stream")

