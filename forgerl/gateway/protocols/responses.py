"""OpenAI Responses over the gateway core: wire schema in, `Conversation`, wire JSON out.

Data flow: POST /v1/responses body --`parse`--> (`ResponsesRequest`, `Conversation`) -->
`Gateway.complete` (core.py) --`respond`--> a `response` object; with `stream: true`,
`Gateway.stream` --`respond_stream`--> the OpenAI SSE events as the engine samples (see
`stream_events`).

Stored responses are the session's turn tree, nothing else: an id `resp_<i|n><32 hex>` is
allocated before the call (`i`: the request had `instructions`) and bound to the recorded turn in
`Session.response_ids`, so a streamed response names its turn exactly as a plain one does.
`previous_response_id` puts that turn's messages (instructions dropped, as OpenAI does) and reply
ahead of `input`; input repeating that context's tail is not added twice. `store: false` answers
an id nothing can continue (the call is recorded anyway).
Items: `message` (text parts), `function_call`, `function_call_output` (an unknown call_id is a
400 naming it), `reasoning` (content, else summary text; `encrypted_content` is unreadable here).
Consecutive assistant-side items are one assistant message, so a re-sent reply matches its
recorded turn and its ids are reused (TITO). What the gateway does with each request field
(honoured, kept, approximated, left out, refused with a 400 naming it) is `fields.RESPONSES`; a
field in no row is kept (a 400 under `[gateway] strict`). Tools other than functions (hosted
tools such as web_search, namespaces, mcp, custom) are left out of the rendering and counted;
other tool_choice types, non-text parts and other item types are refused here.
NeMo-Gym's token ids on items: out as `_output` says, back in as `Session.item_plan` rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from forgerl.gateway.conversation import (
    Conversation,
    ForcedTool,
    ItemIds,
    Message,
    Sampling,
    Tool,
    ToolCall,
    ToolChoice,
)
from forgerl.gateway.dispatch import Delta, Started
from forgerl.gateway.errors import GatewayError, Loose, missing, parse_body, unsupported
from forgerl.gateway.fields import RESPONSES, enforce, noted, strictly, template_kwargs
from forgerl.gateway.protocols.chat import token_json
from forgerl.gateway.record import Choice, Result, TokenLogprob
from forgerl.gateway.sessions import Session, message_key
from forgerl.gateway.sse import EventStream

# ---- request schema (fields the gateway does not read are kept in `model_extra`) ------------


class Part(Loose):
    """A content part; input_text / output_text / refusal / summary_text / reasoning_text."""

    type: str
    text: str | None = None
    refusal: str | None = None


class Item(Loose):
    """One input item; which fields are required depends on `type` (checked in `_messages`)."""

    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None
    summary: list[Part] | None = None
    prompt_token_ids: list[int] | None = Field(None, min_length=1)
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None


class FunctionTool(Loose):
    """A flat tool declaration `{type: "function", name, description, parameters, strict}`."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None


class TextFormat(Loose):
    """`text.format`: `{type: "text" | "json_schema" | "json_object", ...}`."""

    type: str = "text"


class TextOptions(Loose):
    """`text`: the output format (only "text" is served) and verbosity (approximated)."""

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses body; `fields.RESPONSES` says what the gateway does with each field."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


# ---- stored responses = turns of the session ------------------------------------------------


def new_id(req: ResponsesRequest) -> str:
    """A fresh response id (bound to a turn by `bind`; the flag says whether it dropped
    instructions when continued)."""
    return f"resp_{'i' if req.instructions else 'n'}{uuid.uuid4().hex}"


def bind(req: ResponsesRequest, session: Session, rid: str, result: Result) -> None:
    """Name the turn `result` recorded on `session` `rid` (nothing with `store: false`)."""
    ids = result.choices[0].completion.completion_ids
    if req.store is not False:  # its turn holds this very id list (others may have come since)
        session.response_ids[rid] = next(i for i in range(len(session.turns) - 1, -1, -1)
                                         if session.turns[i].completion_ids is ids)


