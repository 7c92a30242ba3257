"""POST /v1/responses with `stream: true` streams token by token (issue 10 items 2 and 5).

Over real HTTP with the official `openai` client and a scripted engine, it pins:
- true streaming: `response.created` and the first `response.output_text.delta` reach the client
  while the engine is held before its last token (the engine waits on an Event that the test sets
  only after it saw the first delta, so the check does not depend on timing);
- the record of a streamed call equals the plain call's for the same script (CASES.md C06), and
  the final streamed response equals the plain response (ids aside; a message that starts after a
  call follows it, in generation order); the events reassemble to it (text deltas, whole tool
  call arguments, each output_item.done item = the final item at its output_index, sequence
  numbers 0..n-1); zero-argument calls and cuts inside the opener (C14);
- `previous_response_id` naming a streamed response continues its turn (C16: turn 2's prompt is
  turn 1's prompt + completion ids + the tool turn);
- a client that disconnects mid-stream aborts the engine stream, the call is not recorded (as
  for chat, test_streaming.py) and its response id names nothing; the session goes on;
- an engine failure mid-stream is an error the SDK raises; openai-agents' streamed runner works.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import openai
import pytest

from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import ScriptedEngine, reply
from .test_responses import CALL, FLAT, tool_turn
from .test_streaming import FailingAfter, assert_same_record

GET_TIME = {"type": "function", "name": "get_time",
            "parameters": {"type": "object", "properties": {}}}
LOOKUP = {"type": "function", "name": "lookup",
          "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}}
TEXT = ('Sure. <tool_call>{"name": "lookup", "arguments": {"id": 7}}</tool_call> then more '
        '<tool_call>{"name": "get_time"}</tool_call>')
ZERO_ARGS = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> All done.'


class Gated(ScriptedEngine):
    """stream() yields its first `before` ids, samples one more and holds it until the test sets
    `gate` (10 s at most; `timed_out` says it gave up): `streamed` has `before` + 1 events then."""

    def __init__(self, script, before: int):
        super().__init__(script)
        self.before, self.gate, self.timed_out = before, threading.Event(), False

    async def stream(self, prompt_ids, params):
        async with contextlib.aclosing(super().stream(prompt_ids, params)) as inner:
            k = 0
            async for ev in inner:
                if k == self.before:
                    deadline = time.monotonic() + 10
                    while not self.gate.is_set() and not self.timed_out:
                        self.timed_out = time.monotonic() > deadline
                        await asyncio.sleep(0.002)
                k += 1
                yield ev


def test_events_leave_before_the_engine_samples_its_last_token(serve, tokenizer):
    scripted = reply(ChatMLRenderer(tokenizer), "Hello there.")
    srv = serve(Gated([scripted], before=2), tokenizer)
    _, key = srv.session()
    seen: dict[str, int] = {}
    with srv.client(key).responses.stream(model="tiny", input="hi") as stream:
        for e in stream:
            if e.type not in seen:
                seen[e.type] = len(srv.engine.streamed[0]) if srv.engine.streamed else 0
            if e.type == "response.output_text.delta":
                srv.engine.gate.set()
        final = stream.get_final_response()
    assert not srv.engine.timed_out and final.output_text == "Hello there."
    assert seen["response.created"] <= 3 and seen["response.output_text.delta"] <= 3
    assert len(srv.engine.streamed[0]) == len(scripted.ids) > 3


def streamed_call(client, **kw) -> tuple[list, dict]:
    """(events, final response as a dict) of one `stream=True` call."""
    events = list(client.responses.create(model="tiny", stream=True, **kw))
    return events, events[-1].response.model_dump()


def normal(resp: dict) -> dict:
    """A response with its id, item ids, call ids and creation time replaced, items by id."""
    text = json.dumps(resp).replace(resp["id"][5:], "TAG")
    calls = [o["call_id"] for o in resp["output"] if o["type"] == "function_call"]
    for k, call_id in enumerate(calls):
        text = text.replace(call_id, f"CALL{k}")
    out = json.loads(text)
    out.pop("created_at")
    out["output"].sort(key=lambda o: o["id"])
    return out


def assert_events_build(events: list, final: dict) -> None:
    """The events are numbered 0.., open items at 0.., and reassemble to `final`."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.id == final["id"] and events[0].response.status == "in_progress"
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in added] == list(range(len(final["output"])))
    assert [e.item.model_dump() for e in sorted(done, key=lambda e: e.output_index)] == \
        final["output"]
    for k, item in enumerate(final["output"]):
        if item["type"] == "message":
            deltas = [e for e in events if e.type == "response.output_text.delta"
                      and e.output_index == k]
            part = item["content"][0]
            assert "".join(e.delta for e in deltas) == part["text"]
            lps = [t.model_dump() for e in deltas for t in e.logprobs]
            assert lps == part["logprobs"][: len(lps)]
        else:
            (args,) = [e.delta for e in events if e.type.endswith("arguments.delta")
                       and e.output_index == k]
            assert args == item["arguments"]
    assert events[-1].type == f"response.{final['status']}" and final["usage"]["total_tokens"]


