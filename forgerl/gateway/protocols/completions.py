"""OpenAI (legacy) Completions over the gateway core: a raw prompt in, `text_completion` out.

Data flow: POST /v1/completions body --`parse`--> `CompletionCall` (the validated request, a
`Conversation` without messages and the `PromptPlan` of the prompt ids) --> `Gateway.complete`
with that plan (core.py: nothing is rendered; it dispatches, cuts at stop strings, records) -->
`respond`: a `text_completion` object; with `stream: true`, `Gateway.stream` -->
`respond_stream`: SSE chunks of text as the engine samples it, each choice's logprobs and
token ids with its finish chunk.

This is the token-native protocol. The prompt is recorded exactly as given: a list of token ids
is sent to the engine as it is (control tokens included: the client renders its own template),
and a text prompt is the tokenizer's encoding of the text with special-token strings split into
ordinary ids, as the renderer encodes message content (`Renderer.encode`; no BOS added).
A prompt whose ids start with a recorded call's prompt + completion ids (a chat call's too)
extends that call (`extends_previous`; the longest such call is its parent), so a multi-turn
agent that appends the returned `token_ids` and its new ids trains as one trajectory; any other
prompt starts a new branch, counted in `prefix_misses`. A text prompt is encoded from scratch:
re-encoding sampled text may give other ids (CASES.md C01), so a text client extends only when
the encoding happens to reproduce them; token-native clients send ids.

What the gateway does with each request field (honoured, kept, neutral values only, refused
with a 400 naming it) is `fields.COMPLETIONS`; a field in no row is kept (a 400 under `[gateway]
strict`). Several prompts in one request, an empty prompt, ids outside the vocabulary and
prompts of max_model_len tokens or more are refused here (`prompt_ids`).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from forgerl.gateway.conversation import Conversation, Sampling
from forgerl.gateway.dispatch import Delta, Started
from forgerl.gateway.errors import GatewayError, parse_body, unsupported
from forgerl.gateway.fields import COMPLETIONS, enforce, noted
from forgerl.gateway.prepare import refuse_surely_too_long
from forgerl.gateway.protocols.chat import OPENED, error_event, usage_json
from forgerl.gateway.record import Choice, Result
from forgerl.gateway.renderers.renderer import Renderer, token_text
from forgerl.gateway.sessions import PromptPlan, Session
from forgerl.gateway.sse import EventStream

Prompt = str | list[int] | list[str] | list[list[int]]


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a final usage chunk."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """POST /v1/completions body; `fields.COMPLETIONS` says what the gateway does with each."""

    model_config = ConfigDict(extra="allow")

    model: str
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int | None = Field(None, ge=1, le=128)
    best_of: int | None = Field(None, ge=1, le=128)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extras: top_k, min_p, repetition_penalty
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_error(cls, value: Any, handler: Any) -> Any:
        # pydantic reports a failed union once per member ("prompt.str", ...): name `prompt`.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string, a list of token ids, or a list of one of "
                             "those") from None


@dataclass(frozen=True)
class CompletionCall:
    """A parsed request: the wire body, its `Conversation` (no messages; sampling, n, logprobs)
    and the plan of its prompt ids (which recorded call it extends)."""

    request: CompletionRequest
    conversation: Conversation
    plan: PromptPlan


# ---- request -> prompt ids, plan, Conversation ----------------------------------------------


def _bad_prompt(message: str) -> GatewayError:
    return GatewayError(400, f"prompt: {message}", "invalid_prompt", "prompt")


def prompt_ids(prompt: Prompt, renderer: Renderer, max_model_len: int) -> list[int]:
    """The ids of a prompt: token ids as given, text encoded with special tokens split.

    Raises GatewayError 400 naming `prompt` for several prompts, an empty prompt, an id
    outside the tokenizer's vocabulary [0, len(tokenizer)), or `context_length_exceeded` for a
    text that must exceed `max_model_len` tokens (`prepare.refuse_surely_too_long`).
    """
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) > 1:
            raise unsupported("prompt", f"{len(prompt)} prompts in one request; send one "
                              "prompt per request (each is its own recorded completion)")
        prompt = prompt[0]
    if isinstance(prompt, str):
        refuse_surely_too_long(renderer, [prompt], max_model_len, "prompt")
    ids = renderer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise _bad_prompt("the prompt is empty")
    vocab = len(renderer.tokenizer)
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise _bad_prompt(f"token id {bad} is outside the vocabulary [0, {vocab})")
    return ids


def plan(session: Session, ids: list[int]) -> PromptPlan:
    """The prompt `ids` as they are, and the recorded turn whose prompt + completion ids they
    start with (the longest; the most recent of equals), if any. Cost: O(turns x prompt)."""
    parent, longest = None, -1
    for index, turn in enumerate(session.turns):
        p, end = len(turn.prompt_ids), len(turn.prompt_ids) + len(turn.completion_ids)
        if (longest <= end <= len(ids) and ids[:p] == turn.prompt_ids
                and ids[p:end] == turn.completion_ids):
            parent, longest = index, end
    return PromptPlan(list(ids), parent, parent is not None)


def parse(raw: bytes, session: Session, renderer: Renderer, max_len: int,
          strict: bool = False) -> CompletionCall:
    """Validate a body, build its prompt ids and plan; raises GatewayError 400 (module
    docstring; `max_len`: the engine's max_model_len, see `prompt_ids`; `strict`: see
    fields.enforce). The core raises the rest: model, logprobs > 0, context length."""
    req = parse_body(raw, CompletionRequest)
    notes = enforce(COMPLETIONS, req, strict, "completions")
    ids = prompt_ids(req.prompt, renderer, max_len)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    conv = Conversation(
        model=req.model,
        messages=(),
        sampling=Sampling(req.temperature, req.top_p, req.max_tokens, stop, req.seed, req.top_k,
                          req.min_p, req.repetition_penalty, req.presence_penalty,
                          req.frequency_penalty),
        n=req.n or 1,
        top_logprobs=req.logprobs or 0,
        param_names={"messages": "prompt", "top_logprobs": "logprobs"}, request=noted(notes))
    return CompletionCall(req, conv, plan(session, ids))


# ---- Result -> response ---------------------------------------------------------------------


def token_logprobs(renderer: Renderer, c: Choice) -> dict[str, Any]:
    """`logprobs` of a choice: every kept sampled id (end-of-turn included) with its recorded
    logprob, its text (`renderer.token_text` of its own bytes; a special token spelled out) and
    its character offset in the decoded completion (which may run past `text` when a stop
    string cut it).

    A token decoded alone is exact for byte-level vocabularies; where it is not (a UTF-8
    character split over tokens, SentencePiece word starts) its end comes from decoding the
    prefix, so a split character's tokens share its offset.
    """
    ids, lps = c.completion.completion_ids, c.completion.logprobs
    full = renderer.decode(ids)
    tokens, offsets, pos = [], [], 0
    for k, i in enumerate(ids):
        tokens.append(token_text(renderer.token_bytes(i)))
        offsets.append(pos)
        alone = renderer.decode([i])
        if full.startswith(alone, pos):
            pos += len(alone)
        else:
            pos = len(renderer.decode(ids[: k + 1]).rstrip("\ufffd"))
    return {"tokens": tokens, "token_logprobs": list(lps), "text_offset": offsets,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps, strict=True)]}


def _echo(call: CompletionCall, renderer: Renderer) -> str:
    """The prompt text put before the completion with `echo`, else ""."""
    prompt = call.request.prompt
    if not call.request.echo:
        return ""
    return prompt if isinstance(prompt, str) else renderer.decode(call.plan.prompt_ids)


def _choices(call: CompletionCall, result: Result, renderer: Renderer, head: str) -> list[dict]:
    """The `choices` of `result`, each text after `head` (`_echo`)."""
    req, out = call.request, []
    for c in result.choices:
        choice: dict[str, Any] = {
            "text": head + c.reply.content, "index": c.index, "finish_reason": c.finish_reason,
            "logprobs": None if req.logprobs is None else token_logprobs(renderer, c)}
        if req.return_token_ids:
            choice |= {"prompt_token_ids": c.completion.prompt_ids,
                       "token_ids": c.completion.completion_ids}
        out.append(choice)
    return out


async def completion_chunks(call: CompletionCall, cid: str,
                            events: AsyncIterator[Started | Delta | Result],
                            renderer: Renderer) -> AsyncIterator[str]:
    """SSE lines of a `text_completion` stream from `Gateway.stream` events: `chat.OPENED` at
    `Started`, each text delta as the engine samples it (the echoed prompt before a choice's
    first), then per choice a finish chunk carrying that choice's logprobs and token ids when
    asked (all of them: the legacy `text_offset`s are known once the text is); then usage when
    asked; then `[DONE]`."""
    req, created, opened, head = call.request, 0, set(), _echo(call, renderer)

    def chunk(choice: dict[str, Any] | None, **extra: Any) -> str:
        obj = {"id": cid, "object": "text_completion", "created": created, "model": req.model,
               "choices": [] if choice is None else [choice], **extra}
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async with contextlib.aclosing(events) as stream:
        async for ev in stream:
            if isinstance(ev, Started):
                created = int(ev.started_at)
                yield OPENED
            elif isinstance(ev, Delta) and (ev.text or (req.echo and ev.index not in opened)):
                text = ev.text if ev.index in opened else head + ev.text
                opened.add(ev.index)
                yield chunk({"text": text, "index": ev.index, "logprobs": None,
                             "finish_reason": None})
            elif isinstance(ev, Result):
                for c in _choices(call, ev, renderer, head):
                    yield chunk(c | {"text": "" if c["index"] in opened else c["text"]})
                if req.stream_options and req.stream_options.include_usage:
                    yield chunk(None, usage=usage_json(ev))
    yield "data: [DONE]\n\n"


def respond(call: CompletionCall, result: Result, renderer: Renderer) -> JSONResponse:
    """The HTTP answer of a call without `stream`: a `text_completion` object."""
    return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                         "created": int(result.started_at), "model": call.request.model,
                         "choices": _choices(call, result, renderer, _echo(call, renderer)),
                         "usage": usage_json(result)})


def respond_stream(call: CompletionCall, events: AsyncIterator[Started | Delta | Result],
                   renderer: Renderer) -> EventStream:
    """The SSE answer of a `stream: true` call, sent as the engine samples (sse.EventStream:
    a client that disconnects aborts the call and nothing of it is recorded)."""
    return EventStream(completion_chunks(call, f"cmpl-{uuid.uuid4().hex}", events, renderer),
                       error_event)
