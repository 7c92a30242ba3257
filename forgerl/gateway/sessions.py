"""Sessions (one per API key) and their turn trees: token-in-token-out prompt building.

Data flow: an agent calls the gateway with a bearer key; the key names a session, the session
names a trajectory in the data pool. Each answered choice of a call is a `Turn` in the session's
turn tree (a call with n choices adds n sibling turns). Messages are the internal form
(conversation.py), whatever protocol the agent speaks. For a new request the session looks for
the most recent turn whose request messages are a message-level prefix of the new messages and
whose parsed reply equals the next new message; the new prompt is then that turn's exact prompt
+ completion ids followed by the renderer's continuation (`Renderer.continuation`: the rendering
of the remaining messages), so sampled ids are never re-encoded (CASES.md C01, C02). When no turn
matches (first call, or the agent rewrote its context), or the chat template does not extend
its earlier rendering (it rewrites earlier turns, e.g. drops their reasoning; logged once per
session), the prompt is rendered from scratch: a new root of the tree and a new trace (C02:
counted and reported, never silently patched).

Traces (`Session.place`): a call that extends a turn joins that turn's trace; one that extends
none starts the next trace (0, 1, ...): the first call, a harness's side calls (title,
compaction), a sub-agent, a fork. A trace is trained unless the call that started it names an
untrained model (`[gateway] untrained_models`) or its opening matches an `untrained_traces`
rule; an untrained-model call never joins a trained trace (it starts its own). A new trace is a
prefix miss only when its opening (leading system messages and the first other message) is an
earlier trace's: the session's own conversation, whose ids could not be reused (a context
rewrite, a template that rewrites turns, a retry). Another opening (a side call with its own
system prompt) is no miss. A raw prompt (no messages) has the empty opening.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from forgerl.gateway.conversation import ItemIds, Message, Tool
from forgerl.gateway.errors import GatewayError
from forgerl.gateway.renderers.renderer import Renderer, call_arguments

log = logging.getLogger(__name__)


def message_key(msg: Message) -> tuple[Any, ...]:
    """What must agree for two messages to count as the same turn: role, stripped content text,
    tool call names and parsed arguments. Call ids, tool_call_id and reasoning differ
    harmlessly between what the gateway answered and what an agent sends back."""
    calls = tuple(
        (c.name, json.dumps(call_arguments(c), sort_keys=True)) for c in msg.tool_calls
    )
    return (msg.role, msg.content.strip(), calls)


@dataclass
class Turn:
    """One answered request: what was asked, the exact ids, and the parsed reply.

    parent: index of the turn whose prompt + completion this turn's prompt extends (None: root).
    exact: False when the engine answered text without ids (no completion ids recorded): no
        later prompt extends this turn, it is rendered from the messages (CASES.md C01).
    template_kwargs: the chat template variables it was rendered with; a prompt rendered with
        others never extends it.
    """

    messages: Sequence[Message]
    tools: Sequence[Tool]
    prompt_ids: list[int]
    completion_ids: list[int]
    assistant: Message
    parent: int | None = None
    trace: int = 0
    exact: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """Where the turns of one call go (`Session.place`): their trace, whether they are trained,
    whether the call started that trace, and whether it counts as a prefix miss."""

    trace: int
    train: bool
    new: bool
    miss: bool


def opening(messages: Sequence[Message]) -> Sequence[Message]:
    """The leading system messages and the first other message (a trace's opening)."""
    n = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages) - 1)
    return messages[: n + 1]


def matches(rules: Sequence[re.Pattern[str]], messages: Sequence[Message]) -> bool:
    """Whether a rule finds (`re.search`) its pattern in the text of `opening(messages)`: the
    contents joined by newlines (system prompt first)."""
    text = "\n".join(m.content for m in opening(messages))
    return any(rule.search(text) for rule in rules)


@dataclass(frozen=True)
class PromptPlan:
    """The prompt ids for a request and how they were built. note: what became of the ids a
    client sent back (`Session.item_plan`), None when they agree with the record or none came."""

    prompt_ids: list[int]
    parent: int | None
    extends_previous: bool
    note: str | None = None


