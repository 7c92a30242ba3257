"""The gateway core: one model call, whatever protocol asked for it, recorded token-in-token-out.

Data flow: protocol module --`Conversation`--> `Gateway.complete` (or its token-streaming twin
`Gateway.stream`): render with TITO (the session's turn tree reuses the exact ids of earlier
turns; sessions.py), prefill a forced tool call, clamp max_tokens to the context, dispatch the
token ids to the rollout engine (n choices at once), cut each choice at its stop strings and
parse its tool calls (replies.py), record every choice as a `Completion` in the data pool and
as a turn of the session --> `Result` back to the protocol, which answers in its own wire
format.

How a protocol plugs in (protocols/chat.py is the worked example; Responses, Anthropic
Messages and Completions modules follow the same four steps):

1. Validate the wire body with the protocol's own pydantic models. Top-level fields the
   official API does not know are a 400 naming them (`extra="forbid"`, errors.parse_body); a
   field the core cannot honour is refused with `errors.unsupported(field, why)`.
2. Translate it into a `Conversation` (conversation.py): messages (system first, tool calls,
   tool results, reasoning), tools in the canonical `Tool` shape, tool_choice, `Sampling`, n,
   logprobs; `param_names` maps the internal field names the core's errors use to the wire's
   (e.g. {"stop": "stop_sequences"}). Assistant messages the client echoes back must translate
   to the same `message_key` (sessions.py) as the reply the core returned, so the session reuses
   their recorded ids: same text, same tool call names and arguments.
3. `result = await gateway.complete(session, conversation)`, with `session` from the app's
   authentication (app.py). That call renders, dispatches, records and parses; a protocol never
   touches the engine, the pool or the renderer, and never records anything itself.
4. Turn `result.choices` (each: `reply` message, `finish_reason`, `completion` for usage and
   ids, `logprobs`) into the wire response. For a stream, iterate `gateway.stream(session,
   conversation)` instead: `Started` (prompt_tokens, as soon as the call is dispatched), then
   `Delta`s (content text, or one whole tool call once its block closed; logprobs of the new
   tokens; `sampled_at`), then the same `Result` `complete` would give, recorded once, at the
   end, from the ids. Map each to the protocol's SSE events and hand the strings to
   `protocols.chat.EventStream` (headers with the first event, errors before it as JSON,
   client disconnect watched, the iterator closed at the end). Closing the iterator early
   aborts the engine streams and records nothing.

Errors: `GatewayError` (errors.py) with the status and OpenAI fields; when `complete` raises,
nothing of that call is recorded and earlier records are untouched.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from forgerl.datapool.base import DataPool
from forgerl.engines.base import RolloutEngine, TokenEvent
from forgerl.gateway.conversation import Conversation, ForcedTool, Message, Tool, ToolCall
from forgerl.gateway.errors import GatewayError, context_exceeded, unsupported
from forgerl.gateway.group_commit import GroupCommit
from forgerl.gateway.renderers.renderer import Renderer, token_text
from forgerl.gateway.renderers.replies import (
    HeldReply,
    IncrementalDecoder,
    ReplyStream,
    cut_at_stop,
    finish_reply,
)
from forgerl.gateway.sessions import PromptPlan, Session, SessionStore, Turn
from forgerl.types import UNDELIVERED, Completion, GenerateOutput, SamplingParams

if TYPE_CHECKING:
    from forgerl.gateway.app import GatewayServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token as the client sees it: its text (decoded alone), its recorded
    behaviour logprob (nats) and the UTF-8 bytes of that text."""

    token: str
    logprob: float
    bytes: tuple[int, ...]


def tool_error_kind(error: str) -> str:
    """The process-event kind of a tool-call parse error (tool_parsers.ParsedReply.errors):
    "undeclared_tool" for a call of a tool the request did not declare, else
    "invalid_tool_call" (bad JSON, no name, arguments not an object, unclosed block)."""
    return "undeclared_tool" if "was not declared" in error else "invalid_tool_call"


