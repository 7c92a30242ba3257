"""Prepare one model call: validate the conversation, render it (TITO), parametrise the choices.

Data flow: `Gateway.prepare` (core.py) --> `check_conversation` (the checks that need no
rendering: model name, refused values, a request surely over the context, tools, tool_choice)
--> the session's `PromptPlan` (sessions.py: recorded ids reused) --> `build_call`: the prefill
of a forced tool call, one `SamplingParams` per choice clamped to the context --> a `Call` that
dispatch.py sends to the engine and record.py records. Nothing here dispatches or records;
every refusal is a `GatewayError` raised before the engine sees the call.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from forgerl.engines.base import RolloutEngine
from forgerl.gateway.conversation import Conversation, ForcedTool, Tool
from forgerl.gateway.errors import GatewayError, context_exceeded, unsupported
from forgerl.gateway.renderers.renderer import Renderer
from forgerl.gateway.sessions import PromptPlan, Session
from forgerl.types import SamplingParams


@dataclass(frozen=True)
class Call:
    """One prepared model call (`Gateway.prepare`): what dispatch, cut, parse and record need.

    prefix: prefilled reply text (its ids end prompt_ids). params: one per choice. closes: the
    strings that end a choice and stay in its text. declared: the rendered tools, name ->
    parameters schema (None: no tool parsing). weight_version: the engine's version at dispatch.
    """

    conv: Conversation
    tools: tuple[Tool, ...]
    plan: PromptPlan
    prefix: str
    prompt_ids: list[int]
    params: list[SamplingParams]
    closes: tuple[str, ...]
    declared: dict[str, Any] | None
    started_at: float
    weight_version: int


def tool_problem(tool: Tool, repeated: Collection[str], field: str = "parameters") -> str | None:
    """Why a declared tool cannot be rendered, or None: an empty name, a name in `repeated`
    (declared more than once), or parameters that are not a valid JSON Schema
    (`schema_problem`; the message names them `field`, as the protocol does)."""
    if not tool.name:
        return "a tool needs a non-empty name"
    if tool.name in repeated:
        return "declared more than once"
    params = tool.parameters
    problem = None if params is None else schema_problem(json.dumps(params, sort_keys=True))
    return problem and f"{field} {problem}"


@functools.lru_cache(maxsize=4096)
def schema_problem(schema_json: str) -> str | None:
    """Why a JSON Schema (as JSON text) fails its metaschema (`jsonschema`, draft 2020-12 unless
    it names its own `$schema`), or None. Cached: an agent declares the same tools every turn."""
    from jsonschema import SchemaError  # lazy: heavy import, off the CLI's --help path
    from jsonschema.validators import validator_for  # lazy: as above

    schema = json.loads(schema_json)
    if isinstance(schema, dict) and not isinstance(schema.get("$schema", ""), str):
        return "is not a valid JSON Schema: $schema must be a string (a URI)"
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        at = "/".join(str(x) for x in e.path) or "(root)"
        return f"is not a valid JSON Schema at {at}: {e.message}"
    except RecursionError:
        return "is not a valid JSON Schema: nested too deeply to check"
    return None


def surely_rendered(conv: Conversation, keeps_think_text: bool) -> Iterator[str]:
    """Texts a rendering of `conv` holds: every message's content (of an assistant reply only
    what follows its last `</think>` unless `keeps_think_text`: templates like Qwen3's drop the
    rest as reasoning; `Renderer.keeps_think_text`), tool-call names and arguments, and each
    tool's name, description and parameters (as JSON)."""
    for m in conv.messages:
        drop = m.role == "assistant" and not keeps_think_text
        yield m.content.rpartition("</think>")[2] if drop else m.content
        for call in m.tool_calls:
            yield from (call.name, call.arguments)
    for tool in conv.tools:
        yield from (tool.name, tool.description or "", json.dumps(tool.parameters))


def refuse_surely_too_long(renderer: Renderer, texts: Iterable[str], max_model_len: int,
                           param: str) -> None:
    """Raise GatewayError 400 `context_length_exceeded` (CASES.md C09) when `texts` alone must
    exceed `max_model_len` tokens (`Renderer.min_tokens`), before anything is tokenized (a huge
    body would otherwise be tokenized on the event loop)."""
    if (floor := renderer.min_tokens(texts)) >= max_model_len:
        raise context_exceeded(f"at least {floor}", max_model_len, param)


