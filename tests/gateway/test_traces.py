"""Traces of a session over real HTTP (issue 46 item 3): side calls are kept apart.

The served gateway (ScriptedEngine, real SQLite pool, the official openai clients) records each
call's `Completion.trace` and `train`: a call that extends a turn joins its trace, one that
extends none starts the next. Pins: a title call sent in parallel with the agent's first call
(OpenCode) and a compaction call between the agent's turns are traces of their own while the
agent's turns extend each other id for id in one trace; `[gateway] untrained_traces` records
the title trace untrained; an `untrained_models` name is served, listed and recorded untrained in
a trace of its own; a session whose only call was refused finishes failed ("no recorded call"),
never with its reward; the request's log entry gets its `trace`.
"""

from __future__ import annotations

import asyncio
import re

import httpx
from openai import AsyncOpenAI, NotFoundError

from forgerl.gateway import telemetry
from forgerl.gateway.conversation import Conversation, Message
from forgerl.trainer.samples import trajectory_to_samples_with_stats

from .conftest import ScriptedEngine, render, reply

AGENT = [{"role": "system", "content": "You are a coding agent."},
         {"role": "user", "content": "Fix the bug."}]
TITLE = [{"role": "system", "content": "You are a title generator. Reply with a title."},
         {"role": "user", "content": "Fix the bug."}]
COMPACT = [{"role": "system", "content": "Summarize the conversation so far."},
           {"role": "user", "content": "Fix the bug. / ok"}]