@pytest.mark.parametrize(("text", "kw"), [
    ("Hello there, héllo 日本 🙂!", {}),
    ("Hello there.", {"include": ["message.output_text.logprobs"]}),
    ("a long answer", {"max_output_tokens": 5}),
    (TEXT, {"tools": [GET_TIME, LOOKUP]}),
    (TEXT, {"tools": [GET_TIME, LOOKUP], "parallel_tool_calls": False,
            "include": ["message.output_text.logprobs"]}),
    (ZERO_ARGS, {"tools": [GET_TIME, LOOKUP]}),
    ('<tool_call>{"name": "get_time"}</tool_call>', {"tools": [GET_TIME]}),
    ('<tool_call>{"name": "get_time", "arguments": null}</tool_call>\n<tool_call>{"name": '
     '"lookup", "arguments": {"id": 7}}</tool_call>', {"tools": [GET_TIME, LOOKUP]}),
    (ZERO_ARGS, {"tools": [GET_TIME], "max_output_tokens": 4}),
    ("", {}),
], ids=["text", "logprobs", "length", "tools", "one-call", "c14-zero-args", "c14-no-args",
        "c14-two-calls", "c14-cut-in-opener", "empty"])
def test_streamed_record_and_response_equal_the_plain_ones(serve, tokenizer, text, kw):
    scripted = reply(ChatMLRenderer(tokenizer), text)
    srv = serve(ScriptedEngine([scripted, scripted]), tokenizer)
    (tid_a, key_a), (tid_b, key_b) = srv.session(task_index=0), srv.session(task_index=1)
    plain = srv.client(key_a).responses.create(model="tiny", input="hi", **kw).model_dump()
    events, final = streamed_call(srv.client(key_b), input="hi", **kw)
    (a,) = srv.pool.get_trajectory(tid_a).completions
    (b,) = srv.pool.get_trajectory(tid_b).completions
    assert_same_record(a, b)
    assert a.completion_ids == scripted.ids[: len(a.completion_ids)] and a.completion_ids
    assert normal(final) == normal(plain)
    assert_events_build(events, final)
    if text == ZERO_ARGS and "max_output_tokens" not in kw:  # C14: the call, then the text
        assert [(o["type"], o.get("arguments")) for o in final["output"]] == [
            ("function_call", "{}"), ("message", None)]
        assert final["output"][1]["content"][0]["text"] == " All done."


