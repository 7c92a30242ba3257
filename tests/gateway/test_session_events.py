"""Process events reported by an agent on its own session (issue 11 item 2), over real HTTP.

POST /v1/sessions/{id}/events with the session's own key records an `Event` on a turn of its
trajectory (default: the latest model call); the trainer weights it with `[reward] process`.
Bad input is a JSON error with the right status and records nothing: another session's id 403,
no model call yet or a turn out of range 409, a bad body 400, no key 401.
"""

from __future__ import annotations

import httpx
import openai

from forgerl.gateway.renderers.renderer import ChatMLRenderer
from forgerl.types import Event

from .conftest import ScriptedEngine, reply

USER = [{"role": "user", "content": "2 + 3?"}]


def _post(srv, sid: str, key: str | None, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{srv.base_url}/sessions/{sid}/events", json=body, headers=headers,
                      timeout=30)


def test_agent_events_land_on_their_turns_and_bad_ones_record_nothing(serve, tokenizer):
    r = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(r, "4"), reply(r, "5")]), tokenizer)
    tid, key = srv.session()
    other_tid, other_key = srv.session(task_index=1)
    early = _post(srv, tid, key, {"kind": "wrong_format"})
    assert early.status_code == 409 and early.json()["error"]["param"] == "turn"
    client = srv.client(key)
    client.chat.completions.create(model="tiny", messages=USER)
    client.chat.completions.create(model="tiny", messages=[*USER, {"role": "assistant",
                                   "content": "4"}, {"role": "user", "content": "sure?"}])
    ok = _post(srv, tid, key, {"kind": "wrong_format", "value": 2.0})
    assert ok.status_code == 200, ok.text
    assert ok.json() == {"session_id": tid, "turn": 1, "kind": "wrong_format", "value": 2.0}
    assert _post(srv, tid, key, {"kind": "slow_tool", "turn": 0}).json()["turn"] == 0
    bad = [
        (_post(srv, tid, other_key, {"kind": "x"}), 403),  # another session's key
        (_post(srv, tid, None, {"kind": "x"}), 401),
        (_post(srv, tid, key, {"kind": "x", "turn": 2}), 409),  # only turns 0 and 1 exist
        (_post(srv, tid, key, {"kind": ""}), 400),
        (_post(srv, tid, key, {"kind": "x", "value": "NaN"}), 400),
        (_post(srv, tid, key, {"kind": "x", "extra": 1}), 400),
        (_post(srv, tid, key, {"kind": "undelivered", "turn": 0}), 400),  # the gateway's own
    ]
    for response, status in bad:
        assert response.status_code == status, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert srv.pool.get_trajectory(tid).events == [Event(1, "wrong_format", 2.0),
                                                   Event(0, "slow_tool", 1.0)]
    assert srv.pool.get_trajectory(other_tid).events == []


