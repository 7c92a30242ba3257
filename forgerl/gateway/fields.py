"""The request policy of every protocol, for real traffic: each field once, with what is done.

Data flow: a protocol module validates its wire body (pydantic: types and bounds of the fields it
reads; other top-level fields land in `model_extra`) --> `enforce(TABLE, request, strict)` refuses
what the table refuses and returns the turn's notes --> the protocol translates the rest into a
`Conversation` (conversation.py), whose `request` notes become the recorded
`Completion.request`. One table per protocol: `CHAT` (POST /v1/chat/completions), `COMPLETIONS`
(/v1/completions), `RESPONSES` (/v1/responses), `MESSAGES` (Anthropic /v1/messages and
/count_tokens). A row maps a field (dotted for a nested one) to a `Rule`:

    honoured      it changes what is sampled, rendered or answered (a value the row's check
                  refuses is a 400 naming the field)
    kept          it touches no token: accepted and kept with the turn (`request["kept"]`)
    approximated  the policy has no such control: the closest exact behaviour is applied (the
                  reply is sampled as usual) and noted per turn (`request["approximated"]`,
                  the `x-forgerl-approximated` response header)
    left_out      a server-side tool the policy cannot call: not rendered, noted in `left_out`
    neutral       only its neutral value is accepted (e.g. a penalty of 0); others are a 400
    refused       any value but null is a 400 naming the field: no exact behaviour exists and
                  ignoring it would change what the client relies on

A top-level field in no table is kept too (real clients send fields and documented betas a
client cannot turn off). `[gateway] strict = true` refuses it instead ("Unrecognized request
argument supplied", as OpenAI answers), and every approximated or left-out field and tool.
Some honoured fields are checked by the core, whatever the protocol (the notes say so): model
(404 unless served), top_logprobs > 0, empty
stop strings, tools and tool_choice (prepare.py). docs/gateway-policy.md lists every refusal.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from forgerl.config import TEMPLATE_ARGS
from forgerl.gateway import telemetry
from forgerl.gateway.errors import GatewayError, unsupported

Check = Callable[[str, Any, Any], "GatewayError | None"]
"""(field, its value (never None), the whole request) -> the 400 to raise, or None."""


@dataclass(frozen=True)
class Rule:
    """What the gateway does with one request field (module docstring). `check` (None: never
    refused here) runs in table order in `enforce`; `active` says whether a present value of
    an approximated or left-out field asks for what the policy cannot do."""

    does: Literal["honoured", "kept", "approximated", "left_out", "neutral", "refused"]
    note: str
    check: Check | None = None
    active: Callable[[Any], bool] = bool


def honoured(note: str, check: Check | None = None) -> Rule:
    """A field that changes what is sampled, rendered or answered; `check` refuses bad values."""
    return Rule("honoured", note, check)


def kept(*names: str, note: str = "touches no token: kept with the turn") -> dict[str, Rule]:
    """Rows of fields accepted and kept with the turn (`request["kept"]`)."""
    return {name: Rule("kept", note) for name in names}


def approximated(what: str, active: Callable[[Any], bool] = bool) -> Rule:
    """A control the policy lacks: `what` is done instead when `active(value)`."""
    return Rule("approximated", what, active=active)


def left_out(what: str) -> Rule:
    """A server-side tool or tool option the gateway cannot run: not rendered, counted."""
    return Rule("left_out", what, active=lambda v: True)


def refused(why: str) -> Rule:
    """Any value but null is a 400 naming the field, with `why`."""
    return Rule("refused", why, lambda name, v, req: unsupported(name, why))


def neutral(why: str, bad: Callable[[Any], bool]) -> Rule:
    """Values where `bad(value)` is true are a 400 naming the field, with `why`."""
    return Rule("neutral", why, lambda name, v, req: unsupported(name, why) if bad(v) else None)


SAMPLED = "sampled with and recorded; the turn is then context only in training, counted (C21)"
BIAS = "only an empty bias is supported"
AS_USUAL = "no such control: sampled as usual"
NO_REASONING = "the served policy has no reasoning control: sampled as usual, no summary"


def _template_kwargs(name: str, v: Any, req: Any) -> GatewayError | None:
    if not isinstance(v, dict):
        return unsupported(name, "must be an object of chat template variables")
    if taken := sorted(TEMPLATE_ARGS & v.keys()):
        return unsupported(name, f"{taken[0]!r} is set by the gateway, not a template variable")
    return None


def template_kwargs(req: Any) -> MappingProxyType[str, Any]:
    """A request's `chat_template_kwargs` (vLLM's and SGLang's extra) as checked by its row."""
    value = getattr(req, "chat_template_kwargs", None)
    return MappingProxyType(dict(value) if isinstance(value, dict) else {})