def previous_context(session: Session, rid: str) -> list[Message]:
    """A stored response's turn messages (instructions dropped), then its reply. Raises
    GatewayError 400 `previous_response_not_found` for an id naming no turn of this session."""
    index = session.response_ids.get(rid)
    if index is None:
        raise GatewayError(400, f"Previous response with id {rid!r} not found.",
                           "previous_response_not_found", "previous_response_id")
    turn = session.turns[index]
    return [*turn.messages[1 if rid.startswith("resp_i") else 0:], turn.assistant]


def _join(stored: list[Message], new: list[Message]) -> list[Message]:
    """`stored + new`, minus the longest head of `new` that repeats the tail of `stored` (a
    re-sent previous output or history); a re-sent function call without its message text
    counts as the previous reply when all its call ids are the reply's."""
    keys, fresh = [message_key(m) for m in stored], [message_key(m) for m in new]
    for k in range(min(len(stored), len(new)), 0, -1):
        if keys[-k:] == fresh[:k]:
            return stored + new[k:]
    if new and stored and new[0].tool_calls and (
            {c.id for c in new[0].tool_calls} <= {c.id for c in stored[-1].tool_calls}):
        return stored + new[1:]
    return stored + new


# ---- request -> Conversation ----------------------------------------------------------------


def _need(value: Any, where: str) -> Any:
    if value is None:
        raise missing(where)
    return value