@dataclass
class Choice:
    """One sampled continuation, as recorded and as answered.

    completion: the recorded `Completion` (prompt_ids with any prefill, the kept sampled ids,
        logprobs, finish_reason as answered). reply: the assistant message the client sees
        (text ends before a stop string; tool calls parsed). logprobs: one entry per kept
        sampled id except a final end-of-turn id, when the conversation asked for logprobs.
    """

    index: int
    completion: Completion
    reply: Message
    logprobs: list[TokenLogprob] | None = None
    tool_errors: tuple[str, ...] = ()
    """The choice's tool-call parse errors; each becomes a process event of its turn."""

    @property
    def finish_reason(self) -> str:
        """"stop", "length" or "tool_calls" (the recorded one)."""
        return self.completion.finish_reason


@dataclass
class Result:
    """What `Gateway.complete` answers: the choices in index order and the shared prompt."""

    choices: list[Choice]
    prompt_tokens: int
    started_at: float

    @property
    def completion_tokens(self) -> int:
        """Recorded completion ids over all choices (OpenAI's usage counts every choice)."""
        return sum(len(c.completion.completion_ids) for c in self.choices)


@dataclass(frozen=True)
class Started:
    """First event of `Gateway.stream`: the call passed every check and was dispatched.

    prompt_tokens: prompt length in ids (usage). started_at: time.time() at dispatch.
    """

    prompt_tokens: int
    started_at: float


@dataclass(frozen=True)
class Delta:
    """One streamed piece of choice `index`: content text or one recognised tool call.

    text: content delta ("" for a tool call); the deltas of a choice join to its reply content.
    tool_call: a whole parsed call (id, name, arguments JSON text) once its block closed (for
        formats without a closing string, llama3_json and mistral: once the reply ended, its
        content then one delta), the `call_index`-th of the choice. logprobs: when the
        conversation asked for them, the recorded entries of the sampled ids not yet covered
        (None: none new); the entries the deltas did not carry are the tail of the Result's
        `Choice.logprobs`.
    sampled_at: time.perf_counter() when the engine sampled the latest id in this delta.
    """

    index: int
    text: str = ""
    tool_call: ToolCall | None = None
    call_index: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    sampled_at: float = 0.0


@dataclass(frozen=True)
class Call:
    """One prepared model call (`Gateway.prepare`): what dispatch, cut, parse and record need.

    prefix: prefilled reply text (its ids end prompt_ids). params: one per choice. closes: the
    strings that end a choice and stay in its text. declared: names of the rendered tools (None:
    no tool parsing). weight_version: the engine's version at dispatch.
    """

    conv: Conversation
    tools: tuple[Tool, ...]
    plan: PromptPlan
    prefix: str
    prompt_ids: list[int]
    params: list[SamplingParams]
    closes: tuple[str, ...]
    declared: set[str] | None
    started_at: float
    weight_version: int


async def _merged(sources: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """The items of several async iterators as they come (one task each; one source is read
    directly). Closing this iterator cancels and closes every source."""
    if len(sources) == 1:
        async with contextlib.aclosing(sources[0]) as source:
            async for item in source:
                yield item
        return
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

    async def pump(source: AsyncIterator[Any]) -> None:
        try:
            async for item in source:
                queue.put_nowait((False, item))
            queue.put_nowait((True, None))
        except Exception as e:
            queue.put_nowait((True, e))

    tasks = [asyncio.ensure_future(pump(s)) for s in sources]
    try:
        for _ in tasks:
            while not (item := await queue.get())[0]:
                yield item[1]
            if item[1] is not None:
                raise item[1]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
    it names its own `$schema`), or None. Cached: an agent declares the same tools every turn,
    and one check costs ~0.8 ms of the event loop."""
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

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
    exceed `max_model_len` tokens (`Renderer.min_tokens`), before anything is tokenized: a
    60 MB body took 87 s and 12 GiB to tokenize on the event loop."""
    if (floor := renderer.min_tokens(texts)) >= max_model_len:
        raise context_exceeded(f"at least {floor}", max_model_len, param)