TEMPLATE_KWARGS = honoured(
    "vLLM's extra: variables for the model's chat template (Qwen3's enable_thinking), over "
    "[gateway] chat_template_kwargs, recorded in `template_kwargs`; arguments the gateway sets "
    "(tools, add_generation_prompt ...) refused; the ChatML renderer has none: no effect",
    _template_kwargs)


def _value(req: Any, name: str) -> Any:
    """The value of a (dotted) field of `req`; None when it or a parent is absent."""
    for part in name.split("."):
        req = req.get(part) if isinstance(req, dict) else getattr(req, part, None)
        if req is None:
            return None
    return req


def small(value: Any) -> Any:
    """A JSON value as kept with a turn: itself when its JSON has at most 300 characters, else
    a marker saying how long it was."""
    value = value.model_dump() if hasattr(value, "model_dump") else value
    text = json.dumps(value, default=str, ensure_ascii=False)
    return value if len(text) <= 300 else f"<{len(text)} characters of JSON>"


def strictly(name: str, what: str) -> GatewayError:
    """The 400 `[gateway] strict` answers for a field or tool the policy would approximate or
    leave out."""
    return unsupported(name, f"not honoured exactly ({what}); refused under [gateway] strict")


def enforce(table: Mapping[str, Rule], req: Any, strict: bool, protocol: str) -> dict[str, Any]:
    """Raise the first GatewayError 400 the table gives for `req`; else its notes.

    Fields outside the declared schema (pydantic `model_extra`) come first, in body order: one
    in no table is kept (a 400 "Unrecognized request argument supplied" when `strict`). Then
    every present field in table order: its check; kept ones into `kept`, active approximated
    ones into `approximated` and left-out ones into `left_out` (400s when `strict`). Returns
    {"protocol", "kept", "approximated", "left_out"} for `Completion.request` (protocols add
    tools left out and context edits applied) and notes them (telemetry: `ignored` = kept).
    """
    notes: dict[str, Any] = {"protocol": protocol, "kept": {}, "approximated": {},
                             "left_out": []}
    extras = getattr(req, "model_extra", None) or {}
    for name, value in extras.items():
        if name not in table:
            if strict:
                raise GatewayError(400, f"Unrecognized request argument supplied: {name}",
                                   "unknown_parameter", name)
            notes["kept"][name] = small(value)
    for name, rule in table.items():
        value = _value(req, name)
        if value is None:
            continue
        if rule.check is not None and (error := rule.check(name, value, req)) is not None:
            raise error
        if rule.does == "kept":
            notes["kept"][name] = small(value)
        elif rule.does in ("approximated", "left_out") and rule.active(value):
            if strict:
                raise strictly(name, rule.note)
            if rule.does == "left_out":
                notes["left_out"].append(name)
            else:
                notes["approximated"][name] = rule.note
    return notes


def noted(notes: dict[str, Any]) -> dict[str, Any]:
    """`notes` without empty entries, also noted on the request's log entry (telemetry)."""
    notes = {k: v for k, v in notes.items() if v}
    telemetry.note(ignored=list(notes.get("kept", ())), **{
        k: notes[k] for k in ("protocol", "approximated", "left_out") if k in notes})
    return notes


# ---- OpenAI Chat Completions ----------------------------------------------------------------


def _text_only(name: str, v: Any, req: Any) -> GatewayError | None:
    """A response format (chat `response_format`, Responses `text.format`) other than "text"."""
    if v.type == "text":
        return None
    return unsupported(name, f"{v.type!r} needs constrained decoding, which the rollout engine "
                       'lacks; only "text" is supported')


def _chat_top_logprobs(name: str, v: Any, req: Any) -> GatewayError | None:
    return None if req.logprobs else unsupported(name, "needs logprobs: true")


def _reasoning_set(v: Any) -> bool:
    """A reasoning control set to something other than "none" (a model without reasoning
    does exactly that)."""
    values = v.values() if isinstance(v, dict) else [v]
    return any(x not in (None, "none") for x in values)