@dataclass
class Session:
    """One agent rollout: its trajectory, sampling overrides and turn tree.

    temperature: when set, overrides the request's. max_tokens: when set, caps the request's (an
        agent that asks for fewer tokens gets at most what it asked for).
    seed: when set, a request without its own seed samples with `seed + turns so far` (mod
        2**63): the same session replays the same per-turn seeds (reproducible rollouts).
    training: the session's completions are trained on (a turn sampled with top_p < 1, top_k,
        min_p or a penalty is kept as context by the trainer, CASES.md C04, C21).
    prefix_misses: calls that started a trace with the opening of an earlier one (module
        docstring). traces: per trace, its opening's message keys and whether it is trained;
        trace_policies: per trace, the policy it was asked of ([[policies]]).
    last_active: time.monotonic() of the latest model call's start or end (or the opening).
    in_flight: model calls of this session now running (an idle sweep never expires those).
    response_ids: ids a protocol answered with -> the index of the turn each names (Responses
        `previous_response_id`; a streamed answer's id is bound once its turn is recorded).
    """

    api_key: str
    trajectory_id: str
    temperature: float | None = None
    max_tokens: int | None = None
    training: bool = True
    seed: int | None = None
    turns: list[Turn] = field(default_factory=list)
    prefix_misses: int = 0
    traces: list[tuple[tuple[Any, ...], bool]] = field(default_factory=list)
    trace_policies: list[str] = field(default_factory=list)
    last_active: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    response_ids: dict[str, int] = field(default_factory=dict)
    template_miss_logged: bool = False
    engine_errors: int = 0
    """Model calls of this session the engine failed (answered 500 `engine_error`): an agent
    that then fails is an infrastructure abort (`agents.runner.infra_cause`)."""
    """A prompt of this session became a new trace because the template rewrote a turn."""

    def plan(self, messages: Sequence[Message], tools: Sequence[Tool], renderer: Renderer,
             item: ItemIds | None = None) -> PromptPlan:
        """Prompt ids for `messages`, reusing recorded ids when a turn is a true prefix (and
        ids sent back, `item_plan`). It always ends with the generation header (CASES.md C03)."""
        own = self._recorded(messages, tools, renderer)
        return own if item is None else self.item_plan(own, item, messages, tools, renderer)

    def item_plan(self, own: PromptPlan, item: ItemIds, messages: Sequence[Message],
                  tools: Sequence[Tool], renderer: Renderer) -> PromptPlan:
        """Ids sent back on reply `messages[item.index]` (NeMo-Gym): a recorded turn covering
        it or a later reply wins (`own`; differing ids noted). Else they are the record: their
        prompt + generation ids + the continuation, parent the turn with exactly those ids
        (None: a new trace, no miss); `own` when the template rewrites turns (noted). Raises
        GatewayError 400 for an id outside the vocabulary."""
        sent = [*item.prompt_ids, *item.generation_ids]
        if bad := [i for i in sent if not 0 <= i < len(renderer.tokenizer)][:1]:
            raise GatewayError(400, f"{item.param}: token id {bad[0]} is outside the "
                               "vocabulary", "invalid_value", item.param)
        if own.parent is not None and (n := len(self.turns[own.parent].messages)) >= item.index:
            turn = self.turns[own.parent]
            full = turn.prompt_ids + turn.completion_ids
            same = full[: len(sent)] == sent and (n > item.index or len(full) == len(sent))
            return own if same else replace(own, note=f"session record ({item.param} differs)")
        tail = renderer.continuation(messages[: item.index + 1], messages[item.index + 1:],
                                     tools, list(item.generation_ids))
        if tail is None:
            return replace(own, note=f"{item.param} unused (the template rewrites turns)")
        parent = next((i for i in range(len(self.turns) - 1, -1, -1)
                       if self.turns[i].prompt_ids + self.turns[i].completion_ids == sent), None)
        return PromptPlan(sent + tail, parent, True, f"from {item.param}")

    def _recorded(self, messages: Sequence[Message], tools: Sequence[Tool], renderer: Renderer
                  ) -> PromptPlan:
        keys = [message_key(m) for m in messages]
        for index in range(len(self.turns) - 1, -1, -1):
            turn = self.turns[index]
            n = len(turn.messages)
            if (
                turn.exact
                and 0 < n < len(messages)  # n = 0: a raw-prompt (/v1/completions) turn
                and tuple(turn.tools) == tuple(tools)
                and dict(turn.template_kwargs) == dict(renderer.template_kwargs)
                and [message_key(m) for m in turn.messages] == keys[:n]
                and message_key(turn.assistant) == keys[n]
            ):
                tail = renderer.continuation(messages[: n + 1], messages[n + 1 :], tools,
                                             turn.completion_ids)
                if tail is not None:
                    ids = turn.prompt_ids + turn.completion_ids + tail
                    return PromptPlan(ids, index, True)
                if not self.template_miss_logged:
                    self.template_miss_logged = True
                    log.warning("session %s: the chat template rewrites earlier turns; the "
                                "prompt starts a new trace (counted in prefix_misses)",
                                self.trajectory_id)
        return PromptPlan(renderer.render(messages, tools), None, False)

    def place(self, plan: PromptPlan, messages: Sequence[Message], trained_model: bool = True,
              rules: Sequence[re.Pattern[str]] = (), policy: str = "") -> Placement:
        """The trace of a call planned as `plan` (module docstring), started here when new.

        trained_model: False for a call naming an untrained model. rules: compiled
        `untrained_traces` patterns, matched (`matches`) against a new trace's opening.
        policy: the policy the call asked for ([[policies]]); a call joins only a trace of its
        own policy (one that extends another policy's turn starts its own trace)."""
        if plan.parent is not None:
            trace = self.turns[plan.parent].trace
            same_policy = self.trace_policies[trace] == policy
            if (trained_model or not self.traces[trace][1]) and same_policy:
                return Placement(trace, self.traces[trace][1], False, False)
        key = tuple(message_key(m) for m in opening(messages))
        miss = not plan.extends_previous and any(k == key for k, _ in self.traces)
        self.traces.append((key, trained_model and not matches(rules, messages)))
        self.trace_policies.append(policy)
        return Placement(len(self.traces) - 1, self.traces[-1][1], True, miss)

    def record(self, turns: Sequence[Turn], miss: bool) -> None:
        """Add the answered turns of one call (one per choice, each its own branch from the
        same parent, all in one trace); `miss`: the call counts as one prefix miss."""
        self.prefix_misses += miss
        self.turns.extend(turns)


