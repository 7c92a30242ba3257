"""Record one model call token-in-token-out: cut each choice, parse it, store it, answer it.

Data flow: the engine outputs of a `Call` (prepare.py, dispatch.py) --> `build_choices`: each
choice cut at its stop strings and parsed for tool calls (renderers/replies.py), one
`Completion` per choice with the kept sampled ids, logprobs and weight versions --> `record`:
durably into the data pool (group commit, group_commit.py) with a process event per tool-call
parse error, then into the session's turn tree (sessions.py) --> the `Choice`s of a `Result`
that the protocol answers in its wire format. The recorded ids never depend on the parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from forgerl.datapool.base import DataPool
from forgerl.gateway import telemetry
from forgerl.gateway.conversation import Message
from forgerl.gateway.errors import GatewayError
from forgerl.gateway.group_commit import GroupCommit
from forgerl.gateway.prepare import Call
from forgerl.gateway.renderers.reasoning import StreamState, split_reasoning
from forgerl.gateway.renderers.renderer import Renderer, token_text
from forgerl.gateway.renderers.replies import (
    cut_at_stop,
    cut_text,
    finish_reply,
)
from forgerl.gateway.sessions import Placement, Session, Turn
from forgerl.types import UNDELIVERED, Completion, GenerateOutput


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


def token_logprob(renderer: Renderer, token_id: int, logprob: float) -> TokenLogprob:
    """The token's own bytes (`Renderer.token_bytes`) and their text (`token_text`)."""
    raw = renderer.token_bytes(token_id)
    return TokenLogprob(token_text(raw), logprob, tuple(raw))


def token_logprobs(renderer: Renderer, completion: Completion) -> list[TokenLogprob]:
    """The recorded logprob of every kept sampled id, a final end-of-turn id excluded."""
    ids, lps = completion.completion_ids, completion.logprobs
    if ids and ids[-1] in renderer.stop_ids:
        ids, lps = ids[:-1], lps[:-1]
    return [token_logprob(renderer, i, lp) for i, lp in zip(ids, lps, strict=True)]


def without_stop_text(renderer: Renderer, text: str) -> str:
    """`text` less a trailing stop token written as text (a text-only engine answer)."""
    for token in renderer.tokenizer.convert_ids_to_tokens(list(renderer.stop_ids)):
        if token and text.endswith(token):
            return text[: -len(token)]
    return text


def build_choices(renderer: Renderer, counters: dict[str, int], call: Call,
                  outs: Sequence[GenerateOutput],
                  streamed: Sequence[StreamState] | None = None) -> list[Choice]:
    """Cut and parse the choices of `call` from the engine outputs (one per choice); counts
    `tool_parse_errors`, `tokens_after_stop` and `untokenized_replies`.

    An output with text but no ids (`GenerateOutput.text`, CASES.md C01) answers that text
    (less a trailing stop token's text) and is recorded with no completion ids, token_exact
    and train False, its text noted as the request's `untokenized_text`: never an empty
    token-exact turn, never ids re-encoded from the text with guessed logprobs.

    The reply's reasoning is split off first (`split_reasoning`, the renderer's format; none
    after a prefill); tool calls are parsed in the rest. `streamed`: the stream state of each
    choice; its reply (reasoning, content and tool calls, with the call ids the client saw)
    replaces the parsed one, the finish reason stays the parse's.
    """
    ended_at = time.time()
    choices = []
    for i, (out, p) in enumerate(zip(outs, call.params, strict=True)):
        stops, request = call.conv.sampling.stop, dict(call.conv.request)
        if out.text is not None:  # no ids: answered, recorded as context only (C01)
            counters["untokenized_replies"] += 1
            request["untokenized_text"] = out.text
            cut = cut_text(without_stop_text(renderer, out.text), call.prefix, stops,
                           call.closes)
        else:
            cut = cut_at_stop(renderer.decode, out.completion_ids, renderer.end_of_turn_id,
                              call.prefix, stops, call.closes)
        reasoning, text = split_reasoning(cut.text, None if call.prefix else renderer.reasoning)
        reply, finish, errors = finish_reply(dataclasses.replace(cut, text=text),
                                             out.finish_reason, call.declared,
                                             renderer.parser.parse)
        reply = dataclasses.replace(reply, reasoning=reasoning)
        if streamed is not None:
            reply = Message("assistant", streamed[i].content, tuple(streamed[i].calls),
                            reasoning=getattr(streamed[i], "reasoning", None) or None)
        counters["tool_parse_errors"] += len(errors)
        counters["tokens_after_stop"] += len(out.completion_ids) - cut.keep
        k = cut.keep
        completion = Completion(
            prompt_ids=call.prompt_ids, completion_ids=list(out.completion_ids[:k]),
            logprobs=list(out.logprobs[:k]), weight_versions=list(out.weight_versions[:k]),
            weight_version=call.weight_version, finish_reason=finish, sampling=p,
            started_at=call.started_at, ended_at=ended_at,
            extends_previous=call.plan.extends_previous, request=request,
            token_exact=out.text is None, train=out.text is None,
            routed_experts=out.routed_experts and out.routed_experts.cut(len(call.prompt_ids) + k))
        choices.append(Choice(i, completion, reply,
                              token_logprobs(renderer, completion) if call.conv.logprobs
                              else None, tuple(errors)))
    return choices


