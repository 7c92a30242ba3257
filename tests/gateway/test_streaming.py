"""True token streaming through the gateway core (issue 10 item 5; CASES.md C06, C14).

Over real HTTP with the official `openai` client (`stream=True`) and a scripted engine whose
`stream` yields one id at a time (the byte tokenizer: one id per byte), it pins:
- deltas leave while the engine still decodes (the first content chunk arrives long before the
  last token is sampled);
- the record of a streamed call equals the plain call's for the same script (ids, logprobs,
  weight versions, finish reason, prompt), and the streamed content / tool calls reassemble to
  the plain reply (text, tool call, stop string, zero-argument calls C14, cut by max_tokens);
- a UTF-8 character split across ids comes out whole, each as soon as its last byte arrives;
- a stop string closes the engine stream as soon as it completes, and no text of it is sent;
- a client that disconnects mid-stream closes the engine stream, and nothing is recorded (an
  aborted call never becomes a trainable completion); the session's next call goes on;
- an engine without `stream` is replayed from `generate`, same record.
"""

from __future__ import annotations

import json
import time

import pytest

from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import Scripted, ScriptedEngine, reply

USER = [{"role": "user", "content": "hi"}]
GET_TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"id": {"type": "integer"}}}}}


def slow(scripted: Scripted, token_delay_s: float) -> Scripted:
    return Scripted(scripted.ids, scripted.logprobs, token_delay_s=token_delay_s)


def collect(stream) -> dict:
    """A chat chunk stream reassembled: content, tool calls by index, finish, chunk times."""
    content, calls, finish, times, deltas = "", {}, None, [], []
    for chunk in stream:
        times.append(time.perf_counter())
        for c in chunk.choices:
            if c.delta.content:
                content += c.delta.content
                deltas.append(c.delta.content)
            for tc in c.delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish,
            "times": times, "deltas": deltas}


def plain_and_streamed(srv, **kw):
    """The same request plain and streamed on two fresh sessions: (plain reply, streamed,
    plain record, streamed record)."""
    tid_a, key_a = srv.session(task_index=0)
    tid_b, key_b = srv.session(task_index=1)
    plain = srv.client(key_a).chat.completions.create(model="tiny", messages=USER, **kw)
    streamed = collect(srv.client(key_b).chat.completions.create(
        model="tiny", messages=USER, stream=True, **kw))
    (a,) = srv.pool.get_trajectory(tid_a).completions
    (b,) = srv.pool.get_trajectory(tid_b).completions
    return plain.choices[0], streamed, a, b


def assert_same_record(a, b) -> None:
    assert (a.prompt_ids, a.completion_ids, a.logprobs, a.weight_versions, a.weight_version,
            a.finish_reason, a.extends_previous) == (
        b.prompt_ids, b.completion_ids, b.logprobs, b.weight_versions, b.weight_version,
        b.finish_reason, b.extends_previous)


def test_first_delta_arrives_while_the_engine_decodes(serve, tokenizer):
    r = ChatMLRenderer(tokenizer)
    scripted = slow(reply(r, "twenty bytes of text"), 0.05)  # 21 ids, about 1 s in all
    srv = serve(ScriptedEngine([scripted]), tokenizer)
    _, key = srv.session()
    got = collect(srv.client(key).chat.completions.create(model="tiny", messages=USER,
                                                          stream=True))
    (events,) = srv.engine.streamed
    first_content = got["times"][0]
    assert events[-1].sampled_at - first_content > 0.5  # the first chunk came ~1 s earlier
    assert got["content"] == "twenty bytes of text" and len(got["deltas"]) == 20


@pytest.mark.parametrize("kw", [
    {},
    {"stop": ["END"]},
    {"stop": ["EN", "ND m"], "logprobs": True},
    {"max_tokens": 5},
    {"tools": [GET_TIME, LOOKUP]},
    {"tools": [GET_TIME, LOOKUP], "parallel_tool_calls": False},
], ids=["text", "stop", "two-stops-logprobs", "length", "tools", "one-call"])
def test_streamed_record_and_reply_equal_the_plain_ones(serve, tokenizer, kw):
    r = ChatMLRenderer(tokenizer)
    text = ('Sure. <tool_call>{"name": "lookup", "arguments": {"id": 7}}</tool_call> then END '
            'more <tool_call>{"name": "get_time"}</tool_call>')
    srv = serve(ScriptedEngine([reply(r, text), reply(r, text)]), tokenizer)
    plain, got, a, b = plain_and_streamed(srv, **kw)
    assert_same_record(a, b)
    assert got["content"] == (plain.message.content or "")
    assert got["finish"] == plain.finish_reason == a.finish_reason
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        (c.function.name, c.function.arguments) for c in plain.message.tool_calls or ()]
    if kw.get("logprobs"):
        assert [t.logprob for t in plain.logprobs.content] == b.logprobs


