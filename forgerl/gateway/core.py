"""The gateway core: one model call, whatever protocol asked for it, recorded token-in-token-out.

`Gateway` is a façade over three steps, each its own module:
  prepare (prepare.py: validate, render with TITO, plan the call) -->
  dispatch (dispatch.py: the engine, whole or streamed, n choices at once) -->
  record (record.py: cut at stop strings, parse tool calls, store every choice as a
  `Completion` in the data pool and as a turn of the session).
Data flow: protocol module --`Conversation`--> `Gateway.complete` (or its token-streaming twin
`Gateway.stream`) --> `Result` back to the protocol, which answers in its own wire format. The
façade also owns the sessions' lifecycle (open, finish, expire idle) and the counters.

How a protocol plugs in (protocols/chat.py is the worked example; Responses, Anthropic
Messages and Completions modules follow the same four steps):

1. Validate the wire body with the protocol's own pydantic models (errors.parse_body), then
   apply the protocol's table of the request policy (fields.enforce: what is honoured, kept,
   approximated, left out or refused; its notes go into `Conversation.request`).
2. Translate it into a `Conversation` (conversation.py): messages (system anywhere, tool calls,
   tool results, reasoning), tools in the canonical `Tool` shape, tool_choice, `Sampling`, n,
   logprobs; `param_names` maps the internal field names the core's errors use to the wire's
   (e.g. {"stop": "stop_sequences"}). Assistant messages the client echoes back must translate
   to the same `message_key` (sessions.py) as the reply the core returned, so the session reuses
   their recorded ids: same text, same tool call names and arguments.
3. `result = await gateway.complete(session, conversation)`, with `session` from the app's
   authentication (sessions_api.py). That call renders, dispatches, records and parses; a
   protocol never touches the engine, the pool or the renderer, and never records anything.
4. Turn `result.choices` (each: `reply` message, `finish_reason`, `completion` for usage and
   ids, `logprobs`) into the wire response. For a stream, iterate `gateway.stream(session,
   conversation)` instead: `Started` (prompt_tokens, as soon as the call is dispatched), then
   `Delta`s (content text, or one whole tool call once its block closed; logprobs of the new
   tokens; `sampled_at`), then the same `Result` `complete` would give, recorded once, at the
   end, from the ids. Map each to the protocol's SSE events and hand the strings to
   `sse.EventStream` (headers with the first event, errors before it as JSON, client
   disconnect watched, the iterator closed at the end). Closing the iterator early aborts the
   engine streams and records nothing.

Errors: `GatewayError` (errors.py) with the status and OpenAI fields; when `complete` raises,
nothing of that call is recorded and earlier records are untouched. Serving over HTTP is the
app's (app.py: `Gateway.serve` on the app's subclass).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from forgerl.datapool.base import DataPool
from forgerl.engines.base import RolloutEngine
from forgerl.gateway import telemetry
from forgerl.gateway.conversation import Conversation, Tool
from forgerl.gateway.dispatch import Delta, Started, choice_events, generate, merged, reply_stream
from forgerl.gateway.errors import GatewayError
from forgerl.gateway.group_commit import GroupCommit
from forgerl.gateway.prepare import Call, build_call, check_conversation, prefill_text
from forgerl.gateway.record import Result, build_choices, record
from forgerl.gateway.renderers.reasoning import StreamState
from forgerl.gateway.renderers.renderer import Renderer
from forgerl.gateway.sessions import PromptPlan, Session, SessionStore
from forgerl.types import NO_CALL, GenerateOutput

log = logging.getLogger(__name__)


@dataclass
class Gateway:
    """Renderer + sessions + engine + pool: everything one model call needs.

    temperature: the default when neither the session nor the request sets one. max_tokens:
    the cap on every call's completion tokens.
    strict_model: refuse (404) model names other than `model_name`, `policies` and
    `untrained_models`.
    counters: requests, completion_tokens, prefix_hits, prefix_misses, traces (traces started,
    sessions.py), tool_parse_errors, engine_errors, client_disconnects (calls cancelled because
    their client went away), tokens_after_stop (sampled ids decoded past a stop string and
    dropped from the record), sessions_expired (HTTP sessions closed after
    `session_idle_timeout_s` without a call), context_overflows (calls refused because the
    session's context outgrew max_model_len), untokenized_replies (engine answers without
    token ids, recorded as context only: record.build_choices), item_token_ids (calls whose
    sent-back Responses token ids built the prompt, differed from the record or could not be
    used: `Session.item_plan`, noted as the completion's `request.token_ids`).
    """

    renderer: Renderer
    engine: RolloutEngine
    pool: DataPool
    model_name: str
    sessions: SessionStore = field(default_factory=SessionStore)
    temperature: float = 1.0
    max_tokens: int = 256
    strict_model: bool = True
    strict: bool = False
    """Refuse (400) request fields in no policy table and those the policy would approximate
    or leave out (fields.py), instead of keeping / approximating them."""
    external: set[str] = field(default_factory=set)
    """Trajectory ids opened over HTTP (POST /v1/sessions): only these take rewards over HTTP,
    whatever their state; the controller scores its own rollouts."""
    controller_tasks: bool = False
    """True while a controller trains on this pool (`forgerl train`): every task index >= 0 is
    one of its training groups, so POST /v1/sessions refuses `task_index >= 0` (403) and outside
    sessions take negative (ad-hoc) indices. False (`forgerl gateway`): any index is accepted."""
    admin_key: str | None = None
    """When set, POST /v1/sessions and the reward endpoint need `Authorization: Bearer
    <admin_key>` (401 `invalid_api_key` otherwise); session keys still authenticate model calls.
    None: both routes are closed (403, CASES.md C26)."""
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """`[gateway] chat_template_kwargs`: chat template variables for every call; a request's
    `chat_template_kwargs` wins per key (`renderer_for`)."""
    loopback_sessions: bool = False
    """True when `admin_key` was generated, not configured: POST /v1/sessions without an
    Authorization header is then also accepted from a loopback client (the machine's own user,
    as `forgerl gateway` served before admin keys); the reward endpoint still needs the key."""
    session_idle_timeout_s: float | None = None
    """When set (> 0), a session opened over HTTP with no model call for this many seconds is
    expired (`expire_idle`): trajectory failed, session closed. Controller sessions never are."""
    untrained_models: frozenset[str] = frozenset()
    """More served model names: a call naming one is served by the same policy and recorded
    untrained, in a trace of its own (`Session.place`)."""
    responses_token_ids: bool = False
    """`[gateway] responses_token_ids`: each /v1/responses reply's last output item carries its
    call's `prompt_token_ids`, `generation_token_ids`, `generation_log_probs` (NeMo-Gym)."""
    untrained_traces: tuple[re.Pattern[str], ...] = ()
    """A trace whose opening one of these finds (`sessions.matches`) is recorded untrained."""
    policies: Mapping[str, RolloutEngine] = field(default_factory=dict)
    """More trained policies ([[policies]] after the first), by the model name that asks for
    each: a call naming one is served by its engine and recorded under its name
    (`Completion.policy`); `model_name` (and an untrained name) is served by `engine`."""
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("requests", "completion_tokens", "prefix_hits", "prefix_misses", "traces",
             "tool_parse_errors", "engine_errors", "client_disconnects", "tokens_after_stop",
             "sessions_expired", "context_overflows", "untokenized_replies",
             "item_token_ids"), 0
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

    def finish_session(self, trajectory_id: str, reward: float | None) -> str:
        """Mark the trajectory finished with `reward` and close its session; returns the
        status stored: "failed" (error `NO_CALL`, reward unset) when its open session recorded
        no call, for there is nothing to train (e.g. its only call was refused).

        Raises KeyError (unknown trajectory) or ValueError (already ended) from the pool.
        """
        session = self.sessions.find(trajectory_id)
        if session is not None and not session.turns:
            self.pool.finish_trajectory(trajectory_id, "failed", error=NO_CALL)
        else:
            self.pool.finish_trajectory(trajectory_id, "finished", reward=reward)
        if session is not None:
            self.sessions.close(session.api_key)
        return "finished" if session is None or session.turns else "failed"

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

    def renderer_for(self, conv: Conversation) -> Renderer:
        """The renderer bound to `conv`'s chat template variables (the gateway's, then the
        request's); the applied ones are noted in `conv.request["template_kwargs"]`."""
        wanted = {**self.template_kwargs, **conv.template_kwargs}
        if wanted and self.renderer.takes_template_kwargs:
            conv.request["template_kwargs"] = wanted
        return self.renderer.bind(wanted)

    def engine_for(self, conv: Conversation) -> RolloutEngine:
        """The engine of the policy `conv` names (`policies`), else the first policy's."""
        return self.policies.get(conv.model, self.engine)

    def policy_of(self, conv: Conversation) -> str:
        """The policy a call of `conv` is recorded under: the model it names when that is one
        of `policies`, else `model_name`."""
        return conv.model if conv.model in self.policies else self.model_name

    def check(self, conv: Conversation) -> tuple[Tool, ...]:
        """The tools to render for `conv`, after the checks that need no rendering
        (prepare.check_conversation: 404 for a model not served when `strict_model`, 400s)."""
        return check_conversation(conv, self.renderer_for(conv), self.engine.max_model_len,
                                  [self.model_name, *self.policies],
                                  self.strict_model and conv.model not in self.untrained_models)

    def prefill(self, conv: Conversation) -> str:
        """The reply text prefilled for a forced tool call (prepare.prefill_text), else ""."""
        return prefill_text(conv, self.renderer_for(conv))

    def prompt_tokens(self, session: Session, conv: Conversation) -> int:
        """The length of the prompt ids the next call of `conv` would send (recorded ids
        reused, prefill included); nothing recorded. Raises GatewayError as `check`."""
        tools = self.check(conv)
        plan = session.plan(conv.messages, tools, self.renderer_for(conv), conv.item_ids)
        prefill = self.renderer.encode(self.prefill(conv))
        return len(plan.prompt_ids) + len(prefill)

    def prepare(self, session: Session, conv: Conversation,
                plan: PromptPlan | None = None) -> Call:
        """Check, render (TITO) and parametrise one call; raises GatewayError (see `check`,
        prepare.sampling_params, prepare.build_call). Nothing is dispatched or recorded."""
        tools, renderer = self.check(conv), self.renderer_for(conv)
        if plan is None:
            plan = session.plan(conv.messages, tools, renderer, conv.item_ids)
        if plan.note:  # sent-back ids used, overruled or unusable: said in the record
            conv.request["token_ids"] = plan.note
            self.counters["item_token_ids"] += 1
        prefix = self.prefill(conv)
        call = build_call(session, conv, tools, plan, prefix, renderer, self.engine_for(conv),
                          self.temperature, self.max_tokens)
        self.counters["requests"] += 1
        return call

    async def complete(
        self, session: Session, conv: Conversation, plan: PromptPlan | None = None
    ) -> Result:
        """Render (TITO), dispatch, parse and record one call of `conv.n` choices.

        Each choice is its own `Completion` in the pool and its own turn of the session (n
        sibling branches from the same prompt; choice i samples with seed + i). `plan`: prompt
        ids built by the protocol (a raw prompt, protocols/completions.py; `conv` then has no
        messages or tools), used instead of rendering. Raises GatewayError (see `prepare`,
        dispatch.generate; 409 when the trajectory takes no completions); nothing of this call
        is recorded then.
        """
        with self.active(session):
            call = self.prepare(session, conv, plan)
            outs = await generate(self.engine_for(conv), self.counters, session,
                                  call.prompt_ids, call.params)
            return await self.finish(session, call, outs)

    async def finish(self, session: Session, call: Call, outs: Sequence[GenerateOutput],
                     streamed: Sequence[StreamState] | None = None) -> Result:
        """Cut, parse and record the choices of `call` from the engine outputs (one per choice;
        record.build_choices, record.record). Raises GatewayError 409 (see record.record)."""
        choices = build_choices(self.renderer_for(call.conv), self.counters, call, outs,
                                streamed)
        policy = self.policy_of(call.conv)
        for c in choices:
            c.completion.policy = policy
        place = session.place(call.plan, call.conv.messages,
                              call.conv.model not in self.untrained_models, self.untrained_traces,
                              policy)
        await record(self.pool, self.commits, self.counters, session, call, choices, place)
        result = Result(choices, len(call.prompt_ids), call.started_at)
        telemetry.note(prompt_tokens=result.prompt_tokens,
                       completion_tokens=result.completion_tokens)
        return result

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
        renderer = self.renderer_for(call.conv)
        states = [reply_stream(call, renderer) for _ in call.params]
        outs: list[GenerateOutput | None] = [None] * len(states)
        engine = self.engine_for(conv)
        sources = [choice_events(engine, renderer, self.counters, session, i, call, s)
                   for i, s in enumerate(states)]
        try:
            async with contextlib.aclosing(merged(sources)) as events:
                async for item in events:
                    if isinstance(item, Delta):
                        yield item
                    else:
                        outs[item[0]] = item[1]
        except (asyncio.CancelledError, GeneratorExit):
            self.counters["client_disconnects"] += 1
            telemetry.note(error="client disconnected; the stream was aborted",
                           code="client_disconnected")
            raise
        yield await self.finish(session, call, [o for o in outs if o is not None], states)