def test_previous_response_id_continues_a_streamed_response(serve, tokenizer):
    """C16 with streamed turns: turn 2 names turn 1 by the id its stream opened with."""
    r = ChatMLRenderer(tokenizer)
    script = [reply(r, CALL), reply(r, "It is sunny."), reply(r, "ok")]
    srv = serve(ScriptedEngine(script), tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    events, r1 = streamed_call(client, input="Weather in Paris?", tools=[FLAT],
                               instructions="Use the tool.")
    (call,) = r1["output"]
    assert events[0].response.id == r1["id"] and call["type"] == "function_call"
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    _, r2 = streamed_call(client, input=[output], tools=[FLAT], instructions="Use the tool.",
                          previous_response_id=r1["id"])
    assert r2["output"][0]["content"][0]["text"] == "It is sunny."
    first, second = srv.pool.get_trajectory(tid).completions
    assert second.prompt_ids == first.prompt_ids + first.completion_ids + tool_turn(
        srv, call["call_id"], "sunny")
    assert second.extends_previous and srv.gateway.sessions.get(key).prefix_misses == 0
    plain = client.responses.create(model="tiny", input="again", previous_response_id=r2["id"],
                                    tools=[FLAT], instructions="Use the tool.")  # not carried
    assert plain.output_text == "ok"
    assert srv.pool.get_trajectory(tid).completions[2].extends_previous


def test_disconnect_mid_stream_aborts_the_engine_and_records_nothing(serve, tokenizer):
    r = ChatMLRenderer(tokenizer)
    first, last = reply(r, "one"), reply(r, "three")
    srv = serve(Gated([first, reply(r, "x" * 200), last], before=3), tokenizer)
    srv.engine.gate.set()  # the first call runs freely
    tid, key = srv.session()
    client = srv.client(key)
    r1 = client.responses.create(model="tiny", input="hi")
    srv.engine.gate.clear()
    stream = client.responses.create(model="tiny", input="again", stream=True,
                                     previous_response_id=r1.id)
    rid = None
    for e in stream:
        rid = rid or e.response.id
        if e.type == "response.output_text.delta":
            break
    stream.close()  # the client goes away mid-stream, the engine held at its 4th token
    started = time.monotonic()
    while len(srv.engine.cancelled) < 1 and time.monotonic() - started < 10:
        time.sleep(0.01)
    assert srv.engine.cancelled and time.monotonic() - started < 1.0
    assert len(srv.engine.streamed[0]) <= 4 and not srv.engine.timed_out
    assert srv.gateway.counters["client_disconnects"] == 1
    (rec,) = srv.pool.get_trajectory(tid).completions  # only the first call
    assert rec.completion_ids == first.ids and len(srv.gateway.sessions.get(key).turns) == 1
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="tiny", input="x", previous_response_id=rid)
    srv.engine.gate.set()
    r2 = client.responses.create(model="tiny", input="again", previous_response_id=r1.id)
    a, b = srv.pool.get_trajectory(tid).completions
    assert r2.output_text == "three" and b.extends_previous
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == (
        a.prompt_ids + a.completion_ids)


def test_engine_error_mid_stream_is_raised_by_the_sdk(serve, tokenizer):
    """The failure is a Responses `error` event (type, code, message, param, the next
    sequence_number; it was a bare chat-style `data: {"error": ...}`), whose `error` object the
    openai SDK raises."""
    import httpx

    renderer = ChatMLRenderer(tokenizer)
    srv = serve(FailingAfter([reply(renderer, "hello there")] * 2, 3), tokenizer)
    tid, key = srv.session()
    with pytest.raises(openai.APIError, match="engine error: RuntimeError: forward failed"):
        list(srv.client(key).responses.create(model="tiny", input="hi", stream=True))
    assert srv.pool.get_trajectory(tid).completions == []
    r = httpx.post(f"{srv.base_url}/responses", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "tiny", "input": "hi", "stream": True}, timeout=30)
    blocks = [b for b in r.text.split("\n\n") if b]
    last = json.loads(blocks[-1].split("data: ", 1)[1])
    before = json.loads(blocks[-2].split("data: ", 1)[1])
    assert blocks[-1].startswith("event: error\n") and last["type"] == "error"
    assert last["sequence_number"] == before["sequence_number"] + 1
    assert (last["code"], last["error"]["code"]) == ("engine_error", "engine_error")
    assert "forward failed" in last["message"]


def test_openai_agents_streamed_tool_loop(serve, tokenizer):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    r = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(r, CALL), reply(r, "It is sunny in Paris.")]), tokenizer)
    tid, key = srv.session()

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather])
    provider = agents.OpenAIProvider(openai_client=AsyncOpenAI(
        base_url=srv.base_url, api_key=key, max_retries=0), use_responses=True)
    config = agents.RunConfig(model="tiny", model_provider=provider, tracing_disabled=True)

    async def run() -> tuple[str, list[str]]:
        result = agents.Runner.run_streamed(agent, "Weather in Paris?", run_config=config)
        kinds = [e.data.type async for e in result.stream_events()
                 if e.type == "raw_response_event"]
        return result.final_output, kinds

    final, kinds = asyncio.run(run())
    assert final == "It is sunny in Paris." and "response.output_text.delta" in kinds
    assert kinds.count("response.completed") == 2
    first, second = srv.pool.get_trajectory(tid).completions
    assert second.extends_previous and second.prompt_ids[: len(first.prompt_ids)] == \
        first.prompt_ids