def test_utf8_characters_split_across_ids_come_out_whole(serve, tokenizer):
    r = ChatMLRenderer(tokenizer)
    text = "héllo 日本 🙂!"
    scripted = reply(r, text)
    assert len(scripted.ids) == len(text.encode()) + 1  # one id per byte
    srv = serve(ScriptedEngine([scripted, scripted]), tokenizer)
    plain, got, a, b = plain_and_streamed(srv)
    assert_same_record(a, b)
    assert got["deltas"] == list(text)  # each character whole, as soon as its last byte came
    assert got["content"] == plain.message.content == text


def test_stop_string_closes_the_engine_stream_and_is_never_sent(serve, tokenizer):
    r = ChatMLRenderer(tokenizer)
    text = "a EN b END" + " after the stop" * 20
    srv = serve(ScriptedEngine([reply(r, text), slow(reply(r, text), 0.002)]), tokenizer)
    plain, got, a, b = plain_and_streamed(srv, stop=["END"])
    assert_same_record(a, b)
    assert got["content"] == plain.message.content == "a EN b "
    assert "E" not in "".join(got["deltas"][-1:]) and got["finish"] == "stop"
    produced = srv.engine.streamed[-1]
    assert len(produced) == len("a EN b END")  # not one id sampled past the stop string
    assert srv.engine.cancelled  # the engine stream was closed, not run to its end


@pytest.mark.parametrize("call", [
    '{"name": "get_time", "arguments": {}}',
    '{"name": "get_time"}',
    '{"name": "get_time", "arguments": null}',
], ids=["empty-object", "no-arguments", "null-arguments"])
def test_c14_zero_argument_call_streams_like_the_plain_one(serve, tokenizer, call):
    r = ChatMLRenderer(tokenizer)
    scripted = reply(r, f"<tool_call>{call}</tool_call> All done.")
    srv = serve(ScriptedEngine([scripted, scripted]), tokenizer)
    plain, got, a, b = plain_and_streamed(srv, tools=[GET_TIME, LOOKUP])
    assert_same_record(a, b)
    assert a.completion_ids == scripted.ids and b.logprobs == scripted.logprobs
    assert got["content"] == (plain.message.content or "")
    assert got["finish"] == plain.finish_reason
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        (c.function.name, c.function.arguments) for c in plain.message.tool_calls or ()]
    assert got["calls"] == [{"id": got["calls"][0]["id"], "name": "get_time", "arguments": "{}"}]
    assert got["finish"] == "tool_calls" and got["content"] == " All done."