def _text(content: str | list[Part] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text", "text", "refusal"):
            raise unsupported(f"{where}.{j}.type",
                              f"content part {part.type!r}: the policy reads text only")
        field = "refusal" if part.type == "refusal" else "text"
        if getattr(part, field) is None:  # as OpenAI: a text part without its text is a 400
            raise missing(f"{where}.{j}.{field}")
    return "".join(p.text or p.refusal or "" for p in content)


def _assistant(out: list[Message], content: str = "", calls: tuple[ToolCall, ...] = (),
               reasoning: str | None = None) -> None:
    """Append assistant-side item parts, merged into a preceding assistant message."""
    if out and out[-1].role == "assistant":
        prev = out.pop()
        if prev.reasoning is not None or reasoning is not None:
            reasoning = "\n\n".join(r for r in (prev.reasoning, reasoning) if r is not None)
        content, calls = prev.content + content, prev.tool_calls + calls
    out.append(Message("assistant", content, calls, reasoning=reasoning))


def _sent_ids(it: Item, where: str) -> ItemIds:
    """The token ids on an assistant-side item (NeMo-Gym); 400 naming a missing or bad one."""
    if it.type == "function_call_output" or (it.type == "message" and it.role != "assistant"):
        raise unsupported(f"{where}.prompt_token_ids", "token ids come back on replies only")
    prompt = _need(it.prompt_token_ids, f"{where}.prompt_token_ids")
    generated = _need(it.generation_token_ids, f"{where}.generation_token_ids")
    if (lps := it.generation_log_probs) is not None and len(lps) != len(generated):
        raise GatewayError(400, f"{where}.generation_log_probs: {len(lps)} for {len(generated)} "
                           "ids", "invalid_value", f"{where}.generation_log_probs")
    return ItemIds(-1, tuple(prompt), tuple(generated), where)


def _messages(items: str | list[Item], known: set[str]
              ) -> tuple[list[Message], ItemIds | None]:
    """Input items as messages, and the ids the latest item carrying them sent back (`index`:
    its message's); `known`: call ids a function_call_output may answer (grows)."""
    if isinstance(items, str):
        return [Message("user", items)], None
    out: list[Message] = []
    sent = None
    for i, it in enumerate(items):
        where = f"input.{i}"
        if it.prompt_token_ids is not None or it.generation_token_ids is not None:
            sent = _sent_ids(it, where)
        if it.type == "message":
            role = _need(it.role, f"{where}.role")
            text = _text(_need(it.content, f"{where}.content"), f"{where}.content")
            if role == "assistant":
                _assistant(out, text)
            else:
                out.append(Message("system" if role == "developer" else role, text))
        elif it.type == "function_call":
            call_id = _need(it.call_id, f"{where}.call_id")
            known.add(call_id)
            _assistant(out, calls=(ToolCall(_need(it.name, f"{where}.name"),
                                            it.arguments or "{}", call_id),))
        elif it.type == "function_call_output":
            call_id = _need(it.call_id, f"{where}.call_id")
            if call_id not in known:
                raise GatewayError(400, f"No tool call found for function call output with "
                                   f"call_id {call_id!r}.", "invalid_value", f"{where}.call_id")
            out.append(Message("tool", _text(_need(it.output, f"{where}.output"),
                                             f"{where}.output"), tool_call_id=call_id))
        elif it.type == "reasoning":
            parts = it.content if isinstance(it.content, list) and it.content else it.summary
            _assistant(out, reasoning="\n\n".join(p.text or "" for p in parts or ()))
        else:
            raise unsupported(f"{where}.type", f"input item {it.type!r} is not supported (message, "
                              "function_call, function_call_output, reasoning are)")
        if sent is not None and sent.param == where:
            sent = dataclasses.replace(sent, index=len(out) - 1)
    return out, sent


def _tools(req: ResponsesRequest, notes: dict[str, Any], strict: bool) -> tuple[Tool, ...]:
    """The function tools; the others are left out, named in `notes["left_out"]` (a 400 when
    `strict`)."""
    tools = []
    for i, t in enumerate(req.tools or ()):
        if t.type == "function":
            tools.append(Tool(_need(t.name, f"tools.{i}.name"), t.description, t.parameters))
        elif strict:
            raise strictly(f"tools.{i}.type", f"{t.type!r} tools are left out")
        else:
            notes["left_out"].append(f"{t.type}:{t.name}" if t.name else t.type)
    return tuple(tools)


def _tool_choice(req: ResponsesRequest) -> ToolChoice:
    choice = req.tool_choice
    if not isinstance(choice, dict):
        return choice or "auto"
    if choice.get("type") != "function":
        raise unsupported("tool_choice", f"tool_choice type {choice.get('type')!r} is not "
                          'supported ("none", "auto", "required" or {"type": "function", ...})')
    return ForcedTool(_need(choice.get("name"), "tool_choice.name"))


def to_conversation(req: ResponsesRequest, session: Session, strict: bool = False
                    ) -> Conversation:
    """The internal form of a validated Responses request on `session`. Raises GatewayError 400
    for a refused field (`strict`: see fields.enforce), an unknown previous_response_id or
    call_id, a missing item field."""
    notes = enforce(RESPONSES, req, strict, "responses")
    stored = previous_context(session, req.previous_response_id) if req.previous_response_id \
        else []
    known = {c.id for m in stored for c in m.tool_calls}
    new, sent = _messages(req.input, known)
    msgs = _join(stored, new)
    msgs[:0] = [Message("system", req.instructions)] if req.instructions else []
    if sent is not None:  # counted from the end: _join drops a head of `new` repeating `stored`
        sent = dataclasses.replace(sent, index=len(msgs) - len(new) + sent.index)
    if not msgs:
        raise GatewayError(400, "input: at least one item is needed", "invalid_value", "input")
    sampling = Sampling(req.temperature, req.top_p, req.max_output_tokens)
    tools = _tools(req, notes, strict)
    return Conversation(
        req.model, tuple(msgs), tools, _tool_choice(req), req.parallel_tool_calls is not False,
        sampling, 1, "message.output_text.logprobs" in (req.include or ()),
        req.top_logprobs or 0, {"messages": "input", "max_tokens": "max_output_tokens"},
        noted(notes), template_kwargs(req), sent)


def parse(raw: bytes, session: Session, strict: bool = False
          ) -> tuple[ResponsesRequest, Conversation]:
    """Validate a body and translate it; raises GatewayError 400 (see `parse_body`)."""
    req = parse_body(raw, ResponsesRequest)
    return req, to_conversation(req, session, strict)


# ---- Result -> response ---------------------------------------------------------------------


def _output(rid: str, c: Choice, token_ids: bool = False) -> list[dict[str, Any]]:
    """The output items of a reply: reasoning, message (text, or nothing beside tool calls),
    function calls; ids derived from the response id. `token_ids`: the last one carries the
    token-exact record's ids and logprobs, as NeMo-Gym's vLLM model server does."""
    tag, status = rid[5:], "incomplete" if c.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if (reply := c.reply).reasoning is not None:
        items.append({"id": f"rs_{tag}", "type": "reasoning", "summary": [], "status": status,
                      "content": [{"type": "reasoning_text", "text": reply.reasoning}]})
    if reply.content or not reply.tool_calls:
        part = {"type": "output_text", "text": reply.content, "annotations": [],
                "logprobs": _logprobs(c.logprobs)}
        items.append({"id": f"msg_{tag}", "type": "message", "role": "assistant",
                      "status": status, "content": [part]})
    items += [{"id": f"fc_{tag}_{j}", "type": "function_call", "call_id": call.id,
               "name": call.name, "arguments": call.arguments, "status": status}
              for j, call in enumerate(reply.tool_calls)]
    if token_ids and (rec := c.completion).token_exact:
        items[-1] |= {"prompt_token_ids": rec.prompt_ids, "generation_token_ids":
                      rec.completion_ids, "generation_log_probs": rec.logprobs}
    return items


def response_json(req: ResponsesRequest, rid: str, result: Result | None,
                  started_at: float = 0.0, token_ids: bool = False) -> dict[str, Any]:
    """A `response` object; `result` None: the in-progress shell a stream opens with."""
    c = result.choices[0] if result else None
    incomplete = c is not None and c.finish_reason == "length"
    p, n = (result.prompt_tokens, result.completion_tokens) if result else (0, 0)
    usage = {"input_tokens": p, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + n}
    return {
        "id": rid, "object": "response", "error": None,
        "created_at": result.started_at if result else started_at,
        "status": "in_progress" if c is None else "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": req.model, "output": _output(rid, c, token_ids) if c else [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "store": req.store is not False,
        "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump() for t in req.tools or ()], "text": {"format": {"type": "text"}},
        "truncation": "disabled", "metadata": req.metadata or {},
        "user": req.user, "reasoning": {"effort": None, "summary": None},
        "usage": usage if result else None,
    }


async def stream_events(req: ResponsesRequest, session: Session,
                        events: AsyncIterator[Started | Delta | Result],
                        seq: Iterator[int] | None = None, token_ids: bool = False
                        ) -> AsyncIterator[str]:
    """SSE lines as `Gateway.stream` yields. `Started`: response.created, .in_progress.
    Reasoning deltas: the reasoning item added, a reasoning_text.delta each (.done at the end).
    First text delta: the message item's output_item.added + content_part.added; each text delta: an
    output_text.delta (with its tokens' logprobs when asked). A recognised tool call: its
    function_call item added, arguments delta (whole) and done. `Result`: the id is bound to the
    recorded turn, then per item (text / part done and) output_item.done with the final item,
    then response.completed (or .incomplete) with usage. output_index is the order items opened
    (generation order: a message opened after a call follows it in `output` too); the final
    items equal the plain call's; sequence_number counts from 0 (`seq`, shared with
    `respond_stream`'s error event)."""
    rid, seq, opened = new_id(req), seq or itertools.count(), {}  # opened: id -> output_index
    msg, rs = f"msg_{rid[5:]}", f"rs_{rid[5:]}"

    def event(kind: str, **fields: Any) -> str:
        obj = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def add(item: dict[str, Any]) -> Iterator[str]:
        k = opened[item["id"]] = len(opened)
        empty = {"message": {"content": []}, "function_call": {"arguments": ""},
                 "reasoning": {"content": []}}.get(
            item["type"], {})
        yield event("response.output_item.added", output_index=k,
                    item={**item, **empty, "status": "in_progress"})
        if item["type"] == "message":
            yield event("response.content_part.added", item_id=item["id"], output_index=k,
                        content_index=0, part={"type": "output_text", "text": "",
                                               "annotations": [], "logprobs": []})

    async with contextlib.aclosing(events) as stream:
        async for ev in stream:
            if isinstance(ev, Started):
                shell = response_json(req, rid, None, ev.started_at)
                yield event("response.created", response=shell)
                yield event("response.in_progress", response=shell)
            elif isinstance(ev, Delta) and ev.reasoning:
                if rs not in opened:
                    for line in add({"id": rs, "type": "reasoning", "summary": []}):
                        yield line
                yield event("response.reasoning_text.delta", item_id=rs, output_index=opened[rs],
                            content_index=0, delta=ev.reasoning)
            elif isinstance(ev, Delta) and (call := ev.tool_call) is not None:
                fid = f"fc_{rid[5:]}_{ev.call_index}"
                for line in add({"id": fid, "type": "function_call", "call_id": call.id,
                                 "name": call.name}):
                    yield line
                at = {"item_id": fid, "output_index": opened[fid]}
                yield event("response.function_call_arguments.delta", **at, delta=call.arguments)
                yield event("response.function_call_arguments.done", **at, name=call.name,
                            arguments=call.arguments)
            elif isinstance(ev, Delta) and ev.text:  # ReplyStream sends no empty pieces
                if msg not in opened:
                    for line in add({"id": msg, "type": "message", "role": "assistant"}):
                        yield line
                yield event("response.output_text.delta", item_id=msg, output_index=opened[msg],
                            content_index=0, delta=ev.text, logprobs=_logprobs(ev.logprobs))
            elif isinstance(ev, Result):
                bind(req, session, rid, ev)
                final = response_json(req, rid, ev, token_ids=token_ids)
                for item in final["output"]:
                    if item["id"] not in opened:  # a message with no text at all
                        for line in add(item):
                            yield line
                final["output"].sort(key=lambda it: opened[it["id"]])
                for k, item in enumerate(final["output"]):
                    if item["type"] == "reasoning":
                        yield event("response.reasoning_text.done", item_id=rs, output_index=k,
                                    content_index=0, text=item["content"][0]["text"])
                    if item["type"] == "message":
                        at = {"item_id": item["id"], "output_index": k, "content_index": 0}
                        part = item["content"][0]
                        yield event("response.output_text.done", **at, text=part["text"],
                                    logprobs=part["logprobs"])
                        yield event("response.content_part.done", **at, part=part)
                    yield event("response.output_item.done", output_index=k, item=item)
                yield event(f"response.{final['status']}", response=final)


def _logprobs(lps: Sequence[TokenLogprob] | None) -> list[dict[str, Any]]:
    return [token_json(t) for t in lps or ()]


def respond(req: ResponsesRequest, session: Session, result: Result, token_ids: bool = False
            ) -> JSONResponse:
    """The `response` object answering a plain call `Gateway.complete` recorded on `session`;
    its id names the recorded turn (`store: false`: an id naming nothing)."""
    rid = new_id(req)
    bind(req, session, rid, result)
    return JSONResponse(response_json(req, rid, result, token_ids=token_ids))


def respond_stream(req: ResponsesRequest, session: Session,
                   events: AsyncIterator[Started | Delta | Result], token_ids: bool = False
                   ) -> EventStream:
    """The SSE answer of `stream: true`, event by event as `Gateway.stream` samples (a client
    that leaves aborts the engine streams; nothing is recorded then, as for chat). A failure
    after the stream began is an `error` event (type, code, message, param, sequence_number)
    that also carries the chat-style `error` object, which the openai SDK raises."""
    seq = itertools.count()

    def failed(e: GatewayError) -> str:
        obj = {"type": "error", "sequence_number": next(seq), "code": e.code,
               "message": e.message, "param": e.param,
               "error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
        return f"event: error\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    return EventStream(stream_events(req, session, events, seq, token_ids), failed)
