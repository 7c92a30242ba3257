"""The served OpenAI-compatible app: tool calls, streaming, clamping, sessions, errors.

Pins: several tool calls per reply come back in order with finish_reason "tool_calls", and a
malformed or undeclared block stays as text without failing the call (CASES.md C05); a streamed
call records exactly what the plain call records, the SSE stream ends with [DONE] and the usage
counts the recorded ids (C06); max_tokens is clamped to the context and a reply truncated inside
a tool call keeps finish_reason "length" (C09); top_p 0 is out of range; every bad input gets
an OpenAI-shaped error with its status and leaves the pool unchanged.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import ScriptedEngine, reply
from .test_tito import WEATHER, tool_call_text

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}},
    },
}
USER = [{"role": "user", "content": "look up 7 and 8"}]


def two_calls(second: str) -> str:
    return tool_call_text("lookup", {"id": 7}) + "\n" + second


@pytest.mark.parametrize(
    ("second", "n_calls", "kept"),
    [
        (tool_call_text("lookup", {"id": 8}), 2, None),
        ('<tool_call>\n{"name": "lookup", "arguments": {"id": 8}\n</tool_call>', 1, '{"id": 8}\n'),
        (tool_call_text("delete_all", {"id": 8}), 1, "delete_all"),
    ],
    ids=["two-calls", "missing-brace", "undeclared"],
)
def test_c05_several_tool_calls(serve, tokenizer, renderer, second, n_calls, kept):
    scripted = reply(renderer, two_calls(second))
    srv = serve(ScriptedEngine([scripted]), tokenizer)
    tid, key = srv.session()
    r = srv.client(key).chat.completions.create(model="tiny", messages=USER, tools=[LOOKUP])
    msg = r.choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["lookup"] * n_calls
    assert [json.loads(c.function.arguments) for c in msg.tool_calls] == [{"id": 7}, {"id": 8}][
        :n_calls
    ]
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
    assert r.choices[0].finish_reason == "tool_calls"
    if kept is None:
        assert msg.content is None
    else:
        assert kept in msg.content and msg.content.startswith("<tool_call>")
        assert srv.gateway.counters["tool_parse_errors"] == 1
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert rec.completion_ids == scripted.ids and rec.logprobs == scripted.logprobs
    assert rec.finish_reason == "tool_calls"


def c06_script(renderer: ChatMLRenderer):
    """Text then one tool call then end-of-turn (byte tokenizer: one id per byte, 2 text ids,
    the rest the call and the end id)."""
    return reply(renderer, "ok" + tool_call_text("get_weather", {"city": "Rome"}))


def test_c06_stream_records_the_same_as_plain(serve, tokenizer, renderer):
    scripted = c06_script(renderer)
    srv = serve(ScriptedEngine([scripted, scripted]), tokenizer)
    tid_plain, key_plain = srv.session(task_index=0)
    tid_stream, key_stream = srv.session(task_index=1)
    plain = srv.client(key_plain).chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER]
    )
    stream = srv.client(key_stream).chat.completions.create(
        model="tiny",
        messages=USER,
        tools=[WEATHER],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    (a,) = srv.pool.get_trajectory(tid_plain).completions
    (b,) = srv.pool.get_trajectory(tid_stream).completions
    n = len(scripted.ids)
    assert a.completion_ids == b.completion_ids == scripted.ids and len(b.logprobs) == n
    assert a.logprobs == b.logprobs and a.prompt_ids == b.prompt_ids
    assert a.finish_reason == b.finish_reason == "tool_calls"
    assert chunks[-1].usage.completion_tokens == n == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == len(a.prompt_ids)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Rome"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content == "ok"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}


def test_c06_raw_sse_ends_with_done(serve, tokenizer, renderer):
    srv = serve(ScriptedEngine([reply(renderer, "hi")]), tokenizer)
    _, key = srv.session()
    body = {"model": "tiny", "messages": USER, "stream": True}
    with httpx.stream(
        "POST",
        f"{srv.base_url}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    # an SSE comment opens the stream once the call is checked (its headers go out at once)
    assert lines[0] == ": forgerl: sampling" and all(ln.startswith("data: ") for ln in lines[1:])
    objs = [json.loads(ln[6:]) for ln in lines[1:-1]]
    assert objs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert objs[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in o for o in objs)  # no include_usage → no usage chunk


def test_c09_max_tokens_clamped_to_context(serve, tokenizer, renderer):
    # CASES.md C09 numbers: a 3500-token prompt, max_tokens 1024, max_model_len 4096 -> 596.
    # Byte tokenizer: 19 tokens of ChatML around the user text (11 of them the assistant header).
    engine = ScriptedEngine([reply(renderer, "x" * 50), reply(renderer, "z")], max_model_len=4096)
    srv = serve(engine, tokenizer, max_tokens=2048)
    tid, key = srv.session()
    messages = [{"role": "user", "content": "y" * (3500 - 19)}]
    r = srv.client(key).chat.completions.create(model="tiny", messages=messages, max_tokens=1024)
    prompt, params = engine.calls[0]
    assert len(prompt) == 3500 and params.max_tokens == 596
    assert r.usage.prompt_tokens == 3500 and r.usage.completion_tokens == 51
    assert srv.pool.get_trajectory(tid).completions[0].sampling.max_tokens == 596
    # the gateway's max_tokens (rollout.max_tokens) caps a session opened without one too
    srv.gateway.max_tokens = 100
    _, other = srv.gateway.open_session(task_index=-1)
    srv.client(other).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10**12)
    assert engine.calls[1][1].max_tokens == 100


def test_c09_truncated_tool_call_keeps_length(serve, tokenizer, renderer):
    text = tool_call_text("lookup", {"id": 7})
    srv = serve(ScriptedEngine([reply(renderer, text)]), tokenizer)
    tid, key = srv.session()
    r = srv.client(key).chat.completions.create(
        model="tiny", messages=USER, tools=[LOOKUP], max_tokens=20
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == text[:20]
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert rec.finish_reason == "length" and len(rec.completion_ids) == 20


def test_sampling_overrides_and_weight_version(serve, tokenizer, renderer):
    """The session's temperature overrides the request's; its max_tokens caps the request's (an
    agent that asks for 4 tokens under a 9-token session gets 4, never 9)."""
    engine = ScriptedEngine([reply(renderer, "a"), reply(renderer, "b"), reply(renderer, "c")])
    srv = serve(engine, tokenizer, temperature=0.7, max_tokens=33)
    tid, key = srv.session(temperature=0.25, max_tokens=9)
    engine.weight_version = 3
    srv.client(key).chat.completions.create(
        model="tiny", messages=USER, temperature=1.3, max_tokens=100, seed=5
    )
    _, key2 = srv.session()
    srv.client(key2).chat.completions.create(model="tiny", messages=USER)
    _, key3 = srv.session(max_tokens=9)
    srv.client(key3).chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    p1, p2, p3 = (call[1] for call in engine.calls)
    assert (p1.temperature, p1.max_tokens, p1.seed, p1.stop_token_ids) == (0.25, 9, 5, (2,))
    assert (p2.temperature, p2.max_tokens, p2.seed) == (0.7, 33, None)
    assert (p3.temperature, p3.max_tokens) == (0.7, 4)
    rec = srv.pool.get_trajectory(tid).completions[0]
    assert rec.weight_version == 3 and rec.weight_versions == [3, 3]
    assert rec.sampling == p1 and rec.started_at <= rec.ended_at


def test_models_and_session_endpoints(serve, tokenizer, renderer):
    srv = serve(ScriptedEngine([reply(renderer, "done")]), tokenizer)
    models = srv.client("unused").models.list()
    assert [m.id for m in models.data] == ["tiny"]
    card = srv.client("unused").models.retrieve("tiny")  # what a harness checks at start
    assert (card.id, card.object, card.owned_by) == ("tiny", "model", "forgerl")
    with pytest.raises(openai.NotFoundError) as e:
        srv.client("unused").models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found" and "'gpt-4o' does not exist" in e.value.body[
        "message"]
    r = httpx.post(f"{srv.base_url}/sessions", json={"task_index": 4, "temperature": 0.5},
                   headers=srv.admin)
    assert r.status_code == 200
    sid, key = r.json()["session_id"], r.json()["api_key"]
    srv.client(key).chat.completions.create(model="tiny", messages=USER)
    assert srv.engine.calls[0][1].temperature == 0.5
    r = httpx.post(f"{srv.base_url}/sessions/{sid}/reward", json={"reward": 1.0}, headers=srv.admin)
    assert r.status_code == 200
    traj = srv.pool.get_trajectory(sid)
    assert (traj.task_index, traj.status, traj.reward, len(traj.completions)) == (
        4,
        "finished",
        1.0,
        1,
    )
    # the session is closed: its key no longer works, the finished record stays
    bad = httpx.post(
        f"{srv.base_url}/chat/completions",
        json={"model": "tiny", "messages": USER},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert bad.status_code == 401 and len(srv.pool.get_trajectory(sid).completions) == 1
    again = httpx.post(f"{srv.base_url}/sessions/{sid}/reward", json={"reward": 0.0},
                       headers=srv.admin)
    assert again.status_code == 409 and again.json()["error"]["code"] == "trajectory_not_running"
    assert srv.pool.get_trajectory(sid).reward == 1.0
    r = httpx.post(f"{srv.base_url}/sessions/nope/reward", json={"reward": 1.0}, headers=srv.admin)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


def test_any_model_when_not_strict(serve, tokenizer, renderer):
    srv = serve(ScriptedEngine([reply(renderer, "a")]), tokenizer, strict_model=False)
    _, key = srv.session()
    r = srv.client(key).chat.completions.create(model="gpt-4o", messages=USER)
    assert r.choices[0].message.content == "a" and r.model == "gpt-4o"


BAD = [
    # (name, headers-key, raw body, status, code)
    ("malformed-json", "good", b'{"model": "tiny", "messages": [', 400, "invalid_json"),
    ("wrong-type", "good", json.dumps({"model": "tiny", "messages": "hi"}), 400, "invalid_type"),
    (
        "bad-role",
        "good",
        json.dumps({"model": "tiny", "messages": [{"role": "bot"}]}),
        400,
        "invalid_value",
    ),
    (
        "temperature-type",
        "good",
        json.dumps({"model": "tiny", "messages": USER, "temperature": "hot"}),
        400,
        "invalid_type",
    ),
    (
        "unknown-model",
        "good",
        json.dumps({"model": "gpt-9", "messages": USER}),
        404,
        "model_not_found",
    ),
    ("missing-key", None, json.dumps({"model": "tiny", "messages": USER}), 401, "invalid_api_key"),
    (
        "unknown-key",
        "sk-nope",
        json.dumps({"model": "tiny", "messages": USER}),
        401,
        "invalid_api_key",
    ),
    (
        "top-p",
        "good",
        json.dumps({"model": "tiny", "messages": USER, "top_p": 0}),
        400,
        "invalid_value",
    ),
    (
        "too-long",
        "good",
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "y" * 300}]}),
        400,
        "context_length_exceeded",
    ),
    ("engine-error", "good", json.dumps({"model": "tiny", "messages": USER}), 500, "engine_error"),
]


@pytest.mark.parametrize(("name", "key", "raw", "status", "code"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_and_pool_unchanged(
    serve, tokenizer, renderer, name, key, raw, status, code
):
    engine = ScriptedEngine(
        [reply(renderer, "first"), RuntimeError("CUDA fell over")], max_model_len=256
    )
    srv = serve(engine, tokenizer)
    tid, good = srv.session()
    client = srv.client(good)
    client.chat.completions.create(model="tiny", messages=USER)  # one recorded turn
    before = list(srv.pool.get_trajectory(tid).completions)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {good if key == 'good' else key}"
    r = httpx.post(f"{srv.base_url}/chat/completions", content=raw, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text and err["message"]
    if name == "engine-error":
        assert "CUDA fell over" in err["message"] and err["type"] == "server_error"
    assert srv.pool.get_trajectory(tid).completions == before
    assert srv.gateway.sessions.get(good).turns[0].completion_ids == before[0].completion_ids