CHAT: dict[str, Rule] = {
    "model": honoured("the served model's name (404 otherwise, unless the gateway is lax)"),
    "messages": honoured("text content, tool calls, tool results; developer is system, and a "
                         "system message anywhere renders (templates.fit_system); non-text "
                         "content parts refused; `reasoning_content` (or `reasoning`) is an "
                         "assistant's reasoning; `name` has no slot in the rendering"),
    "tools": honoured("rendered; `strict` accepted, adherence not enforced (a call that does "
                      "not parse stays text)"),
    "tool_choice": honoured('"none": tools neither rendered nor parsed; "auto"; "required" and '
                            "a named function prefill the opening of a tool call (a call that "
                            "does not parse comes back as text, in `tool_parse_errors`)"),
    "parallel_tool_calls": honoured("false: the reply ends after its first call"),
    "temperature": honoured("unless the session sets one"),
    "top_p": honoured(f"< 1: {SAMPLED}"),
    "max_tokens": honoured("capped by the session and the gateway, clamped to the context"),
    "max_completion_tokens": honoured("as max_tokens; wins over it"),
    "stop": honoured("the text ends before the first one; the ids up to it are recorded"),
    "seed": honoured("choice i samples with seed + i"),
    "n": honoured("each choice its own recorded completion"),
    "logprobs": honoured("the recorded behaviour logprobs"),
    "stream": honoured("chat.completion.chunk SSE events as the engine samples"),
    "stream_options": honoured("include_usage; include_obfuscation accepted without effect"),
    **kept("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
           "prompt_cache_retention", "prediction"),
    "reasoning_effort": approximated(NO_REASONING, _reasoning_set),
    "verbosity": approximated(AS_USUAL),
    "web_search_options": left_out("the gateway runs no web search: sampled without it"),
    "audio": refused("the policy writes text only (the client would wait for audio)"),
    "functions": refused("deprecated; the reply would need the `function_call` shape; declare "
                         "them as `tools`"),
    "function_call": refused("deprecated; use `tool_choice`"),
    "frequency_penalty": honoured(f"in [-2, 2]; not 0: {SAMPLED}"),
    "presence_penalty": honoured(f"in [-2, 2]; not 0: {SAMPLED}"),
    "top_k": honoured(f"vLLM's extra; 0 or -1 = off; > 0: {SAMPLED}"),
    "min_p": honoured(f"vLLM's extra; in [0, 1]; > 0: {SAMPLED}"),
    "repetition_penalty": honoured(f"vLLM's extra; > 0; not 1: {SAMPLED}"),
    "logit_bias": neutral(BIAS, bool),
    "modalities": neutral('only ["text"] is supported', lambda v: v != ["text"]),
    "response_format": honoured('"text"; json_object / json_schema refused (no constrained '
                                "decoding)", _text_only),
    "top_logprobs": honoured("0 only (the core refuses more); needs logprobs",
                             _chat_top_logprobs),
    "chat_template_kwargs": TEMPLATE_KWARGS,
}


# ---- OpenAI (legacy) Completions ------------------------------------------------------------


def _best_of(name: str, v: Any, req: Any) -> GatewayError | None:
    if v == (req.n or 1):
        return None
    return unsupported(name, f"best_of ({v}) must equal n ({req.n or 1}): the gateway returns "
                       "every sampled choice, it does not rank them")


def _echo(name: str, v: Any, req: Any) -> GatewayError | None:
    if not v or req.logprobs is None:
        return None
    return unsupported(name, "echo with logprobs needs the prompt's logprobs, which the rollout "
                       "engine does not compute")


COMPLETIONS: dict[str, Rule] = {
    "model": honoured("the served model's name (404 otherwise, unless the gateway is lax)"),
    "prompt": honoured("a string or a list of token ids (a batch of one of either), recorded "
                       "as given; several prompts, an empty prompt, ids outside the vocabulary "
                       "and prompts of max_model_len tokens or more refused"),
    "max_tokens": honoured("the session's, else the request's, else the gateway's default, "
                           "clamped to the context (the official default is 16)"),
    "temperature": honoured("unless the session sets one"),
    "top_p": honoured(f"< 1: {SAMPLED}"),
    "stop": honoured("the text ends before the first one; the ids up to it are recorded"),
    "seed": honoured("choice i samples with seed + i"),
    "n": honoured("each choice its own recorded completion and branch"),
    "logprobs": honoured("0: the recorded logprob of every kept sampled id (the core refuses "
                         "more: the engines return only the sampled token's logprob)"),
    "stream": honoured("SSE chunks of text as the engine samples"),
    "stream_options": honoured("include_usage"),
    "return_token_ids": honoured("vLLM's: each choice carries prompt_token_ids and token_ids"),
    **kept("user"),
    "suffix": refused("insertion (fill-in-the-middle) is not supported"),
    "frequency_penalty": honoured(f"in [-2, 2]; not 0: {SAMPLED}"),
    "presence_penalty": honoured(f"in [-2, 2]; not 0: {SAMPLED}"),
    "top_k": honoured(f"vLLM's extra; 0 or -1 = off; > 0: {SAMPLED}"),
    "min_p": honoured(f"vLLM's extra; in [0, 1]; > 0: {SAMPLED}"),
    "repetition_penalty": honoured(f"vLLM's extra; > 0; not 1: {SAMPLED}"),
    "logit_bias": neutral(BIAS, bool),
    "best_of": honoured("equal to n only", _best_of),
    "echo": honoured("the prompt text before the completion; not with logprobs", _echo),
}