@dataclass
class Gateway:
    """Renderer + sessions + engine + pool: everything one model call needs.

    temperature: the default when neither the session nor the request sets one. max_tokens:
    the cap on every call's completion tokens.
    strict_model: refuse (404) model names other than `model_name`.
    counters: requests, completion_tokens, prefix_hits, prefix_misses, tool_parse_errors,
    engine_errors, client_disconnects (calls cancelled because their client went away),
    tokens_after_stop (sampled ids decoded past a stop string and dropped from the record),
    sessions_expired (HTTP sessions closed after `session_idle_timeout_s` without a call),
    context_overflows (calls refused because the session's context outgrew max_model_len).
    """

    renderer: Renderer
    engine: RolloutEngine
    pool: DataPool
    model_name: str
    sessions: SessionStore = field(default_factory=SessionStore)
    temperature: float = 1.0
    max_tokens: int = 256
    strict_model: bool = True
    external: set[str] = field(default_factory=set)
    """Trajectory ids opened over HTTP (POST /v1/sessions): only these take rewards over HTTP,
    whatever their state; the controller scores its own rollouts."""
    controller_tasks: bool = False
    """True while a controller trains on this pool (`forgerl train`): every task index >= 0 is
    one of its training groups, so POST /v1/sessions refuses `task_index >= 0` (403) and outside
    sessions take negative (ad-hoc) indices. False (`forgerl gateway`): any index is accepted."""
    admin_key: str | None = None
    """When set, POST /v1/sessions and the reward endpoint need `Authorization: Bearer
    <admin_key>` (401 `invalid_api_key` otherwise); session keys still authenticate model calls."""
    session_idle_timeout_s: float | None = None
    """When set (> 0), a session opened over HTTP with no model call for this many seconds is
    expired (`expire_idle`): trajectory failed, session closed. Controller sessions never are."""
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("requests", "completion_tokens", "prefix_hits", "prefix_misses", "tool_parse_errors",
             "engine_errors", "client_disconnects", "tokens_after_stop", "sessions_expired",
             "context_overflows"), 0
        )
    )

    commits: GroupCommit = field(init=False)
    """Batches the pool writes of calls that finish together (`group_commit`)."""

    def __post_init__(self) -> None:
        self.commits = GroupCommit(self.pool)

    def open_session(
        self,
        task_index: int = -1,
        rollout_index: int = 0,
        temperature: float | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
    ) -> tuple[str, str]:
        """Create a running trajectory and a session for it; returns (trajectory_id, api_key).

        `seed`: the session's sampling seed (see `Session.seed`); None = unseeded.
        """
        trajectory_id = self.pool.create_trajectory(
            task_index=task_index, rollout_index=rollout_index
        )
        return trajectory_id, self.sessions.create(trajectory_id, temperature, max_tokens,
                                                   seed=seed)

    def finish_session(self, trajectory_id: str, reward: float | None) -> None:
        """Mark the trajectory finished with `reward` and close its session.

        Raises KeyError (unknown trajectory) or ValueError (already ended) from the pool.
        """
        self.pool.finish_trajectory(trajectory_id, "finished", reward=reward)
        session = self.sessions.find(trajectory_id)
        if session is not None:
            self.sessions.close(session.api_key)

    def expire_idle(self, now: float | None = None) -> list[str]:
        """Expire the idle sessions opened over HTTP; returns their trajectory ids.

        Idle: no model call running and none started or ended for `session_idle_timeout_s`
        seconds (time.monotonic(); `now` defaults to it). Each one's trajectory is marked failed
        with error "session expired after N s idle", its session closed (its key then gets 401),
        logged (warning) and counted in `sessions_expired`. Controller rollouts (not in
        `external`) are never expired here. A no-op when the timeout is None.
        """
        timeout = self.session_idle_timeout_s
        if timeout is None:
            return []
        now = time.monotonic() if now is None else now
        expired = []
        for s in self.sessions.open():
            if (s.trajectory_id not in self.external or s.in_flight
                    or now - s.last_active < timeout):
                continue
            self.sessions.close(s.api_key)
            with contextlib.suppress(KeyError, ValueError):  # already ended: just close it
                self.pool.finish_trajectory(s.trajectory_id, "failed",
                                            error=f"session expired after {timeout:g} s idle")
            self.counters["sessions_expired"] += 1
            log.warning("session %s expired after %g s idle", s.trajectory_id, timeout)
            expired.append(s.trajectory_id)
        return expired

    @contextlib.contextmanager
    def active(self, session: Session) -> Iterator[None]:
        """Mark one model call of `session` running (never expired meanwhile). A call refused
        because the conversation outgrew max_model_len records a "context_overflow" process
        event on the session's latest turn (CASES.md C09; `[reward] process` may weight it)."""
        session.in_flight += 1
        session.last_active = time.monotonic()
        try:
            yield
        except GatewayError as e:
            if e.code == "context_length_exceeded" and session.turns:
                self.counters["context_overflows"] += 1
                with contextlib.suppress(KeyError, ValueError):  # the trajectory has ended
                    self.pool.add_event(session.trajectory_id, "context_overflow")
            raise
        finally:
            session.in_flight -= 1
            session.last_active = time.monotonic()

    def check(self, conv: Conversation) -> tuple[Tool, ...]:
        """The tools to render for `conv`, after the checks that need no rendering.

        Raises GatewayError 404 `model_not_found` (a model other than `model_name` when
        `strict_model`), 400 `context_length_exceeded` for a request whose text alone must
        exceed max_model_len (`surely_rendered`, `refuse_surely_too_long`; C09), 400 for
        top_logprobs > 0 (engines return only the sampled token's logprob), an empty stop
        string, a tool that is not valid (`tool_problem`: 400 `invalid_tool` naming it,
        CASES.md C15), or a tool_choice that forces a tool without tools / names an undeclared
        one.
        """
        if self.strict_model and conv.model != self.model_name:
            raise GatewayError(404, f"model {conv.model!r} does not exist; serving "
                               f"{self.model_name!r}", "model_not_found", conv.param("model"))
        if conv.top_logprobs > 0:
            raise unsupported(conv.param("top_logprobs"), f"{conv.top_logprobs} alternatives per "
                              "token asked; the rollout engine returns only the sampled token's "
                              "logprob (use 0)")
        if any(not s for s in conv.sampling.stop):
            raise unsupported(conv.param("stop"), "stop strings must not be empty")
        refuse_surely_too_long(self.renderer, surely_rendered(conv, self.renderer.keeps_think_text),
                               self.engine.max_model_len, conv.param("messages"))
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

    def sampling_params(
        self, session: Session, conv: Conversation, prompt_len: int
    ) -> SamplingParams:
        """Temperature: session > request > gateway default. max_tokens: the smallest of the
        session's, the request's and the gateway's (`rollout.max_tokens`, a cap on every call,
        sessions opened over HTTP included), clamped to the context.

        The seed is the request's, else the session's `seed + turns so far` (mod 2**63).
        Raises GatewayError 400 for top_p < 1 on a training session (CASES.md C04: recorded
        logprobs are full-support) and for prompts of max_model_len tokens or more (C09).
        """
        s = conv.sampling
        top_p = 1.0 if s.top_p is None else s.top_p
        if top_p < 1.0 and session.training:
            raise unsupported(conv.param("top_p"), f"top_p ({top_p}) < 1 is refused for training "
                              "rollouts: the recorded logprobs are over the full vocabulary")
        room = self.engine.max_model_len - prompt_len
        if room <= 0:
            raise context_exceeded(str(prompt_len), self.engine.max_model_len,
                                   conv.param("messages"))
        temperature = next(
            t for t in (session.temperature, s.temperature, self.temperature) if t is not None
        )
        wanted = min(m for m in (session.max_tokens, s.max_tokens, self.max_tokens)
                     if m is not None)  # an agent may ask for fewer, never for more
        seed = s.seed if s.seed is not None or session.seed is None else (
            (session.seed + len(session.turns)) % 2**63)
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=min(wanted, room),
                              stop_token_ids=self.renderer.stop_ids, seed=seed)

    def prefill(self, conv: Conversation) -> str:
        """Reply text put after the generation prompt: the opening of a tool call when
        tool_choice is "required" or names a tool, else "". Its ids are prompt ids (never
        trained); the engine cannot constrain the rest, so a malformed call comes back as text
        and counts in `tool_parse_errors`. Raises GatewayError 400 when the renderer's tool-call
        format cannot be forced (mistral)."""
        choice = conv.tool_choice
        if choice != "required" and not isinstance(choice, ForcedTool):
            return ""
        prefix = self.renderer.tool_call_prefix(choice.name if isinstance(choice, ForcedTool)
                                                else None)
        if prefix is None:
            raise unsupported(conv.param("tool_choice"), f"the {self.renderer.parser.name} "
                              "tool-call format cannot be forced")
        return prefix

    async def generate(
        self, session: Session, prompt_ids: list[int], params: list[SamplingParams]
    ) -> list[GenerateOutput]:
        """One engine call per choice, at once; all are cancelled when one fails or this call is
        cancelled (a client disconnect). Raises GatewayError 500 `engine_error`."""
        tasks = [asyncio.ensure_future(self.engine.generate(prompt_ids, p)) for p in params]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException as e:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not isinstance(e, Exception):
                raise
            raise self._engine_error(session, e) from e

    def _engine_error(self, session: Session, e: Exception) -> GatewayError:
        """Count and log an engine failure; the 500 `engine_error` to raise for it."""
        self.counters["engine_errors"] += 1
        log.exception("engine failed on trajectory %s", session.trajectory_id)
        return GatewayError(500, f"engine error: {type(e).__name__}: {e}", "engine_error",
                            type="server_error")

    def prepare(self, session: Session, conv: Conversation,
                plan: PromptPlan | None = None) -> Call:
        """Check, render (TITO) and parametrise one call; raises GatewayError (see `check`,
        `sampling_params`). Nothing is dispatched or recorded."""
        tools = self.check(conv)
        if plan is None:
            plan = session.plan(conv.messages, tools, self.renderer)
        prefix = self.prefill(conv)
        prompt_ids = plan.prompt_ids + self.renderer.encode(prefix)
        base = self.sampling_params(session, conv, len(prompt_ids))
        params = [base if base.seed is None else dataclasses.replace(
            base, seed=(base.seed + i) % 2**63) for i in range(conv.n)]
        close, parser = self.renderer.call_close, self.renderer.parser
        closes = (close,) if tools and not conv.parallel_tool_calls and close else ()
        if tools and not conv.parallel_tool_calls and close is None and parser.multiple:
            raise unsupported(conv.param("parallel_tool_calls"), f"false cannot be honoured: a "
                              f"{parser.name} reply cannot be stopped after one tool call")
        declared = {t.name for t in tools} if tools else None
        self.counters["requests"] += 1
        return Call(conv, tools, plan, prefix, prompt_ids, params, closes, declared,
                    time.time(), self.engine.weight_version)  # stamped right before dispatch

    async def complete(
        self, session: Session, conv: Conversation, plan: PromptPlan | None = None
    ) -> Result:
        """Render (TITO), dispatch, parse and record one call of `conv.n` choices.

        Each choice is its own `Completion` in the pool and its own turn of the session (n
        sibling branches from the same prompt; choice i samples with seed + i). `plan`: prompt
        ids built by the protocol (a raw prompt, protocols/completions.py; `conv` then has no
        messages or tools), used instead of rendering. Raises GatewayError (see `check`,
        `sampling_params`, `generate`; 409 when the trajectory takes no completions); nothing of
        this call is recorded then.
        """
        with self.active(session):
            call = self.prepare(session, conv, plan)
            outs = await self.generate(session, call.prompt_ids, call.params)
            return await self.finish(session, call, outs)

    async def finish(self, session: Session, call: Call, outs: Sequence[GenerateOutput],
               streamed: Sequence[ReplyStream | HeldReply] | None = None) -> Result:
        """Cut, parse and record the choices of `call` from the engine outputs (one per choice).

        `streamed`: the stream state of each choice; its reply (content and tool calls, with the
        call ids the client saw) replaces the parsed one, the finish reason stays the parse's.
        Raises GatewayError 409 (see `record`).
        """
        ended_at = time.time()
        choices = []
        for i, (out, p) in enumerate(zip(outs, call.params, strict=True)):
            cut = cut_at_stop(self.renderer.decode, out.completion_ids,
                              self.renderer.end_of_turn_id, call.prefix, call.conv.sampling.stop,
                              call.closes)
            reply, finish, errors = finish_reply(cut, out.finish_reason, call.declared,
                                                 self.renderer.parser.parse)
            if streamed is not None:
                reply = Message("assistant", streamed[i].content, tuple(streamed[i].calls))
            self.counters["tool_parse_errors"] += len(errors)
            self.counters["tokens_after_stop"] += len(out.completion_ids) - cut.keep
            k = cut.keep
            completion = Completion(
                prompt_ids=call.prompt_ids, completion_ids=list(out.completion_ids[:k]),
                logprobs=list(out.logprobs[:k]), weight_versions=list(out.weight_versions[:k]),
                weight_version=call.weight_version, finish_reason=finish, sampling=p,
                started_at=call.started_at, ended_at=ended_at,
                extends_previous=call.plan.extends_previous)
            choices.append(Choice(i, completion, reply,
                                  self.token_logprobs(completion) if call.conv.logprobs else None,
                                  tuple(errors)))
        await self.record(session, call.conv, call.tools, call.plan, choices)
        return Result(choices, len(call.prompt_ids), call.started_at)

    def reply_stream(self, call: Call) -> ReplyStream | HeldReply:
        """The stream state of one choice: hermes calls are sent as each block closes; formats
        without a closing string (llama3_json, mistral) are parsed when the reply ends."""
        parser, stops = self.renderer.parser, call.conv.sampling.stop
        if call.declared is not None and parser.open is None:
            return HeldReply(ReplyStream(call.prefix, stops, call.closes, None, "", ""), parser,
                             call.declared)
        return ReplyStream(call.prefix, stops, call.closes, call.declared, parser.open or "",
                           parser.close or "")

    async def stream(
        self, session: Session, conv: Conversation, plan: PromptPlan | None = None
    ) -> AsyncIterator[Started | Delta | Result]:
        """The token-streaming twin of `complete`: `Started`, then `Delta`s as the engine
        samples, then the `Result`, recorded exactly as `complete` records it.

        Each choice runs on `engine.stream` (an engine without it is replayed from `generate`).
        A delta is sent once its text is certain (`ReplyStream`, `IncrementalDecoder`); a stop
        string closes that choice's engine stream at once. Recording happens once, after every
        choice ended, from the ids. Closing this iterator (or cancelling its consumer) before the
        Result aborts every engine stream and records nothing: the sampled part of an aborted
        call is never a trainable completion (the trainer trains every recorded completion), and
        the agent's retry extends the previous turn as if the call never happened; it counts in
        `client_disconnects`. Raises GatewayError as `complete` (before `Started` for a bad
        request; 500 `engine_error` from the engine; 409 when recording).
        """
        with self.active(session):
            async with contextlib.aclosing(self._stream(session, conv, plan)) as events:
                async for event in events:
                    yield event

    async def _stream(
        self, session: Session, conv: Conversation, plan: PromptPlan | None
    ) -> AsyncIterator[Started | Delta | Result]:
        call = self.prepare(session, conv, plan)
        yield Started(len(call.prompt_ids), call.started_at)
        states = [self.reply_stream(call) for _ in call.params]
        outs: list[GenerateOutput | None] = [None] * len(states)
        sources = [self._choice(session, i, call, s) for i, s in enumerate(states)]
        try:
            async with contextlib.aclosing(_merged(sources)) as events:
                async for item in events:
                    if isinstance(item, Delta):
                        yield item
                    else:
                        outs[item[0]] = item[1]
        except (asyncio.CancelledError, GeneratorExit):
            self.counters["client_disconnects"] += 1
            raise
        yield await self.finish(session, call, [o for o in outs if o is not None], states)

    async def _choice(self, session: Session, i: int, call: Call, state: ReplyStream | HeldReply,
                      ) -> AsyncIterator[Delta | tuple[int, GenerateOutput]]:
        """One choice: engine events -> deltas, then (i, the output to cut and record)."""
        decoder = IncrementalDecoder(self.renderer.decode)
        ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        sent = calls = 0  # tokens whose logprobs went out with a delta; tool calls sent
        out: GenerateOutput | None = None
        engine = self._engine_stream(call.prompt_ids, call.params[i])
        try:
            async with contextlib.aclosing(engine):
                async for ev in engine:
                    if isinstance(ev, GenerateOutput):
                        out = ev
                        pieces = state.feed(decoder.flush()) + state.finish()
                    else:
                        ids.append(ev.token_id)
                        lps.append(ev.logprob)
                        versions.append(ev.weight_version)
                        pieces = state.feed(decoder.push(ev.token_id))
                    eot = 1 if ids and ids[-1] in self.renderer.stop_ids else 0
                    at = ev.sampled_at if isinstance(ev, TokenEvent) else time.perf_counter()
                    for piece in pieces:
                        if isinstance(piece, ToolCall):
                            yield Delta(i, "", piece, calls, None, at)
                            calls += 1
                            continue
                        lp = None
                        if call.conv.logprobs and not state.stopped and out is None:
                            lp = tuple(self._token_logprob(t, x) for t, x in
                                       zip(ids[sent:len(ids) - eot], lps[sent:], strict=False))
                            sent = len(ids) - eot
                        yield Delta(i, piece, None, 0, lp, at)
                    if state.stopped:
                        break  # closes the engine stream: no compute past a stop string
        except Exception as e:
            raise self._engine_error(session, e) from e
        if out is None or state.stopped:
            out = GenerateOutput(ids, lps, versions, "stop" if state.stopped else "abort")
        yield i, out

    def _engine_stream(self, prompt_ids: list[int], params: SamplingParams,
                       ) -> AsyncIterator[TokenEvent | GenerateOutput]:
        stream = getattr(self.engine, "stream", None)
        return stream(prompt_ids, params) if stream is not None else self._replay(prompt_ids,
                                                                                     params)

    async def _replay(self, prompt_ids: list[int], params: SamplingParams,
                      ) -> AsyncIterator[TokenEvent | GenerateOutput]:
        """A finished `generate` as a stream (engines without `stream`)."""
        out = await self.engine.generate(prompt_ids, params)
        now = time.perf_counter()
        for t, lp, v in zip(out.completion_ids, out.logprobs, out.weight_versions, strict=True):
            yield TokenEvent(t, lp, v, now)
        yield out

    def _token_logprob(self, token_id: int, logprob: float) -> TokenLogprob:
        """The token's own bytes (`Renderer.token_bytes`) and their text (`token_text`)."""
        raw = self.renderer.token_bytes(token_id)
        return TokenLogprob(token_text(raw), logprob, tuple(raw))

    async def record(self, session: Session, conv: Conversation, tools: tuple[Tool, ...],
                     plan: PromptPlan, choices: list[Choice]) -> None:
        """Durably add every choice to the trajectory in the pool (group commit, one
        transaction shared with the calls finishing at the same time), then to the session's
        turn tree.

        Each tool-call parse error of a choice is a process event on its turn (kind
        `tool_error_kind`: "undeclared_tool" or "invalid_tool_call"), which `[reward] process`
        may weight. A call cancelled during the commit (its client left) is still recorded,
        and its turns get an `UNDELIVERED` event: the client never saw them (C17). Raises
        GatewayError 409 when the pool refuses (the trajectory ended meanwhile); nothing of the
        call is recorded then.
        """
        gone = False

        def committed(turns: list[int]) -> None:
            for c in choices:
                self.counters["completion_tokens"] += len(c.completion.completion_ids)
            if plan.extends_previous:
                self.counters["prefix_hits"] += 1
            elif session.turns:
                self.counters["prefix_misses"] += 1
            session.record([Turn(conv.messages, tools, c.completion.prompt_ids,
                                 c.completion.completion_ids, c.reply, plan.parent)
                            for c in choices], plan.extends_previous)
            if gone:  # the client left during the commit: it never saw these answers
                for turn in turns:
                    with contextlib.suppress(KeyError, ValueError):  # the trajectory ended
                        self.pool.add_event(session.trajectory_id, UNDELIVERED, turn=turn)

        try:
            await self.commits.record(
                session.trajectory_id, [c.completion for c in choices],
                [[tool_error_kind(e) for e in c.tool_errors] for c in choices], committed)
        except asyncio.CancelledError:
            gone = True
            raise
        except (KeyError, ValueError) as e:
            raise GatewayError(409, f"trajectory {session.trajectory_id} takes no "
                               f"completions: {e}", "trajectory_not_running") from e

    def token_logprobs(self, completion: Completion) -> list[TokenLogprob]:
        """The recorded logprob of every kept sampled id, a final end-of-turn id excluded."""
        ids, lps = completion.completion_ids, completion.logprobs
        if ids and ids[-1] in self.renderer.stop_ids:
            ids, lps = ids[:-1], lps[:-1]
        return [self._token_logprob(i, lp) for i, lp in zip(ids, lps, strict=True)]

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> GatewayServer:
        """Start the HTTP app (app.py) inside the running event loop; port 0 picks a free port."""
        from forgerl.gateway.app import GatewayServer, create_app

        timeout = self.session_idle_timeout_s
        server = GatewayServer(create_app(self), host, port,
                               sweep=None if timeout is None else self.expire_idle,
                               sweep_every_s=min(1.0, (timeout or 1.0) / 4))
        await server.start()
        return server
