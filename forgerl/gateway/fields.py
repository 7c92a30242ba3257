"""The request-field policy of every protocol: each field listed once, with what the gateway does.

Data flow: a protocol module validates its wire body (pydantic: types and bounds; unknown
top-level fields are a 400) --> `enforce(TABLE, request)` refuses what the table refuses --> the
protocol translates the rest into a `Conversation` (conversation.py) for the core. One table per
protocol: `CHAT` (POST /v1/chat/completions), `COMPLETIONS` (/v1/completions), `RESPONSES`
(/v1/responses), `MESSAGES` (Anthropic /v1/messages and /count_tokens). A row maps a field
(dotted for a nested one, `*` for every item of a list) to a `Rule`:

    honoured  it changes what is sampled, recorded or answered (a value the row's check
              refuses is a 400 naming the field)
    ignored   accepted without effect
    neutral   only its neutral value is accepted (e.g. a penalty of 0); others are a 400
    refused   any value but null is a 400 naming the field

Some honoured fields are checked by the core, whatever the protocol (the note says so): model
(404 unless served), top_logprobs > 0, empty stop strings, tools and tool_choice
(prepare.py). Content parts and blocks a text policy cannot read are refused where the protocol
translates them (the notes name them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from forgerl.gateway.errors import GatewayError, unsupported

Check = Callable[[str, Any, Any], "GatewayError | None"]
"""(field, its value or None when absent, the whole request) -> the 400 to raise, or None."""


@dataclass(frozen=True)
class Rule:
    """What the gateway does with one request field (module docstring); `check` (None: never
    refused here) runs in table order in `enforce`."""

    does: Literal["honoured", "ignored", "neutral", "refused"]
    note: str
    check: Check | None = None


def honoured(note: str, check: Check | None = None) -> Rule:
    """A field that changes what is sampled, recorded or answered; `check` refuses bad values."""
    return Rule("honoured", note, check)


def ignored(note: str = "accepted without effect") -> Rule:
    """A field accepted and dropped: it changes nothing the gateway samples or records."""
    return Rule("ignored", note)


def refused(why: str) -> Rule:
    """Any value but null is a 400 naming the field, with `why`."""
    return Rule("refused", why, lambda name, v, req: None if v is None else unsupported(name, why))


def neutral(why: str, bad: Callable[[Any], bool]) -> Rule:
    """Values where `bad(value)` is true are a 400 naming the field, with `why`."""
    return Rule("neutral", why, lambda name, v, req: unsupported(name, why) if bad(v) else None)


SAMPLED = "sampled with and recorded; the turn is then context only in training, counted (C21)"
BIAS = "only an empty bias is supported"


def _value(req: Any, name: str) -> Any:
    """The value of a (dotted) field of `req`; None when it or a parent is absent."""
    for part in name.split("."):
        if part == "*" or req is None:
            return None
        req = getattr(req, part, None)
    return req


def enforce(table: Mapping[str, Rule], req: Any) -> None:
    """Raise the first GatewayError 400 the table's checks give for `req`.

    Fields outside the declared schema (pydantic `model_extra`, Responses only) come first, in
    body order: one not in the table is a 400 "Unrecognized request argument supplied"; then
    the declared fields' checks, in table order.
    """
    extras = getattr(req, "model_extra", None) or {}
    for name, value in extras.items():
        rule = None if "." in name else table.get(name)
        if rule is None:
            raise GatewayError(400, f"Unrecognized request argument supplied: {name}",
                               "unknown_parameter", name)
        if rule.check is not None and (error := rule.check(name, value, req)) is not None:
            raise error
    for name, rule in table.items():
        if rule.check is None or name in extras:
            continue
        if (error := rule.check(name, _value(req, name), req)) is not None:
            raise error


# ---- OpenAI Chat Completions ----------------------------------------------------------------


def _text_only(name: str, v: Any, req: Any) -> GatewayError | None:
    """A response format (chat `response_format`, Responses `text.format`) other than "text"."""
    if v is None or v.type == "text":
        return None
    return unsupported(name, f"{v.type!r} needs constrained decoding, which the rollout engine "
                       'lacks; only "text" is supported')


def _chat_top_logprobs(name: str, v: Any, req: Any) -> GatewayError | None:
    return unsupported(name, "needs logprobs: true") if v is not None and not req.logprobs else None


CHAT: dict[str, Rule] = {
    "model": honoured("the served model's name (404 otherwise, unless the gateway is lax)"),
    "messages": honoured("text content, tool calls, tool results; developer is system; "
                         "non-text content parts refused"),
    "messages.*.reasoning_content": honoured("an assistant's reasoning (also `reasoning`)"),
    "messages.*.name": ignored("ChatML has no slot for it"),
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
    "user": ignored(),
    "metadata": ignored(),
    "store": ignored("every call is recorded anyway"),
    "service_tier": ignored(),
    "safety_identifier": ignored(),
    "prompt_cache_key": ignored(),
    "prompt_cache_retention": ignored(),
    "reasoning_effort": refused("the served policy has no reasoning-effort control"),
    "verbosity": refused("the served policy has no verbosity control"),
    "audio": refused("the policy reads and writes text only"),
    "prediction": refused("predicted outputs are not supported"),
    "web_search_options": refused("the gateway has no web search"),
    "functions": refused("deprecated; declare them as `tools`"),
    "function_call": refused("deprecated; use `tool_choice`"),
    "frequency_penalty": honoured(f"in [-2, 2]; not 0: {SAMPLED}"),
    "presence_penalty": honoured(f"in [-2, 2]; not 0: {SAMPLED}"),
    "top_k": honoured(f"vLLM's extra; 0 or -1 = off; > 0: {SAMPLED}"),
    "min_p": honoured(f"vLLM's extra; in [0, 1]; > 0: {SAMPLED}"),
    "repetition_penalty": honoured(f"vLLM's extra; > 0; not 1: {SAMPLED}"),
    "logit_bias": neutral(BIAS, bool),
    "modalities": neutral('only ["text"] is supported', lambda v: v not in (None, ["text"])),
    "response_format": honoured('"text"; json_object / json_schema refused (no constrained '
                                "decoding)", _text_only),
    "top_logprobs": honoured("0 only (the core refuses more); needs logprobs",
                             _chat_top_logprobs),
}


# ---- OpenAI (legacy) Completions ------------------------------------------------------------


def _best_of(name: str, v: Any, req: Any) -> GatewayError | None:
    if v in (None, req.n or 1):
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
    "user": ignored(),
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


def _reasoning(name: str, v: Any, req: Any) -> GatewayError | None:
    if v and any(x is not None for x in v.values()):
        return unsupported(name, "the served policy has no reasoning controls")
    return None


RESPONSES: dict[str, Rule] = {
    "model": honoured("the served model's name (404 otherwise, unless the gateway is lax)"),
    "input": honoured("a string or items: message (text parts), function_call, "
                      "function_call_output, reasoning; other items and parts refused"),
    "instructions": honoured("a leading system message (dropped when continued)"),
    "tools": honoured("flat function tools (`strict` not enforced); hosted tools refused"),
    "tool_choice": honoured("none / auto / required / a named function; other types refused"),
    "parallel_tool_calls": honoured("false: the reply ends after its first call"),
    "max_output_tokens": honoured("capped by the session and the gateway, clamped to the "
                                  "context"),
    "temperature": honoured("unless the session sets one"),
    "top_p": honoured(f"< 1: {SAMPLED}"),
    "top_logprobs": honoured("0 only (the core refuses more)"),
    "include": honoured('"message.output_text.logprobs"; other values accepted without effect'),
    "previous_response_id": honoured("that turn's messages and reply go ahead of input"),
    "store": honoured("false answers an id nothing can continue (the call is recorded anyway)"),
    "stream": honoured("the OpenAI SSE events as the engine samples"),
    "text": honoured("format and verbosity, below"),
    "metadata": ignored(),
    "user": ignored(),
    "safety_identifier": ignored(),
    "prompt_cache_key": ignored(),
    "prompt_cache_retention": ignored(),
    "prompt_cache_options": ignored(),
    "service_tier": ignored(),
    "stream_options": ignored(),
    "conversation": refused("the Conversations API is not served; chain calls with "
                            "previous_response_id"),
    "prompt": refused("stored prompt templates are not served"),
    "max_tool_calls": refused("not supported (parallel_tool_calls: false limits a reply to one "
                              "call)"),
    "context_management": refused("the gateway never compacts a context (token-in-token-out)"),
    "moderation": refused("the gateway has no moderation"),
    "access_programs": refused("not supported"),
    "image": refused("the policy reads text only"),
    "background_options": refused("background responses are not supported"),
    "reasoning": honoured("no setting (all null) only", _reasoning),
    "text.format": honoured('"text" only; json_* need constrained decoding', _text_only),
    "text.verbosity": refused("the served policy has no verbosity control"),
    "truncation": neutral('"auto" would drop context items; only "disabled"',
                          lambda v: v == "auto"),
    "background": neutral("background responses are not supported", bool),
}


# ---- Anthropic Messages (and count_tokens, whose body lacks the sampling fields) -------------


def _thinking(name: str, v: Any, req: Any) -> GatewayError | None:
    if v is None or v.type in ("disabled", "adaptive"):
        return None
    return unsupported("thinking.type", f"{v.type!r}: the served policy has no thinking budget "
                       'control (use "disabled" or "adaptive")')


def _output_config(name: str, v: Any, req: Any) -> GatewayError | None:
    for key, value in (v or {}).items():
        if value is not None:
            return unsupported(f"{name}.{key}", "structured output needs constrained decoding, "
                               "which the rollout engine lacks" if key == "format" else
                               "the served policy has no such control")
    return None


MESSAGES: dict[str, Rule] = {
    "model": honoured("the served model's name (404 otherwise, unless the gateway is lax)"),
    "messages": honoured("text (blocks in a row joined by newline; an assistant's split by "
                         "tool_use blocks by nothing), tool_use, tool_result (is_error renders "
                         '"Error: {content}"), thinking (signature kept, unchecked); other '
                         "blocks and a final assistant message (prefill) refused"),
    "system": honoured("a string or text blocks, joined by newline"),
    "tools": honoured("custom tools with input_schema; server tools refused"),
    "tool_choice": honoured("auto / any / tool (both prefill a tool call) / none, "
                            "disable_parallel_tool_use"),
    "max_tokens": honoured("capped by the session and the gateway, clamped to the context"),
    "stop_sequences": honoured('stop_reason "stop_sequence" with the matched string'),
    "temperature": honoured("unless the session sets one"),
    "top_p": honoured(f"< 1: {SAMPLED}"),
    "stream": honoured("the Messages SSE events as the engine samples"),
    "metadata": ignored(),
    "service_tier": ignored(),
    "speed": ignored(),
    "inference_geo": ignored(),
    "user_profile_id": ignored(),
    "workspace_id": ignored(),
    "cache_control": ignored("also on blocks; so are citations and the anthropic-version / "
                             "-beta headers"),
    "mcp_servers": refused("the gateway connects to no MCP servers; declare the tools instead"),
    "context_management": refused("the gateway does not edit the context (it would break "
                                  "token reuse)"),
    "container": refused("the gateway runs no containers"),
    "diagnostics": refused("the gateway reports no prompt-cache diagnostics"),
    "top_k": honoured(f"0 = off; > 0: {SAMPLED}"),
    "thinking": honoured('"disabled" / "adaptive"; other types refused', _thinking),
    "output_config": Rule("refused", "format (no constrained decoding), effort (no such "
                          "control): any key set is refused", _output_config),
}
