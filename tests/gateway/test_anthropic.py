"""Anthropic Messages (POST /v1/messages, /v1/messages/count_tokens) over real HTTP with the
official `anthropic` client (issue 10 item 3).

Scripted engine, byte tokenizer (one id per ASCII character). Pins:
- messages.create: system as a string or text blocks renders as the chat system message; the
  record holds exactly the engine's ids and logprobs; usage counts the prompt and recorded ids;
  stop_reason end_turn / max_tokens / stop_sequence (+ the matched `stop_sequence`) / tool_use.
- a full tool loop (tool_use -> tool_result -> answer): turn 2's prompt is turn 1's prompt +
  completion ids + the tool result, `extends_previous`, no prefix miss; tool_choice any / tool /
  none prefill or drop the tool section as chat's required / named / none do.
- messages.stream (text; tool_use with input_json_delta), token by token through Gateway.stream
  (the first text_delta arrives while the engine samples): the SDK's final message equals the
  non-streamed one for any chunking, and the stream records the same ids; an engine failure
  mid-stream is an Anthropic `api_error` event.
- auth by `x-api-key` (with `anthropic-version`) as well as `Authorization: Bearer`; errors are
  `{"type": "error", "error": {"type", "message"}}`: unknown key 401 authentication_error, bad or
  refused bodies 400 invalid_request_error naming the field (what is accepted: test_policy.py),
  unknown model 404 not_found_error, GET 405; nothing is recorded by a failing call.
- count_tokens: the next call's prompt length (recorded ids reused), nothing recorded.
- thinking blocks map to the internal reasoning with the signature kept as sent; `is_error`.
- CASES.md C15: one tool in chat and Anthropic shapes, history holding its call, renders the
  same prompt ids; an invalid input_schema is a 400 naming the tool's field.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest

from forgerl.gateway.protocols import anthropic as wire

from .conftest import Scripted, ScriptedEngine, render, reply, served
from .test_tito import WEATHER, tool_call_text

TOOL = {"name": "get_weather", "description": "Weather in a city",
        "input_schema": WEATHER["function"]["parameters"]}
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = tool_call_text("get_weather", {"city": "Paris"})


def client(srv, key: str | None, **kw) -> anthropic.Anthropic:
    # ANTHROPIC_BASE_URL is the gateway root, without /v1 (the SDK appends /v1/messages)
    return anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key=key,
                               max_retries=0, timeout=60, **kw)


@pytest.mark.parametrize("system", ["Be brief.", [{"type": "text", "text": "Be brief."}]])
def test_create_records_engine_ids(serve, tokenizer, renderer, system):
    srv, tid, c = served(serve, tokenizer, ["Hello there"], client)
    r = c.messages.create(model="tiny", max_tokens=50, system=system, messages=USER,
                          metadata={"user_id": "u1"}, extra_body={"temperature": 0.5})
    assert r.type == "message" and r.role == "assistant" and r.model == "tiny"
    assert [b.model_dump(exclude_none=True) for b in r.content] == [
        {"type": "text", "text": "Hello there"}]
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    (rec,) = srv.pool.get_trajectory(tid).completions
    scripted = reply(renderer, "Hello there")
    prompt, params = srv.engine.calls[0]
    assert prompt == render(renderer, [{"role": "system", "content": "Be brief."}, *USER])
    assert rec.prompt_ids == prompt and params.temperature == 0.5 and params.max_tokens == 50
    assert rec.completion_ids == scripted.ids and rec.logprobs == scripted.logprobs
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(prompt), len(scripted.ids))


def test_top_k_and_top_p_are_sampled_with_and_recorded(serve, tokenizer, renderer):
    """Claude Code sends top_k: sampled with, recorded, a 200 on a training session (the trainer
    keeps the turn as context, CASES.md C21); the other parameters reach the engine neutral."""
    srv, tid, c = served(serve, tokenizer, ["Hi", "Ho"], client)
    # this SDK version no longer declares them (newer Claude models refuse them): extra_body
    c.messages.create(model="tiny", max_tokens=20, messages=USER,
                      extra_body={"top_k": 5, "top_p": 0.9})
    c.messages.create(model="tiny", max_tokens=20, messages=USER, extra_body={"top_k": 0})
    (_, sampled), (_, off) = srv.engine.calls
    assert (sampled.top_k, sampled.top_p, sampled.min_p, sampled.repetition_penalty,
            sampled.presence_penalty, sampled.frequency_penalty) == (5, 0.9, 0.0, 1.0, 0.0, 0.0)
    assert sampled.transforms() == ("top_p", "top_k") and off.transforms() == ()
    assert [r.sampling for r in srv.pool.get_trajectory(tid).completions] == [sampled, off]


def test_stop_reasons_max_tokens_and_stop_sequence(serve, tokenizer, renderer):
    srv, tid, c = served(serve, tokenizer, ["abcdefgh", "abc STOP def"], client)
    r = c.messages.create(model="tiny", max_tokens=3, messages=USER)
    assert r.content[0].text == "abc" and r.stop_reason == "max_tokens"
    r = c.messages.create(model="tiny", max_tokens=50, messages=USER,
                          stop_sequences=["nope", "STOP"])
    assert r.content[0].text == "abc " and r.stop_reason == "stop_sequence"
    assert r.stop_sequence == "STOP"
    rec = srv.pool.get_trajectory(tid).completions[1]
    assert rec.completion_ids == renderer.encode("abc STOP")  # the stop string stays recorded


def tool_loop(c, stream: bool = False):
    """Turn 1 asks, the model calls get_weather; turn 2 sends the tool_result. Returns both
    final messages."""
    def call(messages):
        kw = {"model": "tiny", "max_tokens": 100, "messages": messages, "tools": [TOOL]}
        if not stream:
            return c.messages.create(**kw)
        with c.messages.stream(**kw) as s:
            return s.get_final_message()

    r1 = call(USER)
    tool_use = r1.content[0]
    turn2 = [*USER, {"role": "assistant", "content": r1.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                           "content": [{"type": "text", "text": "sunny"}]}]}]
    return r1, call(turn2)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_loop_extends_previous_turn(serve, tokenizer, renderer, stream):
    srv, tid, c = served(serve, tokenizer, [CALL, "It is sunny."], client)
    r1, r2 = tool_loop(c, stream)
    assert r1.stop_reason == "tool_use" and len(r1.content) == 1
    use = r1.content[0]
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert r2.content[0].text == "It is sunny." and r2.stop_reason == "end_turn"
    first, second = srv.pool.get_trajectory(tid).completions
    assert first.completion_ids == reply(renderer, CALL).ids
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids)
    assert second.extends_previous and not first.extends_previous
    assert srv.gateway.sessions.get(c.api_key).prefix_misses == 0
    chat_history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "x", "content": "sunny"}]
    assert second.prompt_ids == render(renderer, chat_history, [WEATHER])  # byte tokenizer


@pytest.mark.parametrize("choice, prefix", [
    ({"type": "any"}, "<tool_call>\n"),
    ({"type": "tool", "name": "get_weather"},
     '<tool_call>\n{"name": "get_weather", "arguments": {'),
    ({"type": "none"}, None),
])
def test_tool_choice(serve, tokenizer, renderer, choice, prefix):
    srv, _, c = served(serve, tokenizer, ["ok"], client)
    c.messages.create(model="tiny", max_tokens=20, messages=USER, tools=[TOOL],
                      tool_choice=choice)
    prompt = srv.engine.calls[0][0]
    if prefix is None:
        assert prompt == render(renderer, USER)
    else:
        assert prompt == render(renderer, USER, [WEATHER]) + renderer.encode(prefix)


@pytest.mark.parametrize("text", ["Hello there", CALL])
def test_stream_final_message_equals_create(serve, tokenizer, renderer, text):
    srv = serve(ScriptedEngine([reply(renderer, text), reply(renderer, text)]), tokenizer)
    (t1, k1), (t2, k2) = srv.session(), srv.session()
    kw = {"model": "tiny", "max_tokens": 100, "messages": USER, "tools": [TOOL]}
    plain = client(srv, k1).messages.create(**kw)
    with client(srv, k2).messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    def dump(m):  # message and tool_use ids are fresh per call
        d = m.model_dump(exclude={"id"})
        return {**d, "content": [{**b, "id": None} if "id" in b else b for b in d["content"]]}

    assert dump(final) == dump(plain)
    kinds = [e.type for e in events if e.type.startswith(("message", "content_block"))]
    kinds = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # any chunking
    assert kinds == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    if text == CALL:
        assert [d.type for d in deltas] == ["input_json_delta"]
        assert json.loads(deltas[0].partial_json) == {"city": "Paris"}
    else:
        assert {d.type for d in deltas} == {"text_delta"}
        assert "".join(d.text for d in deltas) == text
    a, b = (srv.pool.get_trajectory(t).completions[0] for t in (t1, t2))
    assert (a.prompt_ids, a.completion_ids, a.logprobs) == (
        b.prompt_ids, b.completion_ids, b.logprobs)


def test_x_api_key_and_bearer_auth(serve, tokenizer, renderer):
    srv, tid, _ = served(serve, tokenizer, ["one", "two"], client)
    key = srv.gateway.sessions.find(tid).api_key
    url = srv.base_url + "/messages"
    body = {"model": "tiny", "max_tokens": 10, "messages": USER}
    r = httpx.post(url, json=body, headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
    assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "one"}]
    r = httpx.post(url, json=body, headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200 and len(srv.pool.get_trajectory(tid).completions) == 2
    for headers in ({"x-api-key": "sk-wrong"}, {}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 401 and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(srv, "sk-wrong").messages.create(**body)
    assert e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("extra, status, kind, names", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"top_k": -1}, 400, "invalid_request_error", "top_k"),
    ({"top_p": 1.5}, 400, "invalid_request_error", "top_p"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, 400,
     "invalid_request_error", "output_config.format"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}, 400,
     "invalid_request_error", "messages.0.content.0.type"),
    ({"messages": [*USER, {"role": "assistant", "content": "The answer is ("}]}, 400,
     "invalid_request_error", "messages.1"),
    ({"tools": [{"name": "get_weather", "input_schema": "city"}]}, 400, "invalid_request_error",
     "tools.0.input_schema"),
    ({"model": "claude-opus"}, 404, "not_found_error", "claude-opus"),
])
def test_errors_are_anthropic_shaped_and_record_nothing(serve, tokenizer, renderer, extra,
                                                        status, kind, names):
    srv, tid, c = served(serve, tokenizer, ["unused"], client)
    body = {"model": "tiny", "max_tokens": 10, "messages": USER, **extra}
    r = httpx.post(srv.base_url + "/messages", json={k: v for k, v in body.items()
                                                     if v is not None},
                   headers={"x-api-key": c.api_key})
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    assert r.json()["error"]["type"] == kind and names in r.json()["error"]["message"]
    assert srv.pool.get_trajectory(tid).completions == [] and srv.engine.calls == []
    with pytest.raises(anthropic.APIStatusError) as e:  # the SDK reads the same body
        c.messages.create(**{k: v for k, v in body.items() if k in ("model", "messages")},
                          max_tokens=10, extra_body={k: v for k, v in extra.items()
                                                     if k not in ("model", "messages")})
    assert e.value.status_code == status and e.value.body["error"]["type"] == kind
    r = httpx.get(srv.base_url + "/messages", headers={"x-api-key": c.api_key})
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_count_tokens_is_next_prompt_and_records_nothing(serve, tokenizer, renderer):
    srv, tid, c = served(serve, tokenizer, [CALL, "It is sunny."], client)
    count = c.messages.count_tokens(model="tiny", messages=USER, tools=[TOOL], system="S")
    assert count.input_tokens == len(render(renderer, [{"role": "system", "content": "S"},
                                                       *USER], [WEATHER]))
    assert srv.pool.get_trajectory(tid).completions == [] and srv.engine.calls == []
    r1 = c.messages.create(model="tiny", max_tokens=100, messages=USER, tools=[TOOL])
    turn2 = [*USER, {"role": "assistant", "content": r1.content},
             {"role": "user", "content": [{"type": "tool_result",
                                           "tool_use_id": r1.content[0].id, "content": "sunny"}]}]
    count = c.messages.count_tokens(model="tiny", messages=turn2, tools=[TOOL])
    assert len(srv.engine.calls) == 1
    r2 = c.messages.create(model="tiny", max_tokens=100, messages=turn2, tools=[TOOL])
    assert count.input_tokens == r2.usage.input_tokens == len(srv.engine.calls[1][0])


def test_thinking_signature_and_is_error_translate():
    body = {"model": "tiny", "max_tokens": 5, "messages": [
        *USER,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "need the tool", "signature": "sig-Zm9v"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout",
             "is_error": True},
            {"type": "text", "text": "Try again?", "cache_control": {"type": "ephemeral"}}]}]}
    _, conv = wire.parse(json.dumps(body).encode())
    _, assistant, tool, again = conv.messages
    assert (assistant.reasoning, assistant.reasoning_signature) == ("need the tool", "sig-Zm9v")
    assert assistant.content == "Checking." and assistant.tool_calls[0].id == "toolu_1"
    assert json.loads(assistant.tool_calls[0].arguments) == {"city": "Paris"}
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "toolu_1", "Error: timeout")
    assert (again.role, again.content) == ("user", "Try again?")


def test_c15_chat_and_anthropic_tool_render_identical_ids(serve, tokenizer, renderer):
    """CASES.md C15 (chat shape with strict and reordered keys, Anthropic shape): the same
    declared tool and the same call in history give identical prompt ids."""
    srv = serve(ScriptedEngine([reply(renderer, "a"), reply(renderer, "b")]), tokenizer)
    (_, k1), (_, k2) = srv.session(), srv.session()
    chat_tool = {"function": {"parameters": TOOL["input_schema"], "strict": False,
                              "description": TOOL["description"], "name": "get_weather"},
                 "type": "function"}
    srv.client(k1).chat.completions.create(model="tiny", tools=[chat_tool], messages=[
        *USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    client(srv, k2).messages.create(model="tiny", max_tokens=20, tools=[TOOL], messages=[
        *USER, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "sunny"}]}])
    chat_prompt, anthropic_prompt = (call[0] for call in srv.engine.calls)
    assert chat_prompt == anthropic_prompt
    assert '"arguments": {"city": "Paris"}' in renderer.decode(anthropic_prompt)


def test_engine_failure_in_a_stream_is_an_anthropic_error(serve, tokenizer):
    """An engine error while streaming reaches the SDK as an Anthropic `api_error` (an `error`
    event once the stream began, else a 500 body), and nothing is recorded."""
    srv = serve(ScriptedEngine([RuntimeError("GPU fell off")]), tokenizer)
    tid, key = srv.session()
    with pytest.raises(anthropic.APIStatusError) as e, client(srv, key).messages.stream(
            model="tiny", max_tokens=10, messages=USER) as s:
        s.get_final_message()
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"
    assert "GPU fell off" in e.value.body["error"]["message"]
    assert srv.pool.get_trajectory(tid).completions == []


def test_stream_sends_text_while_the_engine_decodes_then_tool_use(serve, tokenizer, renderer):
    """messages.stream goes through Gateway.stream: the first text_delta reaches the client
    while the engine still samples (~95 ids at 0.02 s each), a text block then a tool_use block,
    and the record equals what the engine streamed."""
    text = f"Let me check.{CALL}"
    scripted = reply(renderer, text)
    slow = Scripted(scripted.ids, scripted.logprobs, token_delay_s=0.02)
    srv = serve(ScriptedEngine([slow]), tokenizer)
    tid, key = srv.session()
    with client(srv, key).messages.stream(model="tiny", max_tokens=200, messages=USER,
                                          tools=[TOOL]) as s:
        first = None
        for event in s:
            if event.type == "content_block_delta" and first is None:
                first = time.perf_counter()
        final = s.get_final_message()
    (events,) = srv.engine.streamed
    assert events[-1].sampled_at - first > 0.5  # ~80 ids after the first delta
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me check." and final.stop_reason == "tool_use"
    assert final.content[1].input == {"city": "Paris"}
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert rec.completion_ids == scripted.ids and rec.logprobs == scripted.logprobs


def test_an_invalid_input_schema_is_a_400_naming_the_tool(serve, tokenizer, renderer):
    """CASES.md C15 on the Messages API: an `input_schema` that is not a JSON Schema is an
    Anthropic-shaped 400 naming the tool, and records nothing."""
    srv, tid, c = served(serve, tokenizer, ["a"], client)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=8, messages=USER, tools=[
            {"name": "get_weather", "input_schema": {"type": "object", "required": "city"}}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith(
        "tool 'get_weather': input_schema is not a valid JSON Schema at required"), e.value.body
    assert srv.pool.get_trajectory(tid).completions == [] and srv.engine.calls == []


@pytest.mark.parametrize("content", ["", [], [{"type": "text", "text": ""}]])
def test_an_empty_message_is_a_400(serve, tokenizer, renderer, content):
    """As Anthropic answers: every message needs non-empty content, and a text block non-empty
    text (an empty user turn was rendered and sampled after)."""
    srv, tid, c = served(serve, tokenizer, ["a"], client)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=8,
                          messages=[*USER, {"role": "assistant", "content": "b"},
                                    {"role": "user", "content": content}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith(
        "messages.2: all messages must have non-empty content"), e.value.body
    assert srv.pool.get_trajectory(tid).completions == [] and srv.engine.calls == []


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forcing_a_tool_without_tools_names_it_in_anthropic_words(serve, tokenizer, renderer,
                                                                  choice):
    """The refusal says what is wrong without the gateway's internal name ("required")."""
    srv, tid, c = served(serve, tokenizer, ["a"], client)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=8, messages=USER, tool_choice=choice)
    assert e.value.body["error"]["message"] == (
        "tool_choice: forces a tool call, but the request declares no tools")
    assert srv.pool.get_trajectory(tid).completions == []


