"""Anthropic Messages over the gateway core: wire schema in, `Conversation`, wire JSON out.

Data flow: POST /v1/messages body --`parse`--> (`MessagesRequest`, `Conversation`) -->
`Gateway.complete` --`respond`--> a `message` object; with `stream: true`, `Gateway.stream`
--`respond_stream`--> SSE events as tokens are sampled (message_start, content_block_start /
_delta (`text_delta`, `input_json_delta`) / _stop, message_delta, message_stop).
POST /v1/messages/count_tokens answers the next call's `input_tokens` and records nothing.

What the gateway does with each request field (honoured, kept, approximated, left out, refused
with a 400 naming it) is `fields.MESSAGES`; a field in no row is kept (a 400 under `[gateway]
strict`). Messages: user, assistant, and system anywhere (the mid-conversation system beta).
Content blocks: text (in a row joined by "\n"; an assistant's split by tool_use blocks, as its
stream splits them, by nothing), tool_use, tool_result (string or text blocks; `is_error` renders
"Error: {content}", ChatML having no error slot), thinking (the internal `reasoning`; its
signature kept as sent, unchecked), redacted_thinking (unreadable: dropped); other blocks
(image, document, ...) and a final assistant message (prefill) are refused here. Server tools
(type other than "custom") are left out and counted. `context_management.edits` are applied to
the messages before rendering (edits.py). Errors are Anthropic-shaped
(GatewayError.anthropic_response).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
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
from forgerl.gateway.dispatch import Delta, Started
from forgerl.gateway.edits import Edit, apply_edits
from forgerl.gateway.errors import GatewayError, Loose, parse_body, unsupported
from forgerl.gateway.fields import MESSAGES, enforce, noted, strictly, template_kwargs
from forgerl.gateway.record import Result
from forgerl.gateway.sse import EventStream

# ---- request schema (fields the gateway does not read are kept in `model_extra`) ------------


class TextBlock(Loose):
    type: Literal["text"]
    text: str


class ToolUseBlock(Loose):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Loose):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Block] | None = None
    is_error: bool | None = None


class ThinkingBlock(Loose):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class OtherBlock(Loose):  # a block the gateway does not read (image, document, ...)
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


class MessageIn(Loose):  # a string `content` is one text block
    role: Literal["user", "assistant", "system"]
    content: list[Block]

    _blocks = field_validator("content", mode="before")(
        lambda v: [{"type": "text", "text": v}] if isinstance(v, str) else v)


class ToolDecl(Loose):  # custom tools (type absent or "custom") need a name and input_schema
    name: str = ""  # server tools may have none (mcp_toolset)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoiceIn(Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Loose):
    type: str


class ContextManagement(Loose):
    edits: list[Edit] = Field(default_factory=list)


class PromptRequest(BaseModel):  # POST /v1/messages/count_tokens: what renders the prompt
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDecl] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingConfig | None = None
    output_config: dict[str, Any] | None = None
    context_management: ContextManagement | None = None


class MessagesRequest(PromptRequest):
    """POST /v1/messages body (`fields.MESSAGES`). The session's temperature / max_tokens
    override the request's; max_tokens is clamped to the context left after the prompt."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = None


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
        if isinstance(b, TextBlock):  # text blocks in a row join by "\n", across a tool_use
            # by nothing: the streamed reply splits its one text around tool_use blocks
            after_text = j > 0 and isinstance(m.content[j - 1], TextBlock)
            texts.append(("\n" if after_text else "") + b.text)
        elif isinstance(b, ToolUseBlock):
            calls.append(ToolCall(b.name, json.dumps(b.input, ensure_ascii=False), b.id))
        elif isinstance(b, ThinkingBlock) and not thinking:
            thinking.append(b)
        elif b.type != "redacted_thinking":  # unreadable (encrypted): nothing to render
            why = ("one thinking block per assistant message (one reasoning field)"
                   if isinstance(b, ThinkingBlock) else f"block {b.type!r} is not read")
            raise unsupported(f"{where}.content.{j}.type", why)
    t = thinking[0] if thinking else None
    return Message("assistant", "".join(texts), tuple(calls), None, t and t.thinking,
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
        if not m.content or any(isinstance(b, TextBlock) and not b.text for b in m.content):
            raise GatewayError(400, f"{where}: all messages must have non-empty content, and "
                               "text content blocks non-empty text", "invalid_value", where)
        if m.role == "system":
            out.append(Message("system", _text(m.content, f"{where}.content")))
            continue
        out += _user(m, where) if m.role == "user" else [_assistant(m, where)]
    return tuple(out)


def _tools(req: PromptRequest, notes: dict[str, Any], strict: bool) -> tuple[Tool, ...]:
    """The custom tools; server tools are left out, named in `notes["left_out"]` (a 400 when
    `strict`)."""
    tools = []
    for i, t in enumerate(req.tools or ()):
        if t.type not in (None, "custom"):
            if strict:
                raise strictly(f"tools.{i}.type", f"server tool {t.type!r} is left out")
            notes["left_out"].append(f"{t.type}:{t.name}" if t.name else t.type)
            continue
        if t.input_schema is None:
            raise unsupported(f"tools.{i}.input_schema", f"tool {t.name!r} needs input_schema")
        tools.append(Tool(t.name, t.description, t.input_schema))
    return tuple(tools)


def to_conversation(req: PromptRequest, strict: bool = False,
                    count: Callable[[Conversation], int] | None = None) -> Conversation:
    """The internal form of a validated request, its context edits applied (`count`: the
    prompt tokens of a conversation, for `edits.apply_edits`). Raises GatewayError 400 for a
    refused field or block (`fields.MESSAGES`, `strict`: see fields.enforce)."""
    notes = enforce(MESSAGES, req, strict, "messages")
    choice: ToolChoice = "auto"
    tc = req.tool_choice
    if tc is not None and tc.type == "tool":
        if tc.name is None:
            raise unsupported("tool_choice.name", 'type "tool" needs a name')
        choice = ForcedTool(tc.name)
    elif tc is not None:
        choice = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
    sampling = Sampling(req.temperature, req.top_p, req.max_tokens, tuple(
        req.stop_sequences or ()), top_k=req.top_k) if isinstance(req, MessagesRequest) else (
        Sampling())
    conv = Conversation(
        model=req.model, messages=_messages(req), tools=_tools(req, notes, strict),
        tool_choice=choice, parallel_tool_calls=not (tc and tc.disable_parallel_tool_use),
        sampling=sampling, param_names={"stop": "stop_sequences", "parameters": "input_schema"},
        request=noted(notes), template_kwargs=template_kwargs(req))
    edits = req.context_management.edits if req.context_management else []
    return apply_edits(conv, edits, count or (lambda c: 0))


def parse(raw: bytes, strict: bool = False, count: Callable[[Conversation], int] | None = None
          ) -> tuple[MessagesRequest, Conversation]:
    """Validate a POST /v1/messages body and translate it (`to_conversation`); raises
    GatewayError 400."""
    req = parse_body(raw, MessagesRequest)
    return req, to_conversation(req, strict, count)


def parse_prompt(raw: bytes, strict: bool = False,
                 count: Callable[[Conversation], int] | None = None) -> Conversation:
    """Validate a POST /v1/messages/count_tokens body and translate it (no sampling fields);
    raises GatewayError 400. Its count is `Gateway.prompt_tokens` of the result."""
    return to_conversation(parse_body(raw, PromptRequest), strict, count)


# ---- Result -> response ---------------------------------------------------------------------


def _input(arguments: str) -> dict[str, Any]:
    with contextlib.suppress(ValueError, RecursionError):
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


def ending(result: Result, stops: tuple[str, ...], decode: Callable[[list[int]], str]
           ) -> dict[str, Any]:
    """stop_reason, stop_sequence and usage of `result`'s choice: a "stop" finish whose kept ids
    decode to text holding a stop string (the core cut there) is that "stop_sequence"."""
    c = result.choices[0]
    ids = c.completion.completion_ids
    text, sequence = decode(ids), None
    reason = {"tool_calls": "tool_use", "length": "max_tokens"}.get(c.finish_reason, "end_turn")
    found = [(text.find(s) + len(s), s) for s in stops if s in text]
    if c.finish_reason == "stop" and found:
        reason, sequence = "stop_sequence", min(found)[1]
    return {"stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": result.prompt_tokens, "output_tokens": len(ids)}}