def check_conversation(conv: Conversation, renderer: Renderer, max_model_len: int,
                       model_names: Sequence[str], strict_model: bool) -> tuple[Tool, ...]:
    """The tools to render for `conv`, after the checks that need no rendering.

    Raises GatewayError 404 `model_not_found` (a model not one of `model_names` when
    `strict_model`), 400 `context_length_exceeded` for a request whose text alone
    must exceed max_model_len (`surely_rendered`, `refuse_surely_too_long`; C09), 400 for
    top_logprobs > 0 (engines return only the sampled token's logprob), an empty stop
    string, a tool that is not valid (`tool_problem`: 400 `invalid_tool` naming it,
    CASES.md C15), a tool result whose call id no earlier assistant message made in a
    conversation that made calls (C22), or a tool_choice that forces a tool without tools /
    names an undeclared one.
    """
    if strict_model and conv.model not in model_names:
        raise GatewayError(404, f"model {conv.model!r} does not exist; serving "
                           f"{', '.join(map(repr, model_names))}", "model_not_found",
                           conv.param("model"))
    if conv.top_logprobs > 0:
        raise unsupported(conv.param("top_logprobs"), f"{conv.top_logprobs} alternatives per "
                          "token asked; the rollout engine returns only the sampled token's "
                          "logprob (use 0)")
    if any(not s for s in conv.sampling.stop):
        raise unsupported(conv.param("stop"), "stop strings must not be empty")
    refuse_surely_too_long(renderer, surely_rendered(conv, renderer.keeps_think_text),
                           max_model_len, conv.param("messages"))
    called: set[str] = set()
    for m in conv.messages:  # C22: a result answers a call made earlier in the conversation
        called.update(c.id for c in m.tool_calls)  # (C01's tool text after no call at all: kept)
        if m.role == "tool" and called and m.tool_call_id not in called:
            raise GatewayError(400, f"a tool result answers call id {m.tool_call_id!r}, which "
                               "no earlier assistant message made", "invalid_value",
                               conv.param("messages"))
    choice = conv.tool_choice
    names = [t.name for t in conv.tools]
    repeated = {n for n, k in collections.Counter(names).items() if k > 1}
    for i, tool in enumerate(conv.tools):
        if problem := tool_problem(tool, repeated, conv.param("parameters")):
            raise GatewayError(400, f"tool {tool.name!r}: {problem}", "invalid_tool",
                               f"{conv.param('tools')}.{i}")
    if choice not in ("auto", "none") and not conv.tools:
        raise unsupported(conv.param("tool_choice"), "forces a tool call, but the request "
                          "declares no tools")
    if isinstance(choice, ForcedTool) and choice.name not in names:
        raise unsupported(conv.param("tool_choice"),
                          f"tool {choice.name!r} is not among the declared tools {names}")
    return () if choice == "none" else conv.tools


def sampling_params(session: Session, conv: Conversation, prompt_len: int, renderer: Renderer,
                    max_model_len: int, temperature: float, max_tokens: int) -> SamplingParams:
    """Temperature: session > request > gateway default (`temperature`). max_tokens: the
    smallest of the session's, the request's and the gateway's (`max_tokens`: `rollout.max_tokens`,
    a cap on every call, sessions opened over HTTP included), clamped to the context.

    The seed is the request's, else the session's `seed + turns so far` (mod 2**63). top_p,
    top_k (-1 stored as 0), min_p and the penalties are the request's, else neutral; all are
    explicit in the params the engine gets and the turn records. A training session's turn
    sampled with any of them non-neutral is valid: the trainer keeps it as context, counted
    (`SamplingParams.transforms`, CASES.md C04, C21). Raises GatewayError 400 for prompts of
    max_model_len tokens or more (C09).
    """
    s = conv.sampling
    room = max_model_len - prompt_len
    if room <= 0:
        raise context_exceeded(str(prompt_len), max_model_len, conv.param("messages"))
    temperature = next(
        t for t in (session.temperature, s.temperature, temperature) if t is not None
    )
    wanted = min(m for m in (session.max_tokens, s.max_tokens, max_tokens)
                 if m is not None)  # an agent may ask for fewer, never for more
    seed = s.seed if s.seed is not None or session.seed is None else (
        (session.seed + len(session.turns)) % 2**63)
    return SamplingParams(
        temperature=temperature, top_p=1.0 if s.top_p is None else s.top_p,
        max_tokens=min(wanted, room), stop_token_ids=renderer.stop_ids, seed=seed,
        top_k=max(s.top_k or 0, 0), min_p=s.min_p or 0.0,
        repetition_penalty=1.0 if s.repetition_penalty is None else s.repetition_penalty,
        presence_penalty=s.presence_penalty or 0.0, frequency_penalty=s.frequency_penalty or 0.0)


def prefill_text(conv: Conversation, renderer: Renderer) -> str:
    """Reply text put after the generation prompt: the opening of a tool call when
    tool_choice is "required" or names a tool, else "". Its ids are prompt ids (never
    trained); the engine cannot constrain the rest, so a malformed call comes back as text
    and counts in `tool_parse_errors`. Raises GatewayError 400 when the renderer's tool-call
    format cannot be forced (mistral)."""
    choice = conv.tool_choice
    if choice != "required" and not isinstance(choice, ForcedTool):
        return ""
    prefix = renderer.tool_call_prefix(choice.name if isinstance(choice, ForcedTool) else None)
    if prefix is None:
        raise unsupported(conv.param("tool_choice"), f"the {renderer.parser.name} "
                          "tool-call format cannot be forced")
    return prefix


def build_call(session: Session, conv: Conversation, tools: tuple[Tool, ...], plan: PromptPlan,
               prefix: str, renderer: Renderer, engine: RolloutEngine, temperature: float,
               max_tokens: int) -> Call:
    """The `Call` of a checked conversation (`tools` from `check_conversation`), its prompt
    `plan` and its `prefix` (`prefill_text`): prompt ids with the prefill, one `SamplingParams`
    per choice (choice i samples with seed + i), the strings that close a choice. Raises
    GatewayError (see `sampling_params`; 400 for parallel_tool_calls false when the tool-call
    format cannot be stopped after one call)."""
    prompt_ids = plan.prompt_ids + renderer.encode(prefix)
    base = sampling_params(session, conv, len(prompt_ids), renderer, engine.max_model_len,
                           temperature, max_tokens)
    params = [base if base.seed is None else dataclasses.replace(
        base, seed=(base.seed + i) % 2**63) for i in range(conv.n)]
    close, parser = renderer.call_close, renderer.parser
    closes = (close,) if tools and not conv.parallel_tool_calls and close else ()
    if tools and not conv.parallel_tool_calls and close is None and parser.multiple:
        raise unsupported(conv.param("parallel_tool_calls"), f"false cannot be honoured: a "
                          f"{parser.name} reply cannot be stopped after one tool call")
    declared = {t.name: t.parameters for t in tools} if tools else None
    return Call(conv, tools, plan, prefix, prompt_ids, params, closes, declared,
                time.time(), engine.weight_version)  # stamped right before dispatch