def test_bad_tool_calls_become_process_events_of_their_turn(serve, tokenizer):
    """The gateway's built-in events: a malformed `<tool_call>` block is "invalid_tool_call",
    a call of a tool the request did not declare is "undeclared_tool" (both stay text for the
    client); a reply cut by max_tokens inside a call is truncated, not an error (C09)."""
    r = ChatMLRenderer(tokenizer)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}}}}]
    good = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "calculator", "arguments": {1+1}}\n</tool_call>'
    undeclared = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    script = [reply(r, good), reply(r, f"{bad}\n{undeclared}"), reply(r, good[:30], end=False)]
    srv = serve(ScriptedEngine(script), tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    first = client.chat.completions.create(model="tiny", messages=USER, tools=tools)
    assert first.choices[0].finish_reason == "tool_calls"
    again = [*USER, {"role": "user", "content": "again"}]
    second = client.chat.completions.create(model="tiny", messages=again, tools=tools)
    assert second.choices[0].message.tool_calls is None
    cut = client.chat.completions.create(model="tiny", messages=USER, tools=tools, max_tokens=8)
    assert cut.choices[0].finish_reason == "length"
    assert srv.pool.get_trajectory(tid).events == [Event(1, "invalid_tool_call"),
                                                   Event(1, "undeclared_tool")]
    assert srv.gateway.counters["tool_parse_errors"] == 2


def test_a_conversation_that_outgrows_the_context_ends_with_an_overflow_event(serve, tokenizer):
    """CASES.md C09: the turn after which the prompt no longer fits is refused with a 400
    `context_length_exceeded` (nothing recorded for it) and a "context_overflow" event lands on
    the last recorded turn, so `[reward] process = { context_overflow = ... }` can price it."""
    r = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(r, "4")], max_model_len=96), tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    long = [*USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": "x" * 200}]
    try:
        client.chat.completions.create(model="tiny", messages=long, max_tokens=4)
    except openai.BadRequestError as e:
        assert e.code == "context_length_exceeded"
    else:
        raise AssertionError("the overflowing call was answered")
    assert srv.pool.get_trajectory(tid).events == [Event(0, "context_overflow")]
    assert len(srv.pool.get_trajectory(tid).completions) == 1
    assert srv.gateway.counters["context_overflows"] == 1


def test_a_huge_message_is_refused_before_it_is_tokenized(serve, tokenizer, monkeypatch):
    """A message whose characters alone exceed max_model_len x 2 x the longest token string
    (`Renderer.min_tokens`) is refused as `context_length_exceeded` with C09's event, and is
    never tokenized: tokenizing a 60 MB body had held the event loop for 95 s. The same holds
    for a /v1/completions text prompt; a shorter overflow still goes through the tokenizer."""
    r = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(r, "4"), reply(r, "5")], max_model_len=96), tokenizer)
    assert srv.gateway.renderer.max_token_chars == 13  # "<|endoftext|>"
    encoded: list[int] = []
    real_encode = srv.gateway.renderer.encode
    monkeypatch.setattr(srv.gateway.renderer, "encode",
                        lambda text: encoded.append(len(text)) or real_encode(text))
    huge = "x" * 2_000_000  # at least 76,923 tokens
    tid, key = srv.session()
    client = srv.client(key)
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    encoded.clear()
    long = [*USER, {"role": "assistant", "content": "4"}, {"role": "user", "content": huge}]
    try:
        client.chat.completions.create(model="tiny", messages=long, max_tokens=4)
    except openai.BadRequestError as e:
        assert e.code == "context_length_exceeded" and e.param == "messages"
        assert ("maximum context length is 96 tokens. However, your messages resulted in at "
                "least 76923 tokens.") in e.message
    else:
        raise AssertionError("the huge call was answered")
    many = [{"role": "user", "content": "x"}] * 3000  # 3,000 characters: at least 115 tokens
    try:
        client.chat.completions.create(model="tiny", messages=many, max_tokens=4)
    except openai.BadRequestError as e:
        assert "at least 115 tokens" in e.message
    else:
        raise AssertionError("the 3,000 messages were answered")
    raw_tid, raw_key = srv.session(task_index=1)
    raw = srv.client(raw_key)
    raw.completions.create(model="tiny", prompt="2 + 3 =", max_tokens=4)
    try:
        raw.completions.create(model="tiny", prompt=huge, max_tokens=4)
    except openai.BadRequestError as e:
        assert e.code == "context_length_exceeded" and e.param == "prompt"
    else:
        raise AssertionError("the huge prompt was answered")
    assert max(encoded) < 100  # "2 + 3 =" and turn headers; never the huge text
    for t, refused in ((tid, 2), (raw_tid, 1)):
        assert srv.pool.get_trajectory(t).events == [Event(0, "context_overflow")] * refused
        assert len(srv.pool.get_trajectory(t).completions) == 1
    assert srv.gateway.counters["context_overflows"] == 3