class SessionStore:
    """Sessions keyed by API key (the bearer token); one gateway multiplexes many sessions."""

    def __init__(self) -> None:
        self._by_key: dict[str, Session] = {}

    def create(
        self,
        trajectory_id: str,
        temperature: float | None = None,
        max_tokens: int | None = None,
        training: bool = True,
        seed: int | None = None,
    ) -> str:
        """Open a session for a trajectory; returns its new API key."""
        api_key = f"sk-forgerl-{secrets.token_hex(16)}"
        self._by_key[api_key] = Session(api_key, trajectory_id, temperature, max_tokens, training,
                                        seed)
        return api_key

    def get(self, api_key: str) -> Session | None:
        """The open session for a key, or None."""
        return self._by_key.get(api_key)

    def find(self, trajectory_id: str) -> Session | None:
        """The open session of a trajectory, or None."""
        return next((s for s in self._by_key.values() if s.trajectory_id == trajectory_id), None)

    def close(self, api_key: str) -> Session | None:
        """Forget a session (its key stops working); returns it, or None if unknown."""
        return self._by_key.pop(api_key, None)

    def open(self) -> list[Session]:
        """Every open session (a snapshot: closing one while iterating is safe)."""
        return list(self._by_key.values())

    def __len__(self) -> int:
        return len(self._by_key)