def _head(mid: str, model: str, prompt_tokens: int) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}


def _sse(kind: str, **data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def error_event(e: GatewayError) -> str:
    """A failure after the stream began, as the Messages API sends it (the SDK raises it)."""
    return f"event: error\ndata: {bytes(e.anthropic_response().body).decode()}\n\n"


async def message_events(mid: str, req: MessagesRequest, conv: Conversation,
                         events: AsyncIterator[Started | Delta | Result],
                         decode: Callable[[list[int]], str]) -> AsyncIterator[str]:
    """SSE events as `Gateway.stream` yields: message_start at `Started`; a thinking block of
    the reasoning deltas (an empty signature: the gateway signs nothing); a text block opened
    by the first content delta, closed by a tool call or the end; a tool_use block per call
    (input in one `input_json_delta`); message_delta and message_stop at the `Result`."""
    index, text_open, thinking_open = 0, False, False
    async for item in events:
        if isinstance(item, Started):
            yield _sse("message_start", message=_head(mid, req.model, item.prompt_tokens))
            continue
        if isinstance(item, Delta) and item.reasoning:
            if not thinking_open:
                yield _sse("content_block_start", index=index,
                           content_block={"type": "thinking", "thinking": "", "signature": ""})
            thinking_open = True
            yield _sse("content_block_delta", index=index,
                       delta={"type": "thinking_delta", "thinking": item.reasoning})
            continue
        if thinking_open:  # reasoning comes first: anything else closes its block
            yield _sse("content_block_delta", index=index,
                       delta={"type": "signature_delta", "signature": ""})
            yield _sse("content_block_stop", index=index)
            index, thinking_open = index + 1, False
        if isinstance(item, Delta) and item.tool_call is None:
            if item.text and not text_open:
                yield _sse("content_block_start", index=index,
                           content_block={"type": "text", "text": ""})
            if item.text:
                text_open = True
                yield _sse("content_block_delta", index=index,
                           delta={"type": "text_delta", "text": item.text})
            continue
        if text_open:
            yield _sse("content_block_stop", index=index)
            index, text_open = index + 1, False
        if isinstance(item, Delta):
            call = item.tool_call
            yield _sse("content_block_start", index=index, content_block={
                "type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            yield _sse("content_block_delta", index=index, delta={
                "type": "input_json_delta", "partial_json": json.dumps(_input(call.arguments))})
            yield _sse("content_block_stop", index=index)
            index += 1
        else:
            end = ending(item, conv.sampling.stop, decode)
            yield _sse("message_delta", usage=end.pop("usage"), delta=end)
            yield _sse("message_stop")


def respond(req: MessagesRequest, conv: Conversation, result: Result,
            decode: Callable[[list[int]], str]) -> JSONResponse:
    """The `message` object answering a non-streamed call."""
    head = _head(f"msg_{uuid.uuid4().hex}", req.model, result.prompt_tokens)
    return JSONResponse({**head, "content": content_blocks(result.choices[0].reply),
                         **ending(result, conv.sampling.stop, decode)})


def respond_stream(req: MessagesRequest, conv: Conversation,
                   events: AsyncIterator[Started | Delta | Result],
                   decode: Callable[[list[int]], str]) -> EventStream:
    """The SSE answer of `stream: true`, event by event as `Gateway.stream` samples."""
    return EventStream(message_events(f"msg_{uuid.uuid4().hex}", req, conv, events,
                                      decode), error_event)
