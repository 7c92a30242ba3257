"""The sessions API's admin key and idle expiry (issue 10 item 9), over real HTTP.

`Gateway(admin_key=...)`: POST /v1/sessions and the reward endpoint need `Authorization: Bearer
<admin_key>` (401 `invalid_api_key` otherwise, nothing recorded); session keys still work for
model calls. `Gateway(session_idle_timeout_s=...)`: a session opened over HTTP without a model
call for that long is expired by the server's sweep: trajectory failed with the error, key 401,
counted; a session that keeps calling, and a controller session, stay open.
"""

from __future__ import annotations

import time

import httpx
import pytest

from forgerl.gateway.errors import GatewayError
from forgerl.gateway.renderers.renderer import ChatMLRenderer
from forgerl.gateway.sessions_api import require_opener

from .conftest import ScriptedEngine, reply

USER = [{"role": "user", "content": "2 + 3?"}]
ADMIN = "admin-secret"


def _unauthorized(r: httpx.Response) -> str:
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
    return err["message"]


def _chat(srv, key: str) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/chat/completions", json={"model": "tiny", "messages": USER},
                      headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_admin_key_required_for_sessions_api(serve, tokenizer):
    renderer = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(renderer, "5")]), tokenizer, admin_key=ADMIN)
    url = f"{srv.base_url}/sessions"
    before = srv.pool.stats()
    assert "missing admin key" in _unauthorized(httpx.post(url, json={}))
    assert "wrong admin key" in _unauthorized(
        httpx.post(url, json={}, headers={"Authorization": "Bearer nope"}))
    assert _unauthorized(httpx.post(url, json={}, headers={"Authorization": f"Basic {ADMIN}"}))
    assert srv.pool.stats() == before and len(srv.gateway.sessions) == 0
    assert not srv.gateway.external

    r = httpx.post(url, json={}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    sid, key = r.json()["session_id"], r.json()["api_key"]
    assert _chat(srv, key).status_code == 200  # the session's own key authenticates model calls
    assert _unauthorized(_chat(srv, ADMIN))  # the admin key is no session key

    reward = f"{url}/{sid}/reward"
    _unauthorized(httpx.post(reward, json={"reward": 1.0}))
    _unauthorized(httpx.post(reward, json={"reward": 1.0},
                             headers={"Authorization": f"Bearer {key}"}))
    assert srv.pool.get_trajectory(sid).status == "running"
    r = httpx.post(reward, json={"reward": 1.0}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    t = srv.pool.get_trajectory(sid)
    assert (t.status, t.reward, len(t.completions)) == ("finished", 1.0, 1)


def test_no_admin_key_closes_the_sessions_api(serve, tokenizer):
    """CASES.md C26: admin routes never answer 200 without a configured key, whatever is sent
    (`forgerl gateway` and `forgerl train` always configure one: RUN_DIR/admin_key)."""
    srv = serve(ScriptedEngine([]), tokenizer, admin_key=None)
    tid, key = srv.session()
    before = srv.pool.stats()
    for headers in ({}, {"Authorization": "Bearer"}, {"Authorization": "Bearer None"},
                    {"Authorization": f"Bearer {key}"}):
        r = httpx.post(f"{srv.base_url}/sessions", json={}, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
        r = httpx.post(f"{srv.base_url}/sessions/{tid}/reward", json={"reward": 1.0},
                       headers=headers)
        assert r.status_code == 403, r.text
    assert srv.pool.stats() == before and len(srv.gateway.sessions) == 1
    assert srv.pool.get_trajectory(tid).status == "running"


def test_generated_admin_key_opens_sessions_for_loopback_clients_only(serve, tokenizer):
    """A gateway whose admin key was generated, not configured (`loopback_sessions`, what
    `forgerl gateway` runs without `[gateway] admin_key`) opens a session for a loopback client
    that sends no Authorization header; a wrong key is still a 401, the reward endpoint still
    needs the key, and a non-loopback client gets the 401."""
    srv = serve(ScriptedEngine([]), tokenizer)
    srv.gateway.loopback_sessions = True
    r = httpx.post(f"{srv.base_url}/sessions", json={})
    assert r.status_code == 200 and r.json()["api_key"].startswith("sk-forgerl-")
    tid = r.json()["session_id"]
    r = httpx.post(f"{srv.base_url}/sessions", json={}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401
    r = httpx.post(f"{srv.base_url}/sessions/{tid}/reward", json={"reward": 1.0})
    assert r.status_code == 401 and srv.pool.get_trajectory(tid).status == "running"
    for host in ("10.0.0.7", "192.168.1.2", "example.org", None):
        with pytest.raises(GatewayError) as e:
            require_opener(srv.gateway, None, host)
        assert e.value.status == 401
    require_opener(srv.gateway, None, "::1")  # loopback: no error
    srv.gateway.loopback_sessions = False
    r = httpx.post(f"{srv.base_url}/sessions", json={})
    assert r.status_code == 401


def _wait(cond, limit_s: float = 5.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_idle_session_expires(serve, tokenizer):
    renderer = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(renderer, "5")]), tokenizer, session_idle_timeout_s=1.0)
    r = httpx.post(f"{srv.base_url}/sessions", json={}, headers=srv.admin)
    sid, key = r.json()["session_id"], r.json()["api_key"]
    assert _chat(srv, key).status_code == 200
    assert _wait(lambda: srv.pool.get_trajectory(sid).status != "running")
    t = srv.pool.get_trajectory(sid)
    assert (t.status, t.error, len(t.completions)) == ("failed", "session expired after 1 s idle",
                                                         1)
    assert "unknown or closed API key" in _unauthorized(_chat(srv, key))
    assert srv.gateway.counters["sessions_expired"] == 1
    r = httpx.post(f"{srv.base_url}/sessions/{sid}/reward", json={"reward": 1.0},
                   headers=srv.admin)
    assert r.status_code == 409, r.text  # ended: the late reward is refused, the record kept
    assert srv.pool.get_trajectory(sid).status == "failed"


def test_active_and_controller_sessions_do_not_expire(serve, tokenizer):
    renderer = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(renderer, "5") for _ in range(12)]), tokenizer,
                session_idle_timeout_s=1.0)  # generous: a loaded CI core may stall a call
    r = httpx.post(f"{srv.base_url}/sessions", json={}, headers=srv.admin)
    sid, key = r.json()["session_id"], r.json()["api_key"]
    own_tid, own_key = srv.gateway.open_session(0, 0)  # a controller rollout, not over HTTP
    for _ in range(8):  # > 1.6 s of calls, each well within the timeout of the previous
        assert _chat(srv, key).status_code == 200
        time.sleep(0.2)
    assert srv.pool.get_trajectory(sid).status == "running"
    assert srv.gateway.counters["sessions_expired"] == 0
    assert _wait(lambda: srv.pool.get_trajectory(sid).status == "failed")
    time.sleep(0.5)  # the controller session has been idle > 3 s, three timeouts
    assert srv.pool.get_trajectory(own_tid).status == "running"
    assert srv.gateway.sessions.get(own_key) is not None
    assert _chat(srv, own_key).status_code == 200
    assert srv.gateway.counters["sessions_expired"] == 1
