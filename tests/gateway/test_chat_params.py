"""Chat Completions parameters are honoured or refused with a 400 naming them (issue 10 item 6).

Over real HTTP with the official `openai` client and the scripted engine (byte tokenizer: one id
per ASCII character). Pins:
- `stop` (string or list): the text ends before the earliest stop string, finish "stop"; the
  record keeps every sampled id up to the one completing the stop string (so the stop string's
  ids are in the loss), drops the ids decoded past it (counted), and the next turn extends it;
  a stop string ending inside a merged token keeps that whole token; streamed = plain.
- `logprobs`: the recorded behaviour logprob of every returned token (end-of-turn excluded),
  plain and streamed; `top_logprobs` > 0, or without `logprobs`, is a 400.
- `tool_choice`: "none" renders and parses no tools; "required" and a named tool prefill the
  opening of a tool call (prompt ids, never trained) and the next turn reuses prefill + sampled
  ids; an undeclared name, or forcing without tools, is a 400.
- `parallel_tool_calls: false` ends the reply (and the record) after its first call.
- `n`: each choice is its own completion in the pool (seed + i) and its own branch of the
  session; the agent continuing from choice 1 extends choice 1's ids; streamed by index.
- `response_format` json_object / json_schema, logit_bias, penalties and vLLM's extras out of
  range, non-text content parts are 400s naming the field, and record nothing; metadata fields
  (user, metadata, store, ...) are accepted and kept with the turn, neutral values accepted.
- sampling parameters (CASES.md C21): a request setting only temperature reaches the engine with
  every parameter explicit and neutral; top_p, the penalties and vLLM's extras top_k, min_p and
  repetition_penalty are sampled with and recorded as sent, a 200 on a training session (the
  trainer keeps such a turn as context); top_k -1 is recorded as 0 (both mean off); through a
  RemoteEngine, on chat, Responses and Messages, the request body names all seven and the
  stored turn holds what it named.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import Scripted, ScriptedEngine, render, reply, served
from .test_tito import WEATHER, merge_tokenizer, tool_call_text

USER = [{"role": "user", "content": "go"}]


REACT = "Thought: add\nCode: 1+1\nObservation: 3 (made up)\nFinal"


@pytest.mark.parametrize("stop", ["Observation:", ["Calling tools:", "Observation:"]])
def test_stop_ends_text_keeps_sampled_ids_and_next_turn_extends(serve, tokenizer, renderer, stop):
    srv, tid, client = served(serve, tokenizer, [REACT, "Final: 2"])
    r = client.chat.completions.create(model="tiny", messages=USER, stop=stop)
    head = "Thought: add\nCode: 1+1\n"
    assert r.choices[0].message.content == head and r.choices[0].finish_reason == "stop"
    (rec,) = srv.pool.get_trajectory(tid).completions
    kept = len(head + "Observation:")  # byte tokenizer: one id per character
    scripted = reply(renderer, REACT)
    assert rec.completion_ids == scripted.ids[:kept] and rec.logprobs == scripted.logprobs[:kept]
    assert rec.finish_reason == "stop" and r.usage.completion_tokens == kept
    assert srv.gateway.counters["tokens_after_stop"] == len(scripted.ids) - kept
    # the agent appends the real observation; the prompt extends the kept ids, closed by <|im_end|>
    messages = [*USER, {"role": "assistant", "content": head},
                {"role": "user", "content": "Observation: 2"}]
    client.chat.completions.create(model="tiny", messages=messages, stop=stop)
    a, b = srv.pool.get_trajectory(tid).completions
    assert b.extends_previous and b.prompt_ids[: len(a.prompt_ids) + kept + 2] == [
        *a.prompt_ids, *a.completion_ids, renderer.end_of_turn_id, *renderer.newline_ids]


def test_earliest_stop_wins_and_stream_matches_plain(serve, tokenizer, renderer):
    srv, tid, client = served(serve, tokenizer, ["xabcd", "xabcd", "no stop"])
    plain = client.chat.completions.create(model="tiny", messages=USER, stop=["abc", "b"])
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, stop=["abc", "b"],
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert plain.choices[0].message.content == text == "xa"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    a, b = srv.pool.get_trajectory(tid).completions
    assert a.completion_ids == b.completion_ids == renderer.encode("xab")
    r = client.chat.completions.create(model="tiny", messages=USER, stop="\n")
    assert r.choices[0].message.content == "no stop" and r.choices[0].finish_reason == "stop"
    assert srv.pool.get_trajectory(tid).completions[2].completion_ids[-1] == 2  # <|im_end|> kept


def test_stop_inside_a_merged_token_keeps_the_token(serve):
    tok = merge_tokenizer()  # 262 = "hello"; 259 = "he", 261 = "llo"
    srv = serve(ScriptedEngine([Scripted([259, 262, 2], [-0.1, -0.2, -0.3])]), tok)
    tid, key = srv.session()
    r = srv.client(key).chat.completions.create(model="tiny", messages=USER, stop="hel")
    assert r.choices[0].message.content == "he"  # "he" + "hello": stop "hel" starts at 2
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert rec.completion_ids == [259, 262] and rec.logprobs == [-0.1, -0.2]


def test_logprobs_are_the_recorded_behaviour_logprobs(serve, tokenizer, renderer):
    srv, tid, client = served(serve, tokenizer, ["héllo", "héllo"])
    r = client.chat.completions.create(model="tiny", messages=USER, logprobs=True,
                                       top_logprobs=0)
    (rec,) = srv.pool.get_trajectory(tid).completions
    content = r.choices[0].logprobs.content
    assert [t.logprob for t in content] == rec.logprobs[:-1]  # <|im_end|> not returned
    # each token's own bytes: "é" is split over two byte tokens, shown escaped, never U+FFFD
    assert [t.token for t in content] == ["h", "\\xc3", "\\xa9", "l", "l", "o"]
    assert [t.bytes for t in content] == [[104], [0xC3], [0xA9], [108], [108], [111]]
    assert bytes(b for t in content for b in t.bytes).decode() == "héllo"
    assert all(t.top_logprobs == [] for t in content)
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, logprobs=True,
                                                 stream=True))
    streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert streamed == rec.logprobs[:-1]
    assert [t.bytes for c in chunks if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content] == [t.bytes for t in content]


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ({"top_logprobs": 0}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "rm"}}},
     "tool_choice"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"n": 0}, "n"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages.0.content.1.type"),
])
def test_unsupported_values_are_400s_naming_the_field(serve, tokenizer, renderer, kwargs, param):
    srv, tid, client = served(serve, tokenizer, ["a"])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", **{"messages": USER, **kwargs})
    assert e.value.param == param, e.value.body
    assert srv.pool.get_trajectory(tid).completions == [] and srv.engine.calls == []


def test_neutral_and_metadata_fields_are_accepted(serve, tokenizer, renderer):
    srv, tid, client = served(serve, tokenizer, ["a"])
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "developer", "content": "Be brief."}, *USER],
        frequency_penalty=0, presence_penalty=0.0, logit_bias={}, user="u1", store=True,
        metadata={"run": "7"}, response_format={"type": "text"}, modalities=["text"],
        service_tier="auto", safety_identifier="s", prompt_cache_key="k", seed=4,
        parallel_tool_calls=True, stream_options=None)
    assert r.choices[0].message.content == "a"
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert rec.prompt_ids == render(renderer, [{"role": "system", "content": "Be brief."}, *USER])
    assert rec.sampling.seed == 4
    assert rec.request == {"protocol": "chat", "kept": {
        "user": "u1", "metadata": {"run": "7"}, "store": True, "service_tier": "auto",
        "safety_identifier": "s", "prompt_cache_key": "k"}}


def sampled(p) -> tuple:
    return (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.presence_penalty,
            p.frequency_penalty)


def test_sampling_parameters_reach_the_engine_and_the_record(serve, tokenizer, renderer):
    srv, tid, client = served(serve, tokenizer, ["a", "b", "c"])
    client.chat.completions.create(model="tiny", messages=USER, temperature=0.7)
    client.chat.completions.create(
        model="tiny", messages=USER, temperature=0.7, top_p=0.8, frequency_penalty=0.5,
        presence_penalty=-1, extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1})
    client.chat.completions.create(model="tiny", messages=USER, extra_body={"top_k": -1})
    (_, plain), (_, full), (_, off) = srv.engine.calls
    assert sampled(plain) == (0.7, 1.0, 0, 0.0, 1.0, 0.0, 0.0) and plain.transforms() == ()
    assert sampled(full) == (0.7, 0.8, 40, 0.05, 1.1, -1.0, 0.5)
    assert off.top_k == 0 and off.transforms() == ()
    assert [r.sampling for r in srv.pool.get_trajectory(tid).completions] == [plain, full, off]



SEVEN = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
         "frequency_penalty")


def test_c21_the_engine_request_names_every_parameter_the_record_holds(serve, tokenizer,
                                                                       renderer):
    """CASES.md C21 through the real app and a RemoteEngine (a vLLM server whose model defaults
    would be repetition_penalty 1.1, top_k 20, top_p 0.8): a training call that sets only
    temperature, on chat, Responses and Anthropic Messages, sends all seven parameters
    explicitly and neutral, and each stored turn's params are those the request body named; an
    explicit repetition_penalty 1.1 is sampled with, recorded, and kept out of the loss."""
    import anthropic

    from forgerl.trainer.samples import trajectory_to_samples_with_stats
    from tests.engines.test_remote_vllm import chunk, mocked, sse

    ok = [*renderer.encode("Ok"), renderer.end_of_turn_id]
    bodies: list[dict] = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=sse(chunk(ok, [-0.5, -0.25, -0.125], "stop")))

    engine = mocked(handler)
    engine.max_model_len = 4096
    srv = serve(engine, tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    client.chat.completions.create(model="tiny", messages=USER, temperature=0.7)
    client.responses.create(model="tiny", input="go", temperature=0.7)
    anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key=key,
                        max_retries=0).messages.create(  # this SDK no longer declares it
        model="tiny", max_tokens=8, messages=USER, extra_body={"temperature": 0.7})
    client.chat.completions.create(model="tiny", messages=USER, temperature=0.7,
                                   extra_body={"repetition_penalty": 1.1})
    assert [tuple(b[k] for k in SEVEN) for b in bodies] == [
        (0.7, 1.0, 0, 0.0, 1.0, 0.0, 0.0)] * 3 + [(0.7, 1.0, 0, 0.0, 1.1, 0.0, 0.0)]
    traj = srv.pool.get_trajectory(tid)
    assert [sampled(c.sampling) for c in traj.completions] == [
        tuple(b[k] for k in SEVEN) for b in bodies]
    assert all(c.completion_ids == ok and c.logprobs == [-0.5, -0.25, -0.125]
               for c in traj.completions)
    samples, stats = trajectory_to_samples_with_stats(traj, [1.0] * 4)
    assert stats.transformed_turns == 1  # the penalised turn: context only
    assert sum(sum(s.loss_mask) for s in samples) == 3 * len(ok)


CALL = tool_call_text("get_weather", {"city": "Rome"})


def test_tool_choice_none_renders_and_parses_no_tools(serve, tokenizer, renderer):
    srv, tid, client = served(serve, tokenizer, [CALL])
    r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                       tool_choice="none")
    assert r.choices[0].message.content == CALL and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert rec.prompt_ids == render(renderer, USER)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_tool_choice_prefills_a_call(serve, tokenizer, renderer, choice):
    prefix = renderer.tool_call_prefix(None if choice == "required" else "get_weather")
    assert CALL.startswith(prefix)
    srv, tid, client = served(serve, tokenizer, [CALL[len(prefix):], "Sunny."])
    r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                       tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Rome"})
    assert r.choices[0].finish_reason == "tool_calls"
    (rec,) = srv.pool.get_trajectory(tid).completions
    fresh = render(renderer, USER, [WEATHER])
    assert rec.prompt_ids == fresh + renderer.encode(prefix)  # the prefill is prompt, not loss
    assert rec.completion_ids == reply(renderer, CALL[len(prefix):]).ids
    messages = [*USER, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    a, b = srv.pool.get_trajectory(tid).completions
    assert b.extends_previous and b.prompt_ids == render(renderer, messages, [WEATHER])
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == (
        a.prompt_ids + a.completion_ids)


def test_parallel_tool_calls_false_ends_after_the_first_call(serve, tokenizer, renderer):
    second = tool_call_text("get_weather", {"city": "Oslo"})
    srv, tid, client = served(serve, tokenizer, [f"{CALL}\n{second}"] * 2)
    one = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                         parallel_tool_calls=False)
    both = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER])
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls
            ] == ["Rome"]
    assert len(both.choices[0].message.tool_calls) == 2
    assert one.choices[0].finish_reason == both.choices[0].finish_reason == "tool_calls"
    a, _ = srv.pool.get_trajectory(tid).completions
    assert a.completion_ids == renderer.encode(CALL)
    assert srv.gateway.counters["tokens_after_stop"] == len(renderer.encode(second)) + 2


def test_n_choices_are_recorded_branches(serve, tokenizer, renderer):
    srv, tid, client = served(serve, tokenizer, ["one", "two", "six", "done"])
    r = client.chat.completions.create(model="tiny", messages=USER, n=3, seed=10)
    assert [(c.index, c.message.content) for c in r.choices] == [(0, "one"), (1, "two"),
                                                                  (2, "six")]
    recs = srv.pool.get_trajectory(tid).completions
    assert [c.sampling.seed for c in recs] == [10, 11, 12]
    assert len({tuple(c.prompt_ids) for c in recs}) == 1
    assert [c.completion_ids for c in recs] == [reply(renderer, t).ids for t in
                                                ("one", "two", "six")]
    assert r.usage.completion_tokens == sum(len(c.completion_ids) for c in recs) == 12
    messages = [*USER, {"role": "assistant", "content": "two"}, {"role": "user", "content": "ok"}]
    client.chat.completions.create(model="tiny", messages=messages)
    last = srv.pool.get_trajectory(tid).completions[3]
    assert last.extends_previous and last.prompt_ids[: len(recs[1].prompt_ids) + 4] == (
        recs[1].prompt_ids + recs[1].completion_ids)
    assert srv.gateway.sessions.get(client.api_key).prefix_misses == 0


def test_n_choices_stream_by_index(serve, tokenizer, renderer):
    srv, tid, client = served(serve, tokenizer, ["ab", "cd"])
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {0: "ab", 1: "cd"} and chunks[-1].usage.completion_tokens == 6
    assert len(srv.pool.get_trajectory(tid).completions) == 2


@pytest.mark.parametrize(("tools", "name", "problem"), [
    ([{"type": "function", "function": {"name": "get_weather",
                                        "parameters": {"type": "objekt", "properties": 5}}}],
     "get_weather", "parameters is not a valid JSON Schema at properties: 5 is not of type"),
    ([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "strin"}}}}}],
     "get_weather", "parameters is not a valid JSON Schema at properties/city/type"),
    ([{"type": "function", "function": {"name": "", "parameters": {"type": "object"}}}],
     "", "a tool needs a non-empty name"),
    ([WEATHER, WEATHER], "get_weather", "declared more than once"),
])
def test_an_invalid_tool_is_a_400_naming_it(serve, tokenizer, renderer, tools, name, problem):
    """CASES.md C15: a tool whose schema is not a JSON Schema, without a name or declared twice
    is a 400 naming the tool (never rendered, never a 500), and records nothing."""
    srv, tid, client = served(serve, tokenizer, ["a"])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, tools=tools)
    assert (e.value.code, e.value.param) == ("invalid_tool", "tools.0")
    assert e.value.body["message"].startswith(f"tool {name!r}: {problem}"), e.value.body
    assert srv.pool.get_trajectory(tid).completions == [] and srv.engine.calls == []
    assert client.chat.completions.create(model="tiny", messages=USER,
                                          tools=[WEATHER]).choices[0].message.content == "a"


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None},
                                     {"role": "tool", "tool_call_id": "c1"},
                                     {"role": "system", "content": None}])
def test_a_message_without_content_is_a_400_naming_it(serve, tokenizer, renderer, message):
    """A non-assistant message without content is refused as OpenAI refuses it (it was rendered
    as an empty turn); an assistant message may omit content, and "" is content."""
    srv, tid, client = served(serve, tokenizer, ["a"])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[*USER, message])
    assert (e.value.code, e.value.param) == ("missing_required_parameter", "messages.1.content")
    assert srv.pool.get_trajectory(tid).completions == [] and srv.engine.calls == []
    ok = [*USER, {"role": "assistant", "content": None}, {"role": "user", "content": ""}]
    assert client.chat.completions.create(model="tiny", messages=ok).choices[0].message.content \
        == "a"


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "tool", "content": "4"}, "messages.1.tool_call_id"),
    ({"role": "user", "content": [{"type": "text"}]}, "messages.1.content.0.text"),
    ({"role": "assistant", "content": [{"type": "refusal"}]}, "messages.1.content.0.refusal"),
])
def test_a_message_missing_a_required_field_is_a_400_naming_it(serve, tokenizer, renderer,
                                                               message, param):
    """A tool result without the id of its call and a text part without its text are refused
    as OpenAI refuses them (they were rendered as if the field were empty)."""
    srv, tid, client = served(serve, tokenizer, ["a"])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[*USER, message])
    assert (e.value.code, e.value.param) == ("missing_required_parameter", param)
    assert e.value.body["message"] == f"Missing required parameter: '{param}'."
    assert srv.pool.get_trajectory(tid).completions == [] and srv.engine.calls == []


def test_a_tool_schema_is_checked_once_per_distinct_schema():
    """An agent declares the same tools every turn: the metaschema check (~0.4 ms) runs once
    per distinct schema, whatever the key order, and a cached verdict is the fresh one."""
    from forgerl.gateway.conversation import Tool
    from forgerl.gateway.prepare import schema_problem, tool_problem

    schema_problem.cache_clear()
    good = {"type": "object", "properties": {"q": {"type": "string"}}}
    bad = {"type": "objekt"}
    for _ in range(3):
        assert tool_problem(Tool("a", None, good), set()) is None
        assert tool_problem(Tool("b", None, dict(reversed(good.items()))), set()) is None
        assert tool_problem(Tool("c", None, bad), set()).startswith(
            "parameters is not a valid JSON Schema at type: 'objekt' is not valid")
    assert tool_problem(Tool("a", None, good), {"a"}) == "declared more than once"
    info = schema_problem.cache_info()
    assert (info.misses, info.hits) == (2, 7)


def test_a_lone_surrogate_becomes_a_replacement_character(serve, tokenizer, renderer):
    """A tool result cut inside an emoji by a JavaScript agent arrives as a lone "\\ud83d"
    escape (JSON.stringify writes one; Python's openai client cannot send it): it is rendered
    as U+FFFD, as a UTF-8 decoder treats a broken sequence, instead of refusing the call as
    invalid JSON. A complete pair stays the emoji; a body that is not JSON is still a 400."""
    srv, tid, client = served(serve, tokenizer, ["a", "b"])

    def post(raw: bytes) -> httpx.Response:
        return httpx.post(f"{srv.base_url}/chat/completions", content=raw,
                          headers={"Authorization": f"Bearer {client.api_key}"})

    cut = (b'{"model": "tiny", "messages": [{"role": "user", '
           b'"content": "a \\ud83d b \\ud83d\\ude00"}]}')
    assert post(cut).json()["choices"][0]["message"]["content"] == "a"
    fixed = [{"role": "user", "content": "a \ufffd b \U0001f600"}]
    assert srv.engine.calls[0][0] == render(renderer, fixed)
    bad = post(b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}], '
               b'"n": "x"}')
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "n")
    broken = post(b'{"a": "\\ud83d')
    assert (broken.status_code, broken.json()["error"]["code"]) == (400, "invalid_json")
    assert len(srv.pool.get_trajectory(tid).completions) == 1


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/chat/completions", {"messages": USER, "max_tokens": "8"}, "max_tokens"),
    ("/chat/completions", {"messages": USER, "max_tokens": True}, "max_tokens"),
    ("/chat/completions", {"messages": USER, "stream": "yes"}, "stream"),
    ("/completions", {"prompt": [True]}, "prompt"),
    ("/messages", {"messages": USER, "max_tokens": True}, "max_tokens"),
])
def test_a_value_of_the_wrong_json_type_is_a_400(serve, tokenizer, renderer, path, body, param):
    """Bodies are validated strictly, as the APIs document their types: "8" or true is not
    an integer, "yes" is not a boolean (they were coerced: max_tokens true sampled 1 token)."""
    srv, tid, client = served(serve, tokenizer, ["a"])
    r = httpx.post(f"{srv.base_url}{path}", json={"model": "tiny", **body},
                   headers={"Authorization": f"Bearer {client.api_key}"})
    assert r.status_code == 400, r.text
    if path != "/messages":
        assert r.json()["error"]["param"].startswith(param) and \
            r.json()["error"]["code"] == "invalid_type"
    assert srv.engine.calls == [] and srv.pool.get_trajectory(tid).completions == []
    session = httpx.post(f"{srv.base_url}/sessions", json={"task_index": "3"}, headers=srv.admin)
    assert session.status_code == 400 and session.json()["error"]["param"] == "task_index"