def said(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_side_calls_are_traces_of_their_own_and_the_agent_chain_extends(serve, tokenizer,
                                                                        renderer):
    script = [reply(renderer, x) for x in ("ok", "ok", "step two", "summary", "done")]
    for item in script[:2]:  # both first calls are in flight at once
        item.delay_s = 0.2
    srv = serve(ScriptedEngine(script), tokenizer,
                untrained_traces=(re.compile("^You are a title generator"),))
    tid, key = srv.session()
    turn2 = [*AGENT, said("ok"), {"role": "user", "content": "go on"}]
    turn3 = [*turn2, said("step two"), {"role": "user", "content": "finish"}]

    async def harness() -> None:
        async with AsyncOpenAI(base_url=srv.base_url, api_key=key, max_retries=0) as c:
            await asyncio.gather(c.chat.completions.create(model="tiny", messages=AGENT),
                                 c.chat.completions.create(model="tiny", messages=TITLE))
            await c.chat.completions.create(model="tiny", messages=turn2)
            await c.chat.completions.create(model="tiny", messages=COMPACT)
            await c.chat.completions.create(model="tiny", messages=turn3)

    asyncio.run(harness())
    srv.pool.finish_trajectory(tid, "finished", reward=1.0)
    turns = srv.pool.get_trajectory(tid).completions
    title = next(c for c in turns[:2] if c.prompt_ids == render(renderer, TITLE))
    first = next(c for c in turns[:2] if c is not title)
    second, compact, third = turns[2:]
    assert first.prompt_ids == render(renderer, AGENT)
    assert first.completion_ids == [*renderer.encode("ok"), renderer.end_of_turn_id]
    for prev, turn in ((first, second), (second, third)):  # id for id
        head = prev.prompt_ids + prev.completion_ids
        assert turn.prompt_ids[: len(head)] == head
    assert second.extends_previous and third.extends_previous
    assert first.trace == second.trace == third.trace
    assert sorted({first.trace, title.trace, compact.trace}) == [0, 1, 2]
    assert [c.train for c in (first, title, second, compact, third)] == [
        True, False, True, True, True]
    assert srv.gateway.counters["traces"] == 3 and srv.gateway.counters["prefix_hits"] == 2
    assert srv.gateway.counters["prefix_misses"] == 0  # side calls are no misses
    assert srv.gateway.sessions.get(key).prefix_misses == 0

    traj = srv.pool.get_trajectory(tid)
    samples, stats = trajectory_to_samples_with_stats(traj, [0.5] * 5)
    assert (len(samples), stats.extensions, stats.branches) == (2, 2, 0)
    agent, summary = samples if samples[0].input_ids[:len(first.prompt_ids)] == \
        first.prompt_ids else samples[::-1]
    assert agent.input_ids == third.prompt_ids + third.completion_ids  # one chain, id for id
    sampled = [i for i, m in enumerate(agent.loss_mask) if m]
    assert [agent.input_ids[i] for i in sampled] == (
        first.completion_ids + second.completion_ids + third.completion_ids)
    assert summary.input_ids == compact.prompt_ids + compact.completion_ids
    assert not any(s.input_ids[: len(title.prompt_ids)] == title.prompt_ids for s in samples)


def test_an_untrained_model_name_is_served_and_recorded_untrained(serve, tokenizer, renderer):
    script = [reply(renderer, x) for x in ("a", "short", "b")]
    srv = serve(ScriptedEngine(script), tokenizer, untrained_models=frozenset({"tiny-small"}))
    tid, key = srv.session()
    client = srv.client(key)
    assert [m.id for m in client.models.list()] == ["tiny", "tiny-small"]
    assert client.models.retrieve("tiny-small").id == "tiny-small"
    client.chat.completions.create(model="tiny", messages=AGENT)
    ask = [*AGENT, said("a"), {"role": "user", "content": "a title, please"}]
    client.chat.completions.create(model="tiny-small", messages=ask)
    go_on = [*AGENT, said("a"), {"role": "user", "content": "go on"}]
    client.chat.completions.create(model="tiny", messages=go_on)
    try:
        client.chat.completions.create(model="gpt-4o", messages=AGENT)
        raise AssertionError("an unknown model name was served")
    except NotFoundError as e:
        assert e.body["code"] == "model_not_found"
    main, small, after = srv.pool.get_trajectory(tid).completions
    # the small-model call reuses the agent's ids, but is kept out of the agent's trace
    assert small.extends_previous and small.prompt_ids[: len(main.prompt_ids)] == main.prompt_ids
    assert [c.trace for c in (main, small, after)] == [0, 1, 0]
    assert [c.train for c in (main, small, after)] == [True, False, True]
    assert srv.gateway.counters["traces"] == 2 and srv.gateway.counters["prefix_misses"] == 0


def test_a_session_whose_only_call_was_refused_is_failed_not_rewarded(serve, tokenizer,
                                                                      renderer):
    srv = serve(ScriptedEngine([reply(renderer, "5")]), tokenizer)
    opened = [httpx.post(f"{srv.base_url}/sessions", json={}, headers=srv.admin,
                         timeout=30).json() for _ in range(2)]
    for s, model in zip(opened, ("nope", "tiny"), strict=True):
        r = httpx.post(f"{srv.base_url}/chat/completions", json={"model": model,
                       "messages": AGENT}, headers={"Authorization": f"Bearer {s['api_key']}"},
                       timeout=30)
        assert r.status_code == (404 if model == "nope" else 200), r.text
    refused, answered = (httpx.post(f"{srv.base_url}/sessions/{s['session_id']}/reward",
                                    json={"reward": 1.0}, headers=srv.admin, timeout=30)
                         for s in opened)
    assert refused.status_code == 200 and refused.json() == {
        "session_id": opened[0]["session_id"], "status": "failed", "error": "no recorded call"}
    assert answered.json()["status"] == "finished"
    failed = srv.pool.get_trajectory(opened[0]["session_id"])
    assert (failed.status, failed.reward, failed.error, failed.completions) == (
        "failed", None, "no recorded call", [])
    done = srv.pool.get_trajectory(opened[1]["session_id"])
    assert (done.status, done.reward, len(done.completions)) == ("finished", 1.0, 1)


def test_the_request_log_entry_gets_the_trace(serve, tokenizer, renderer):
    srv = serve(ScriptedEngine([reply(renderer, "x"), reply(renderer, "y")]), tokenizer)
    _, key = srv.session()
    session = srv.gateway.sessions.get(key)

    async def call(text: str) -> dict:
        entry = telemetry.begin()
        await srv.gateway.complete(session, Conversation("tiny", (Message("user", text),)))
        return entry

    entries = [asyncio.run_coroutine_threadsafe(call(t), srv.loop).result(30) for t in "ab"]
    assert [e["trace"] for e in entries] == [0, 1]


def test_the_choices_of_one_call_share_its_trace_streamed_or_not(serve, tokenizer, renderer):
    script = [reply(renderer, x) for x in ("a", "b", "title", "c")]
    srv = serve(ScriptedEngine(script), tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    client.chat.completions.create(model="tiny", messages=AGENT, n=2)
    for _ in client.chat.completions.create(model="tiny", messages=TITLE, stream=True):
        pass
    go_on = [*AGENT, said("b"), {"role": "user", "content": "go on"}]  # continues choice 2
    for _ in client.chat.completions.create(model="tiny", messages=go_on, stream=True):
        pass
    turns = srv.pool.get_trajectory(tid).completions
    assert [c.trace for c in turns] == [0, 0, 1, 0]
    assert turns[3].extends_previous and turns[3].prompt_ids[: len(turns[1].prompt_ids) + 2] == \
        turns[1].prompt_ids + turns[1].completion_ids
