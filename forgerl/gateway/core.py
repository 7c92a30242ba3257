"""The gateway core: one model call, whatever protocol asked for it, recorded token-in-token-out.

Data flow: protocol module --`Conversation`--> `Gateway.complete`: render with TITO (the
session's turn tree reuses the exact ids of earlier turns; sessions.py), prefill a forced tool
call, clamp max_tokens to the context, dispatch the token ids to the rollout engine (n choices at
once), cut each choice at its stop strings and parse its tool calls (replies.py), record every
choice as a `Completion` in the data pool and as a turn of the session --> `Result` back to the
protocol, which answers in its own wire format.

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
   ids, `logprobs`) into the wire response, or into stream events. Streams currently replay a
   finished `Result`; a token-streaming twin of `complete` will yield the same choices' deltas
   and record once, at the end, from the ids.

Errors: `GatewayError` (errors.py) with the status and OpenAI fields; when `complete` raises,
nothing of that call is recorded and earlier records are untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forgerl.datapool.base import DataPool
from forgerl.engines.base import RolloutEngine
from forgerl.gateway.conversation import Conversation, ForcedTool, Message, Tool
from forgerl.gateway.errors import GatewayError, unsupported
from forgerl.gateway.renderer import ChatMLRenderer
from forgerl.gateway.replies import cut_at_stop, finish_reply
from forgerl.gateway.sessions import PromptPlan, Session, SessionStore, Turn
from forgerl.types import Completion, GenerateOutput, SamplingParams

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


@dataclass
class Gateway:
    """Renderer + sessions + engine + pool: everything one model call needs.

    temperature / max_tokens: defaults when neither the session nor the request sets them.
    strict_model: refuse (404) model names other than `model_name`.
    counters: requests, completion_tokens, prefix_hits, prefix_misses, tool_parse_errors,
    engine_errors, client_disconnects (calls cancelled because their client went away),
    tokens_after_stop (sampled ids decoded past a stop string and dropped from the record).
    """

    renderer: ChatMLRenderer
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
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("requests", "completion_tokens", "prefix_hits", "prefix_misses", "tool_parse_errors",
             "engine_errors", "client_disconnects", "tokens_after_stop"), 0
        )
    )

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

    def check(self, conv: Conversation) -> tuple[Tool, ...]:
        """The tools to render for `conv`, after the checks that need no rendering.

        Raises GatewayError 404 `model_not_found` (a model other than `model_name` when
        `strict_model`), 400 for top_logprobs > 0 (engines return only the sampled token's
        logprob), an empty stop string, or a tool_choice that forces a tool without tools / names
        an undeclared one.
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
        choice = conv.tool_choice
        names = [t.name for t in conv.tools]
        if choice not in ("auto", "none") and not conv.tools:
            raise unsupported(conv.param("tool_choice"), f"{choice!r} needs tools")
        if isinstance(choice, ForcedTool) and choice.name not in names:
            raise unsupported(conv.param("tool_choice"),
                              f"tool {choice.name!r} is not among the declared tools {names}")
        return () if choice == "none" else conv.tools

    def sampling_params(
        self, session: Session, conv: Conversation, prompt_len: int
    ) -> SamplingParams:
        """Session overrides > request > gateway defaults; max_tokens clamped to the context.

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
            raise GatewayError(400, f"prompt has {prompt_len} tokens; max_model_len is "
                               f"{self.engine.max_model_len}", "context_length_exceeded",
                               conv.param("messages"))
        temperature = next(
            t for t in (session.temperature, s.temperature, self.temperature) if t is not None
        )
        wanted = next(
            m for m in (session.max_tokens, s.max_tokens, self.max_tokens) if m is not None
        )
        seed = s.seed if s.seed is not None or session.seed is None else (
            (session.seed + len(session.turns)) % 2**63)
        return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=min(wanted, room),
                              stop_token_ids=(self.renderer.end_of_turn_id,), seed=seed)

    def prefill(self, conv: Conversation) -> str:
        """Reply text put after the generation prompt: the opening of a tool call when
        tool_choice is "required" or names a tool, else "". Its ids are prompt ids (never
        trained); the engine cannot constrain the rest, so a malformed call comes back as text
        and counts in `tool_parse_errors`."""
        choice = conv.tool_choice
        if choice == "required":
            return self.renderer.tool_call_prefix(None)
        return self.renderer.tool_call_prefix(choice.name) if isinstance(choice, ForcedTool) else ""

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
            self.counters["engine_errors"] += 1
            log.exception("engine failed on trajectory %s", session.trajectory_id)
            raise GatewayError(500, f"engine error: {type(e).__name__}: {e}", "engine_error",
                               type="server_error") from e

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
        tools = self.check(conv)
        if plan is None:
            plan = session.plan(conv.messages, tools, self.renderer)
        prefix = self.prefill(conv)
        prompt_ids = plan.prompt_ids + self.renderer.encode(prefix)
        base = self.sampling_params(session, conv, len(prompt_ids))
        params = [base if base.seed is None else dataclasses.replace(
            base, seed=(base.seed + i) % 2**63) for i in range(conv.n)]
        self.counters["requests"] += 1
        started_at = time.time()
        weight_version = self.engine.weight_version  # stamped right before dispatch
        outs = await self.generate(session, prompt_ids, params)
        ended_at = time.time()
        closes = (self.renderer.call_close,) if tools and not conv.parallel_tool_calls else ()
        declared = {t.name for t in tools} if tools else None
        choices = []
        for i, (out, p) in enumerate(zip(outs, params, strict=True)):
            cut = cut_at_stop(self.renderer.decode, out.completion_ids,
                              self.renderer.end_of_turn_id, prefix, conv.sampling.stop, closes)
            reply, finish, errors = finish_reply(cut, out.finish_reason, declared)
            self.counters["tool_parse_errors"] += len(errors)
            self.counters["tokens_after_stop"] += len(out.completion_ids) - cut.keep
            k = cut.keep
            completion = Completion(
                prompt_ids=prompt_ids, completion_ids=list(out.completion_ids[:k]),
                logprobs=list(out.logprobs[:k]), weight_versions=list(out.weight_versions[:k]),
                weight_version=weight_version, finish_reason=finish, sampling=p,
                started_at=started_at, ended_at=ended_at, extends_previous=plan.extends_previous)
            choices.append(Choice(i, completion, reply,
                                  self.token_logprobs(completion) if conv.logprobs else None))
        self.record(session, conv, tools, plan, choices)
        return Result(choices, len(prompt_ids), started_at)

    def record(self, session: Session, conv: Conversation, tools: tuple[Tool, ...],
               plan: PromptPlan, choices: list[Choice]) -> None:
        """Add every choice to the trajectory in the pool, then to the session's turn tree.

        Raises GatewayError 409 when the pool refuses (the trajectory ended meanwhile).
        """
        for c in choices:
            try:
                self.pool.add_completion(session.trajectory_id, c.completion)
            except (KeyError, ValueError) as e:
                raise GatewayError(409, f"trajectory {session.trajectory_id} takes no "
                                   f"completions: {e}", "trajectory_not_running") from e
            self.counters["completion_tokens"] += len(c.completion.completion_ids)
        if plan.extends_previous:
            self.counters["prefix_hits"] += 1
        elif session.turns:
            self.counters["prefix_misses"] += 1
        session.record([Turn(conv.messages, tools, c.completion.prompt_ids,
                             c.completion.completion_ids, c.reply, plan.parent) for c in choices],
                       plan.extends_previous)

    def token_logprobs(self, completion: Completion) -> list[TokenLogprob]:
        """The recorded logprob of every kept sampled id, a final end-of-turn id excluded."""
        ids, lps = completion.completion_ids, completion.logprobs
        if ids and ids[-1] == self.renderer.end_of_turn_id:
            ids, lps = ids[:-1], lps[:-1]
        texts = [self.renderer.decode([i]) for i in ids]
        return [TokenLogprob(t, lp, tuple(t.encode())) for t, lp in zip(texts, lps, strict=True)]

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> GatewayServer:
        """Start the HTTP app (app.py) inside the running event loop; port 0 picks a free port."""
        from forgerl.gateway.app import GatewayServer, create_app

        server = GatewayServer(create_app(self), host, port)
        await server.start()
        return server
