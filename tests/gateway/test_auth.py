"""CASES.md C26: authentication that works for Anthropic clients and fails closed, through the
official `anthropic` and `openai` clients against the real app over HTTP.

Pins: a session's key works as the Anthropic client's `api_key` (x-api-key), as its `auth_token`
(Authorization: Bearer) and as the openai client's key, and all three calls land in that one
session, turn after turn; both headers (or two of one) naming different keys is a 400 on every
route (model calls, token counting, the sessions API), an empty, unknown or ended key a 401,
with nothing recorded; the sessions API needs the admin key (and with none configured never
answers 200: test_session_admin.py); one session's key reaches no other session's turns,
events, responses or reward.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from .conftest import ScriptedEngine, reply

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(autouse=True)
def _no_client_keys_from_the_environment(monkeypatch):
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def _anthropic(srv, **keys) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), max_retries=0, **keys)


def test_the_three_key_forms_land_in_one_session(serve, tokenizer, renderer):
    srv = serve(ScriptedEngine([reply(renderer, t) for t in ("One.", "Two.", "Three.", "Four.")]),
                tokenizer)
    tid, key = srv.session()
    first = _anthropic(srv, api_key=key).messages.create(model="tiny", max_tokens=16,
                                                         messages=HI)
    history = [*HI, {"role": "assistant", "content": "One."}, {"role": "user", "content": "And?"}]
    second = _anthropic(srv, auth_token=key).messages.create(model="tiny", max_tokens=16,
                                                             messages=history)
    chat = [*history, {"role": "assistant", "content": "Two."},
            {"role": "user", "content": "Last?"}]
    third = srv.client(key).chat.completions.create(model="tiny", messages=chat)
    assert [first.content[0].text, second.content[0].text, third.choices[0].message.content] == [
        "One.", "Two.", "Three."]
    c1, c2, c3 = srv.pool.get_trajectory(tid).completions  # one trajectory, each turn extending
    assert c2.prompt_ids[: len(c1.prompt_ids) + len(c1.completion_ids)] == (
        c1.prompt_ids + c1.completion_ids)
    assert c3.prompt_ids[: len(c2.prompt_ids) + len(c2.completion_ids)] == (
        c2.prompt_ids + c2.completion_ids)
    fourth = httpx.post(f"{srv.base_url}/messages", headers={  # one key in both headers
        "x-api-key": key, "Authorization": f"Bearer {key}"},
        json={"model": "tiny", "max_tokens": 16, "messages": HI})
    assert fourth.json()["content"][0]["text"] == "Four."
    assert len(srv.pool.get_trajectory(tid).completions) == 4


def test_conflicting_and_bad_keys_record_nothing(serve, tokenizer, renderer):
    srv = serve(ScriptedEngine([reply(renderer, "never")]), tokenizer)
    (tid_a, key_a), (tid_b, key_b) = srv.session(), srv.session()
    ended_tid, ended = srv.session()
    srv.gateway.finish_session(ended_tid, 0.0)
    before = srv.pool.stats()
    # the anthropic SDK sends one of the two (an Authorization header replaces its x-api-key);
    # a proxy or a hand-written client may send both
    r = httpx.post(f"{srv.base_url}/messages", headers={
        "x-api-key": key_a, "Authorization": f"Bearer {key_b}"},
        json={"model": "tiny", "max_tokens": 16, "messages": HI})
    assert r.status_code == 400 and r.json()["error"] == {
        "type": "invalid_request_error",
        "message": "x-api-key and Authorization: Bearer name different keys; send one key"}
    for keys in ({"api_key": "sk-forgerl-unknown"}, {"auth_token": "sk-forgerl-unknown"},
                 {"api_key": ended}, {"auth_token": ended}):
        with pytest.raises(anthropic.AuthenticationError) as e:
            _anthropic(srv, **keys).messages.create(model="tiny", max_tokens=16, messages=HI)
        assert e.value.body["error"]["type"] == "authentication_error"
    for headers in ({"x-api-key": ""}, {"authorization": "Bearer"}, {"x-api-key": "None"}, {}):
        r = httpx.post(f"{srv.base_url}/messages", headers=headers,
                       json={"model": "tiny", "max_tokens": 16, "messages": HI})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for key in (ended, "sk-forgerl-unknown", srv.gateway.admin_key):
        with pytest.raises(openai.AuthenticationError) as e:
            srv.client(key).chat.completions.create(model="tiny", messages=HI)
        assert e.value.code == "invalid_api_key"
    assert srv.pool.stats() == before and srv.engine.calls == []
    assert [len(srv.pool.get_trajectory(t).completions) for t in (tid_a, tid_b)] == [0, 0]



ROUTES = [("/chat/completions", {"model": "tiny", "messages": HI}),
          ("/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 4}),
          ("/responses", {"model": "tiny", "input": "Hi"}),
          ("/messages", {"model": "tiny", "max_tokens": 4, "messages": HI}),
          ("/messages/count_tokens", {"model": "tiny", "messages": HI})]


def test_conflicting_keys_are_a_400_on_every_route(serve, tokenizer, renderer):
    """CASES.md C26: x-api-key of one session with a Bearer of another (or two Authorization
    headers) is a 400 on every route, OpenAI-shaped there and Anthropic-shaped on /messages,
    with nothing recorded in either session; one key in both headers, or x-api-key alone,
    authenticates on the OpenAI routes too."""
    srv = serve(ScriptedEngine([reply(renderer, "Ok.") for _ in range(8)]), tokenizer)
    (tid_a, key_a), (tid_b, key_b) = srv.session(), srv.session()
    conflicts = [[("x-api-key", key_a), ("authorization", f"Bearer {key_b}")],
                 [("authorization", f"Bearer {key_a}"), ("authorization", f"Bearer {key_b}")],
                 [("x-api-key", key_b), ("x-api-key", key_a)]]
    message = "x-api-key and Authorization: Bearer name different keys; send one key"
    for path, body in [*ROUTES, ("/sessions", {}), (f"/sessions/{tid_a}/events", {"kind": "x"}),
                       (f"/sessions/{tid_a}/reward", {"reward": 1.0})]:
        for headers in conflicts:
            r = httpx.post(srv.base_url + path, headers=headers, json=body)
            error = r.json()["error"]
            assert r.status_code == 400 and error["message"] == message, (path, r.text)
            assert error.get("code", "conflicting_api_keys") == "conflicting_api_keys"
    assert srv.engine.calls == [] and srv.pool.stats()["completions"] == 0
    for path, body in ROUTES[:3]:
        for headers in ({"x-api-key": key_a, "authorization": f"Bearer {key_a}"},
                        {"x-api-key": key_a}):
            assert httpx.post(srv.base_url + path, headers=headers, json=body).status_code == 200
    assert len(srv.pool.get_trajectory(tid_a).completions) == 6
    assert srv.pool.get_trajectory(tid_b).completions == []


def test_no_session_reaches_another(serve, tokenizer, renderer):
    srv = serve(ScriptedEngine([reply(renderer, "Mine.")]), tokenizer)
    (tid_a, key_a), (tid_b, key_b) = srv.session(), srv.session()
    answer = httpx.post(f"{srv.base_url}/responses", json={"model": "tiny", "input": "Hi"},
                        headers={"Authorization": f"Bearer {key_b}"}).json()
    before = srv.pool.stats()
    a = {"Authorization": f"Bearer {key_a}"}
    r = httpx.post(f"{srv.base_url}/responses", headers=a, json={
        "model": "tiny", "input": "And?", "previous_response_id": answer["id"]})
    assert r.status_code in (400, 404) and r.json()["error"]["code"] == (
        "previous_response_not_found")
    r = httpx.post(f"{srv.base_url}/sessions/{tid_b}/events", headers=a, json={"kind": "x"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = httpx.post(f"{srv.base_url}/sessions/{tid_b}/reward", headers=a, json={"reward": 1.0})
    assert r.status_code == 401 and "wrong admin key" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.base_url}/sessions", headers=a, json={})
    assert r.status_code == 401
    assert srv.pool.stats() == before and len(srv.engine.calls) == 1
    assert srv.pool.get_trajectory(tid_b).status == "running"
    assert len(srv.pool.get_trajectory(tid_b).completions) == 1
    assert srv.pool.get_trajectory(tid_a).completions == []