def test_c14_zero_argument_call_then_a_call_with_arguments(serve, tokenizer):
    r = ChatMLRenderer(tokenizer)
    scripted = reply(r, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
                        '<tool_call>{"name": "lookup", "arguments": {"id": 7}}</tool_call>')
    srv = serve(ScriptedEngine([scripted, scripted]), tokenizer)
    plain, got, a, b = plain_and_streamed(srv, tools=[GET_TIME, LOOKUP])
    assert_same_record(a, b)
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == [
        ("get_time", {}), ("lookup", {"id": 7})]
    assert got["calls"][0]["arguments"] == "{}" and got["content"] == ""  # no content delta
    assert plain.message.content is None and got["finish"] == "tool_calls"


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> All done.',
    'Let me see.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    "no call at all",
], ids=["tool-only", "call-then-text", "text-then-call", "text"])
def test_the_sdks_stream_helper_reassembles_the_plain_message(serve, tokenizer, text):
    """The openai SDK's own accumulator (`chat.completions.stream`) rebuilds the plain
    message: content null for a tool-only reply (the role chunk opens with content null when a
    call comes first), the text otherwise, and the same calls."""
    r = ChatMLRenderer(tokenizer)
    scripted = reply(r, text)
    srv = serve(ScriptedEngine([scripted, scripted]), tokenizer)
    _, key_a = srv.session(task_index=0)
    _, key_b = srv.session(task_index=1)
    kw = {"model": "tiny", "messages": USER, "tools": [GET_TIME, LOOKUP]}
    plain = srv.client(key_a).chat.completions.create(**kw).choices[0]
    with srv.client(key_b).chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.content == plain.message.content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or ()] == [
        (c.function.name, c.function.arguments) for c in plain.message.tool_calls or ()]
    assert final.finish_reason == plain.finish_reason
    assert (plain.message.content is None) == (text.startswith("<") and text.endswith(">"))


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 11, 12])
def test_c14_cut_inside_the_opener_shows_the_same_text(serve, tokenizer, max_tokens):
    r = ChatMLRenderer(tokenizer)
    scripted = reply(r, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> All done.')
    srv = serve(ScriptedEngine([scripted, scripted]), tokenizer)
    plain, got, a, b = plain_and_streamed(srv, tools=[GET_TIME], max_tokens=max_tokens)
    assert_same_record(a, b)
    assert got["finish"] == plain.finish_reason == "length"
    assert got["content"] == plain.message.content == r.decode(scripted.ids[:max_tokens])
    assert got["calls"] == []


def test_disconnect_mid_stream_closes_the_engine_stream_and_records_nothing(serve, tokenizer):
    r = ChatMLRenderer(tokenizer)
    first, last = reply(r, "one"), reply(r, "three")
    long = slow(reply(r, "x" * 200), 0.02)  # about 4 s if run to the end
    srv = serve(ScriptedEngine([first, long, last]), tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    answer = client.chat.completions.create(model="tiny", messages=USER)
    messages = [*USER, answer.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "again"}]
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True)
    seen = 0
    for chunk in stream:
        seen += sum(bool(c.delta.content) for c in chunk.choices)
        if seen == 3:
            break
    stream.close()  # the client goes away mid-stream
    started = time.monotonic()
    while not srv.engine.cancelled and time.monotonic() - started < 10:
        time.sleep(0.01)
    assert srv.engine.cancelled and time.monotonic() - started < 1.0
    produced = len(srv.engine.streamed[0])
    time.sleep(0.1)
    assert 3 <= produced < 50 and len(srv.engine.streamed[0]) == produced  # no more compute
    assert srv.gateway.counters["client_disconnects"] == 1
    (rec,) = srv.pool.get_trajectory(tid).completions  # only the first call
    assert rec.completion_ids == first.ids and len(srv.gateway.sessions.get(key).turns) == 1
    client.chat.completions.create(model="tiny", messages=messages)
    _, b = srv.pool.get_trajectory(tid).completions
    assert b.completion_ids == last.ids and b.extends_previous


class GenerateOnly:
    """A rollout engine without `stream` (other test doubles, older adapters)."""

    def __init__(self, engine: ScriptedEngine):
        self.inner = engine
        self.max_model_len, self.weight_version = engine.max_model_len, 0

    async def generate(self, prompt_ids, params):
        return await self.inner.generate(prompt_ids, params)


def test_engine_without_stream_is_replayed_from_generate(serve, tokenizer):
    r = ChatMLRenderer(tokenizer)
    scripted = reply(r, "héllo END there")
    srv = serve(GenerateOnly(ScriptedEngine([scripted, scripted])), tokenizer)
    plain, got, a, b = plain_and_streamed(srv, stop=["END"])
    assert_same_record(a, b)
    assert got["content"] == plain.message.content == "héllo "


class FailingAfter(ScriptedEngine):
    """stream() yields `n` tokens of its script, then the engine fails."""

    def __init__(self, script, n: int):
        super().__init__(script)
        self.n = n

    async def stream(self, prompt_ids, params):
        k = 0
        async for ev in super().stream(prompt_ids, params):
            if k == self.n:
                raise RuntimeError("forward failed")
            k += 1
            yield ev


@pytest.mark.parametrize("n", [0, 3])
def test_engine_error_is_an_openai_error_and_records_nothing(serve, tokenizer, n):
    import openai

    r = ChatMLRenderer(tokenizer)
    srv = serve(FailingAfter([reply(r, "hello there")], n), tokenizer)
    tid, key = srv.session()
    with pytest.raises(openai.APIError, match="engine error: RuntimeError: forward failed"):
        collect(srv.client(key).chat.completions.create(model="tiny", messages=USER,
                                                        stream=True))
    assert srv.pool.get_trajectory(tid).completions == []
    assert srv.gateway.counters["engine_errors"] == 1
    assert srv.gateway.counters["client_disconnects"] == 0