async def record(pool: DataPool, commits: GroupCommit, counters: dict[str, int],
                 session: Session, call: Call, choices: list[Choice],
                 place: Placement) -> None:
    """Durably add every choice to the trajectory in the pool (group commit, one
    transaction shared with the calls finishing at the same time), then to the session's
    turn tree; counts `completion_tokens`, `prefix_hits`, `prefix_misses` and `traces`.

    `place` (`Session.place`): every choice's `Completion.trace` is its trace, and a choice
    is trained only if its trace is (`Completion.train`); noted as the request's `trace`.

    Each tool-call parse error of a choice is a process event on its turn (kind
    `tool_error_kind`: "undeclared_tool" or "invalid_tool_call"), which `[reward] process`
    may weight. A call cancelled during the commit (its client left) is still recorded,
    and its turns get an `UNDELIVERED` event: the client never saw them (C17). Raises
    GatewayError 409 when the pool refuses (the trajectory ended meanwhile); nothing of the
    call is recorded then.
    """
    gone = False
    plan = call.plan
    for c in choices:
        c.completion.trace, c.completion.train = place.trace, place.train and c.completion.train
    telemetry.note(trace=place.trace)

    def committed(turns: list[int]) -> None:
        for c in choices:
            counters["completion_tokens"] += len(c.completion.completion_ids)
        counters["prefix_hits"] += plan.extends_previous
        counters["prefix_misses"] += place.miss
        counters["traces"] += place.new
        session.record([Turn(call.conv.messages, call.tools, c.completion.prompt_ids,
                             c.completion.completion_ids, c.reply, plan.parent, place.trace,
                             c.completion.token_exact,
                             call.conv.request.get("template_kwargs") or {})
                        for c in choices], place.miss)
        if gone:  # the client left during the commit: it never saw these answers
            for turn in turns:
                with contextlib.suppress(KeyError, ValueError):  # the trajectory ended
                    pool.add_event(session.trajectory_id, UNDELIVERED, turn=turn)

    try:
        await commits.record(
            session.trajectory_id, [c.completion for c in choices],
            [[tool_error_kind(e) for e in c.tool_errors] for c in choices], committed)
    except asyncio.CancelledError:
        gone = True
        raise
    except (KeyError, ValueError) as e:
        raise GatewayError(409, f"trajectory {session.trajectory_id} takes no "
                           f"completions: {e}", "trajectory_not_running") from e
