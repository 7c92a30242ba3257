"""OpenAI Chat Completions over the gateway core: wire schema in, `Conversation`, wire JSON out.

Data flow: POST /v1/chat/completions body --`parse`--> (`ChatRequest`, `Conversation`) -->
`Gateway.complete` (core.py: renders, dispatches, records, parses) --`respond`--> a
`chat.completion` object; with `stream: true`, `Gateway.stream` --`respond_stream`-->
`chat.completion.chunk` SSE events, each sent as soon as the engine sampled its tokens.

What the gateway does with each request field (honoured, kept, approximated, left out, refused
with a 400 naming it) is its row in `fields.CHAT`; a field in no row is kept (a 400 under
`[gateway] strict`). Non-text content parts are refused here, where messages are translated.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

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
from forgerl.gateway.errors import GatewayError, Loose, missing, parse_body, unsupported
from forgerl.gateway.fields import CHAT, enforce, noted, template_kwargs
from forgerl.gateway.record import Choice, Result, TokenLogprob
from forgerl.gateway.sse import EventStream

# ---- request schema (fields the gateway does not read are kept in `model_extra`) ------------


class ContentPart(Loose):
    """One part of a list-valued `content`; "text" (and an assistant's "refusal") is read."""

    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCall(Loose):
    """A tool call's function: name and arguments (a JSON string or an object)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Loose):
    """An assistant message's tool call (OpenAI shape)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Loose):
    """One chat message; `tool_calls` on assistant turns, `tool_call_id` on tool turns;
    `reasoning_content` (or `reasoning`) is an assistant's reasoning text."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDecl(Loose):
    """A declared tool: name, description, JSON-schema parameters (`strict` is not enforced)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDecl(Loose):
    """`{"type": "function", "function": {...}}` in the request's `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDecl


class NamedFunction(Loose):
    name: str


class NamedToolChoice(Loose):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ResponseFormat(Loose):
    type: Literal["text", "json_object", "json_schema"]


class StreamOptions(Loose):
    """`stream_options`: `include_usage` adds a final usage chunk."""

    include_usage: bool = False


class ChatRequest(BaseModel):
    """POST /v1/chat/completions body; `fields.CHAT` says what the gateway does with each field.

    The session's temperature / max_tokens override the request's; `max_completion_tokens`
    wins over `max_tokens`; max tokens are clamped to the context left after the prompt.
    """

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDecl] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int | None = Field(None, ge=1, le=128)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extras: top_k, min_p, repetition_penalty
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    modalities: list[str] | None = None


# ---- request -> Conversation ----------------------------------------------------------------


def _text(content: str | list[ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in ("text", "refusal"):
            raise unsupported(f"{where}.content.{j}.type",
                              f"content part {part.type!r}: the policy reads text only")
        if getattr(part, part.type) is None:  # as OpenAI: a text part without its text is a 400
            raise missing(f"{where}.content.{j}.{part.type}")
    return "".join(p.text or p.refusal or "" for p in content)


def _message(m: ChatMessage, i: int) -> Message:
    calls = tuple(
        ToolCall(c.function.name, c.function.arguments if isinstance(c.function.arguments, str)
                 else json.dumps(c.function.arguments, ensure_ascii=False), c.id or "")
        for c in m.tool_calls or ()
    )
    if m.content is None and m.role != "assistant":  # as OpenAI: never an empty turn silently
        raise GatewayError(400, f"messages.{i}.content: a {m.role} message needs content",
                           "missing_required_parameter", f"messages.{i}.content")
    if m.role == "tool" and m.tool_call_id is None:  # as OpenAI: a result names its call
        raise missing(f"messages.{i}.tool_call_id")
    role = "system" if m.role == "developer" else m.role
    return Message(role, _text(m.content, f"messages.{i}"), calls, m.tool_call_id,
                   m.reasoning_content if m.reasoning_content is not None else m.reasoning)


def to_conversation(req: ChatRequest, strict: bool = False) -> Conversation:
    """The internal form of a validated chat request. Raises GatewayError 400 for a refused
    field (`fields.CHAT`; `strict`: see fields.enforce) or a non-text content part."""
    notes = enforce(CHAT, req, strict, "chat")
    choice: ToolChoice = "auto"
    if isinstance(req.tool_choice, NamedToolChoice):
        choice = ForcedTool(req.tool_choice.function.name)
    elif req.tool_choice is not None:
        choice = req.tool_choice
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    max_tokens = req.max_completion_tokens or req.max_tokens
    return Conversation(
        model=req.model,
        messages=tuple(_message(m, i) for i, m in enumerate(req.messages)),
        tools=tuple(Tool(t.function.name, t.function.description, t.function.parameters)
                    for t in req.tools or ()),
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        sampling=Sampling(req.temperature, req.top_p, max_tokens, stop, req.seed, req.top_k,
                          req.min_p, req.repetition_penalty, req.presence_penalty,
                          req.frequency_penalty),
        n=req.n or 1,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        param_names={"max_tokens": "max_completion_tokens" if req.max_completion_tokens
                     else "max_tokens"},
        request=noted(notes),
        template_kwargs=template_kwargs(req),
    )


def parse(raw: bytes, strict: bool = False) -> tuple[ChatRequest, Conversation]:
    """Validate a body and translate it; raises GatewayError 400 (see `parse_body`)."""
    req = parse_body(raw, ChatRequest)
    return req, to_conversation(req, strict)


def messages(raw: list[dict[str, Any]]) -> list[Message]:
    """Chat-shaped message dicts in the internal form (what tests and tools render)."""
    return [_message(ChatMessage.model_validate(m), i) for i, m in enumerate(raw)]


def tools(raw: list[dict[str, Any]]) -> tuple[Tool, ...]:
    """Chat-shaped tool declarations in the canonical `Tool` form."""
    decls = [ToolDecl.model_validate(t) for t in raw]
    return tuple(Tool(d.function.name, d.function.description, d.function.parameters)
                 for d in decls)


# ---- Result -> response ---------------------------------------------------------------------


def _tool_calls(reply: Message) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in reply.tool_calls]


def message_json(reply: Message) -> dict[str, Any]:
    """An assistant reply as a chat message: content None only when tool calls stand alone."""
    msg: dict[str, Any] = {"role": "assistant",
                           "content": reply.content if reply.content or not reply.tool_calls
                           else None}
    if reply.tool_calls:
        msg["tool_calls"] = _tool_calls(reply)
    if reply.reasoning is not None:
        msg["reasoning_content"] = reply.reasoning
    return msg


def _logprobs(c: Choice) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    content = [token_json(t) for t in c.logprobs]
    return {"content": content, "refusal": None}


def usage_json(result: Result) -> dict[str, int]:
    """OpenAI `usage`: prompt, completion (every choice) and total tokens."""
    p, n = result.prompt_tokens, result.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def chat_response(cid: str, model: str, result: Result) -> dict[str, Any]:
    """An OpenAI `chat.completion` object, one choice per `result` choice."""
    choices = [{"index": c.index, "message": message_json(c.reply),
                "finish_reason": c.finish_reason, "logprobs": _logprobs(c)}
               for c in result.choices]
    return {"id": cid, "object": "chat.completion", "created": int(result.started_at),
            "model": model, "choices": choices, "usage": usage_json(result)}


OPENED = ": forgerl: sampling\n\n"
"""An SSE comment (clients skip it) that opens a stream once the call passed every check, so
its HTTP headers arrive before the engine samples the first token."""


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def error_event(e: GatewayError) -> str:
    """A failure after the stream began, as the OpenAI API sends it (the SDK raises it)."""
    return _sse({"error": {"message": e.message, "type": e.type, "param": e.param,
                           "code": e.code}})


async def chat_chunks(cid: str, model: str, events: AsyncIterator[Started | Delta | Result],
                      include_usage: bool) -> AsyncIterator[str]:
    """SSE lines of a `chat.completion.chunk` stream from `Gateway.stream` events: `OPENED` at
    `Started`; per choice its role (with its first delta), `reasoning_content` deltas, content
    deltas (each with the
    logprobs of its new tokens), each tool call as one chunk (id, name, whole arguments), and
    its finish (with the logprobs not sent yet); then usage when asked; then `[DONE]`."""
    created = 0
    opened: set[int] = set()
    sent: dict[int, int] = {}

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> str:
        return _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                     "model": model, "choices": [] if choice is None else [choice], **extra})

    def delta(i: int, d: dict[str, Any], finish: str | None = None, lp: Any = None) -> str:
        # the role opens with content null when a tool call comes first (as OpenAI's API
        # sends it), so that a reassembled tool-only reply has content null as the plain one
        opening = {"role": "assistant", "content": None if "tool_calls" in d else ""}
        head = "" if i in opened else chunk({"index": i, "delta": opening,
                                             "finish_reason": None, "logprobs": None})
        opened.add(i)
        return head + chunk({"index": i, "delta": d, "finish_reason": finish, "logprobs": lp})

    async with contextlib.aclosing(events) as stream:
        async for ev in stream:
            if isinstance(ev, Started):  # checked and dispatched: the headers go out now
                created = int(ev.started_at)
                yield OPENED
            elif isinstance(ev, Delta) and ev.reasoning:
                yield delta(ev.index, {"reasoning_content": ev.reasoning})
            elif isinstance(ev, Delta) and ev.tool_call is not None:
                call = ev.tool_call  # whole once its block closed: one chunk per call
                yield delta(ev.index, {"tool_calls": [{
                    "index": ev.call_index, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}]})
            elif isinstance(ev, Delta):
                lp = None
                if ev.logprobs is not None:
                    lp = {"content": [token_json(t) for t in ev.logprobs], "refusal": None}
                    sent[ev.index] = sent.get(ev.index, 0) + len(ev.logprobs)
                yield delta(ev.index, {"content": ev.text}, lp=lp)
            elif isinstance(ev, Result):
                for c in ev.choices:
                    lp = None
                    if c.logprobs is not None:
                        rest = c.logprobs[sent.get(c.index, 0):]
                        lp = {"content": [token_json(t) for t in rest], "refusal": None}
                    yield delta(c.index, {}, c.finish_reason, lp)
                if include_usage:
                    yield chunk(None, usage=usage_json(ev))
    yield "data: [DONE]\n\n"


def token_json(t: TokenLogprob) -> dict[str, Any]:
    """One sampled token's logprob entry (OpenAI shape; no alternatives)."""
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes), "top_logprobs": []}


def respond(req: ChatRequest, result: Result) -> JSONResponse:
    """The HTTP answer of a plain call. (A JSONResponse skips FastAPI's per-field
    `jsonable_encoder` walk, which the plain dict would go through.)"""
    return JSONResponse(chat_response(f"chatcmpl-{uuid.uuid4().hex}", req.model, result))


def respond_stream(req: ChatRequest, events: AsyncIterator[Started | Delta | Result],
                   ) -> EventStream:
    """The HTTP answer of `stream: true`: `Gateway.stream` events as chat chunks."""
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return EventStream(chat_chunks(f"chatcmpl-{uuid.uuid4().hex}", req.model, events, usage),
                       error_event)