@pytest.mark.parametrize("stream", [False, True])
def test_text_around_a_tool_call_sent_back_extends_the_recorded_turn(serve, tokenizer, renderer,
                                                                      stream):
    """"Hi <call> bye": plain gives one text block before the tool_use, the stream gives the
    blocks in generation order (text, tool_use, text). Either sent back with its tool_result
    extends turn 1 token for token: an assistant message's text blocks join with nothing."""
    srv, tid, c = served(serve, tokenizer, [f"Hi {CALL} bye", "ok"], client)
    kw = {"model": "tiny", "max_tokens": 400, "tools": [TOOL]}
    if stream:
        with c.messages.stream(messages=USER, **kw) as s:
            msg = s.get_final_message()
    else:
        msg = c.messages.create(messages=USER, **kw)
    texts = [b.text for b in msg.content if b.type == "text"]
    assert texts == (["Hi", "  bye"] if stream else ["Hi  bye"])
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    c.messages.create(messages=[*USER, {"role": "assistant", "content": [
        b.model_dump(exclude_none=True) for b in msg.content]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}], **kw)
    first, second = srv.pool.get_trajectory(tid).completions
    assert second.extends_previous
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids)


def test_assistant_text_blocks_join_by_newline_in_a_row_and_by_nothing_across_a_tool_use():
    """Agent-written [text, text] keeps a line between them; [text, tool_use, text] (how the
    stream splits one reply) is the reply's text again."""
    body = {"model": "tiny", "max_tokens": 8, "messages": [*USER, {"role": "assistant", "content": [
        {"type": "text", "text": "One."}, {"type": "text", "text": "Two."},
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}},
        {"type": "text", "text": "  bye"}]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}]}
    _, conv = wire.parse(json.dumps(body).encode())
    assert conv.messages[1].content == "One.\nTwo.  bye"