# ---- OpenAI Responses -----------------------------------------------------------------------


RESPONSES: dict[str, Rule] = {
    "model": honoured("the served model's name (404 otherwise, unless the gateway is lax)"),
    "input": honoured("a string or items: message (text parts; a developer or system message "
                      "anywhere renders, templates.fit_system), function_call, "
                      "function_call_output, reasoning; other items and parts refused"),
    "instructions": honoured("a leading system message (dropped when continued)"),
    "tools": honoured("function tools (`strict` not enforced); other types (web_search, "
                      "namespace, mcp, custom, ...) left out and counted"),
    "tool_choice": honoured("none / auto / required / a named function; other types refused"),
    "parallel_tool_calls": honoured("false: the reply ends after its first call"),
    "max_output_tokens": honoured("capped by the session and the gateway, clamped to the "
                                  "context"),
    "temperature": honoured("unless the session sets one"),
    "top_p": honoured(f"< 1: {SAMPLED}"),
    "top_logprobs": honoured("0 only (the core refuses more)"),
    "previous_response_id": honoured("that turn's messages and reply go ahead of input"),
    "stream": honoured("the OpenAI SSE events as the engine samples"),
    "text.format": honoured('"text" only; json_* need constrained decoding', _text_only),
    **kept("include", note='"message.output_text.logprobs" returns the logprobs; kept'),
    **kept("store", note="false answers an id nothing can continue (the call is recorded "
                         "anyway); kept"),
    **kept("metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
           "prompt_cache_options", "service_tier", "stream_options", "client_metadata",
           "max_tool_calls"),
    "reasoning": approximated(NO_REASONING, _reasoning_set),
    "text.verbosity": approximated(AS_USUAL),
    "truncation": approximated('as "disabled": an input over the context is a '
                               "context_length_exceeded error", lambda v: v == "auto"),
    "context_management": approximated("never compacted: the input is rendered whole (an "
                                       "overflow is a context_length_exceeded error)"),
    "conversation": refused("the Conversations API is not served; chain calls with "
                            "previous_response_id"),
    "prompt": refused("stored prompt templates are not served"),
    "background": neutral("background responses are not supported", bool),
    "chat_template_kwargs": TEMPLATE_KWARGS,
}


# ---- Anthropic Messages (and count_tokens, whose body lacks the sampling fields) -------------


MESSAGES: dict[str, Rule] = {
    "model": honoured("the served model's name (404 otherwise, unless the gateway is lax)"),
    "messages": honoured("text (blocks in a row joined by newline; an assistant's split by "
                         "tool_use blocks by nothing), tool_use, tool_result (is_error renders "
                         '"Error: {content}"), thinking (signature kept, unchecked), '
                         "redacted_thinking (unreadable: dropped), a system message anywhere "
                         "(templates.fit_system); other blocks and a final assistant message "
                         "(prefill) refused"),
    "system": honoured("a string or text blocks, joined by newline"),
    "tools": honoured("custom tools with input_schema; server tools (another `type`) left out "
                      "and counted"),
    "tool_choice": honoured("auto / any / tool (both prefill a tool call) / none, "
                            "disable_parallel_tool_use"),
    "max_tokens": honoured("capped by the session and the gateway, clamped to the context"),
    "stop_sequences": honoured('stop_reason "stop_sequence" with the matched string'),
    "temperature": honoured("unless the session sets one"),
    "top_p": honoured(f"< 1: {SAMPLED}"),
    "stream": honoured("the Messages SSE events as the engine samples"),
    "context_management": honoured("its edits are applied to the messages before rendering "
                                   "(edits.py); a changed context is a new branch"),
    "thinking": approximated("no thinking budget control: sampled as usual",
                             lambda v: v.type not in ("disabled", "adaptive")),
    "output_config.effort": approximated(AS_USUAL),
    "output_config.format": refused("structured output needs constrained decoding, which the "
                                    "rollout engine lacks"),
    **kept("metadata", "service_tier", "speed", "inference_geo", "user_profile_id",
           "workspace_id", "container", "diagnostics", "mcp_servers",
           note="touches no token (also cache_control and citations on blocks, and the "
                "anthropic-version / -beta headers): kept with the turn"),
    **kept("cache_control"),
    "top_k": honoured(f"0 = off; > 0: {SAMPLED}"),
    "chat_template_kwargs": TEMPLATE_KWARGS,
}
