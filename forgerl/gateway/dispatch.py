"""Dispatch one prepared call to the rollout engine: all choices at once, whole or streamed.

Data flow: a `Call` (prepare.py) --> `generate`: one `engine.generate` per choice, gathered -->
the outputs that record.py cuts and records. Streaming (`Gateway.stream`, core.py): one
`choice_events` per choice over `engine.stream` (an engine without it is replayed from
`generate`), merged (`merged`) into `Delta`s as the engine samples: each choice's text goes
through its `ReplyStream` / `HeldReply` (`reply_stream`, renderers/replies.py) so a delta goes
out once it is certain and a stop string closes that choice's engine stream at once. Any engine
failure is a 500 `engine_error` (`engine_error`); every engine call of the failed or
cancelled call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from forgerl.engines.base import RolloutEngine, TokenEvent
from forgerl.gateway.conversation import ToolCall
from forgerl.gateway.errors import GatewayError
from forgerl.gateway.prepare import Call
from forgerl.gateway.record import TokenLogprob, token_logprob, without_stop_text
from forgerl.gateway.renderers.reasoning import Reasoning, StreamState, ThinkStream
from forgerl.gateway.renderers.renderer import Renderer
from forgerl.gateway.renderers.replies import HeldReply, IncrementalDecoder, ReplyStream
from forgerl.gateway.sessions import Session
from forgerl.types import GenerateOutput, SamplingParams

log = logging.getLogger(__name__)


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
    reasoning: a reasoning delta (text and tool_call empty then); the reasoning deltas of a
        choice join to its reply's reasoning.
    """

    index: int
    text: str = ""
    tool_call: ToolCall | None = None
    call_index: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None
    sampled_at: float = 0.0
    reasoning: str = ""


def engine_error(counters: dict[str, int], session: Session, e: Exception) -> GatewayError:
    """Count (`engine_errors`) and log an engine failure; the 500 `engine_error` to raise."""
    counters["engine_errors"] += 1
    session.engine_errors += 1
    log.exception("engine failed on trajectory %s", session.trajectory_id)
    return GatewayError(500, f"engine error: {type(e).__name__}: {e}", "engine_error",
                        type="server_error")


async def generate(engine: RolloutEngine, counters: dict[str, int], session: Session,
                   prompt_ids: list[int], params: list[SamplingParams]) -> list[GenerateOutput]:
    """One engine call per choice, at once; all are cancelled when one fails or this call is
    cancelled (a client disconnect). Raises GatewayError 500 `engine_error`."""
    tasks = [asyncio.ensure_future(engine.generate(prompt_ids, p)) for p in params]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException as e:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not isinstance(e, Exception):
            raise
        raise engine_error(counters, session, e) from e


async def merged(sources: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
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


def reply_stream(call: Call, renderer: Renderer) -> StreamState:
    """The stream state of one choice: tool calls are sent as each block closes; formats
    without a closing string (llama3_json, mistral) are parsed when the reply ends; the reply's
    reasoning (`renderer.reasoning`, none after a prefill) is split off in front."""
    stops, parser = call.conv.sampling.stop, renderer.parser
    state: StreamState
    if call.declared is not None and parser.open is None:
        state = HeldReply(ReplyStream(call.prefix, stops, call.closes, None, "", ""), parser,
                          call.declared)
    else:
        state = ReplyStream(call.prefix, stops, call.closes, call.declared, parser.open or "",
                            parser.close or "", parser.parse)
    fmt = None if call.prefix else renderer.reasoning
    return ThinkStream(state, fmt, stops) if fmt is not None else state


async def choice_events(engine: RolloutEngine, renderer: Renderer, counters: dict[str, int],
                        session: Session, i: int, call: Call, state: StreamState,
                        ) -> AsyncIterator[Delta | tuple[int, GenerateOutput]]:
    """One choice: engine events -> deltas, then (i, the output to cut and record)."""
    decoder = IncrementalDecoder(renderer.decode)
    ids: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    sent = calls = 0  # tokens whose logprobs went out with a delta; tool calls sent
    out: GenerateOutput | None = None
    events = engine_stream(engine, call.prompt_ids, call.params[i])
    try:
        async with contextlib.aclosing(events):
            async for ev in events:
                if isinstance(ev, GenerateOutput):
                    out = ev
                    pieces = state.feed(decoder.flush() + untold(renderer, ids, ev.text))
                    pieces += state.finish()
                else:
                    ids.append(ev.token_id)
                    lps.append(ev.logprob)
                    versions.append(ev.weight_version)
                    pieces = state.feed(decoder.push(ev.token_id))
                eot = 1 if ids and ids[-1] in renderer.stop_ids else 0
                at = ev.sampled_at if isinstance(ev, TokenEvent) else time.perf_counter()
                for piece in pieces:
                    if isinstance(piece, Reasoning):
                        yield Delta(i, "", None, 0, None, at, piece.text)
                        continue
                    if isinstance(piece, ToolCall):
                        yield Delta(i, "", piece, calls, None, at)
                        calls += 1
                        continue
                    lp = None
                    if call.conv.logprobs and not state.stopped and out is None:
                        lp = tuple(token_logprob(renderer, t, x) for t, x in
                                   zip(ids[sent:len(ids) - eot], lps[sent:], strict=False))
                        sent = len(ids) - eot
                    yield Delta(i, piece, None, 0, lp, at)
                if state.stopped:
                    break  # closes the engine stream: no compute past a stop string
    except Exception as e:
        raise engine_error(counters, session, e) from e
    if out is None or (state.stopped and out.text is None):
        out = GenerateOutput(ids, lps, versions, "stop" if state.stopped else "abort")
    yield i, out


def untold(renderer: Renderer, ids: list[int], text: str | None) -> str:
    """The part of a text-only output's `text` (GenerateOutput.text, CASES.md C01) that the
    streamed ids (`ids`, from before the engine lost them) did not already show; "" for an
    output with ids. A trailing stop token's text is left out."""
    if text is None:
        return ""
    text, shown = without_stop_text(renderer, text), renderer.decode(ids)
    return text[len(shown):] if text.startswith(shown) else text


def engine_stream(engine: RolloutEngine, prompt_ids: list[int], params: SamplingParams,
                  ) -> AsyncIterator[TokenEvent | GenerateOutput]:
    """`engine.stream`, or `replay` for an engine without it."""
    stream = getattr(engine, "stream", None)
    return stream(prompt_ids, params) if stream is not None else replay(engine, prompt_ids,
                                                                        params)


async def replay(engine: RolloutEngine, prompt_ids: list[int], params: SamplingParams,
                 ) -> AsyncIterator[TokenEvent | GenerateOutput]:
    """A finished `generate` as a stream (engines without `stream`)."""
    out = await engine.generate(prompt_ids, params)
    now = time.perf_counter()
    for t, lp, v in zip(out.completion_ids, out.logprobs, out.weight_versions, strict=True):
        yield TokenEvent(t, lp, v, now)
    yield out
