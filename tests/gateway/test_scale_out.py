"""N gateway processes behind one address (issue 51 item 3), real processes over HTTP.

`forgerl gateway` with `[gateway] processes = 2` (tiny model): two worker processes behind the
front. Sessions spread over both and each session's calls land on the worker that opened it
(`x-forgerl-gateway`); the openai and anthropic SDKs work through the front, plain and
streamed; SIGKILL of one worker mid-session: its session's calls get a 503 the SDKs raise as
APIStatusError naming the dead worker, its trajectory is failed in the pool with its committed
completions intact, the other worker's session and new sessions go on; stopping the front
stops every worker. On SQLite and on PostgreSQL. CASES.md C20 through the front: 300 sessions
on two gateways, all in flight at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from forgerl.datapool import open_pool

ADMIN = "scale-admin"
USER = [{"role": "user", "content": "2 + 3?"}]


def _start(tmp_path: Path, pool: str) -> tuple[subprocess.Popen[str], str, list[int]]:
    config = tmp_path / "config.toml"
    config.write_text(f"run_dir = '{tmp_path / 'run'}'\n[model]\npath = 'tiny'\n[rollout]\n"
                      f"max_tokens = 8\n[gateway]\nprocesses = 2\nadmin_key = '{ADMIN}'\n"
                      f"[datapool]\nurl = '{pool}'\n")
    proc = subprocess.Popen([sys.executable, "-m", "forgerl", "gateway", str(config)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ForgeRL gateway at http://"):
        proc.kill()
        pytest.fail(f"forgerl gateway did not start: {line!r}")
    url = line.split()[3]
    pids = [int(p) for p in line.split("pids ")[1].split(")")[0].split()]
    return proc, url, pids


def _session(url: str) -> tuple[str, str, int]:
    r = httpx.post(f"{url}/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    return r.json()["session_id"], r.json()["api_key"], int(r.headers["x-forgerl-gateway"])


def _chat(url: str, key: str) -> int:
    r = httpx.post(f"{url}/chat/completions", json={"model": "policy", "messages": USER},
                   headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.headers["x-forgerl-gateway"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.fixture(params=["sqlite", "postgres"])
def pool_url(request, tmp_path) -> str:
    """The run's pool: "" (SQLite at RUN_DIR/pool.sqlite) or a fresh PostgreSQL database."""
    return request.getfixturevalue("pg_url") if request.param == "postgres" else ""


def test_two_gateways_behind_one_front(tmp_path, pool_url):
    proc, url, pids = _start(tmp_path, pool_url)
    try:
        sessions = [_session(url) for _ in range(4)]
        assert sorted(w for _, _, w in sessions) == [0, 0, 1, 1]  # spread over both
        for _, key, w in sessions:
            assert {_chat(url, key) for _ in range(2)} == {w}  # sticky
        (sid0, key0, _), (sid1, key1, _) = [next(s for s in sessions if s[2] == w)
                                            for w in (0, 1)]
        oai = openai.OpenAI(base_url=url, api_key=key0, max_retries=0, timeout=60)
        assert oai.chat.completions.create(model="policy", messages=USER).choices
        chunks = list(oai.chat.completions.create(model="policy", messages=USER, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        ant = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=key1, max_retries=0)
        assert ant.messages.create(model="policy", max_tokens=8, messages=USER).content
        with ant.messages.stream(model="policy", max_tokens=8, messages=USER) as stream:
            assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")

        pool = open_pool(pool_url or tmp_path / "run" / "pool.sqlite")
        committed = len(pool.get_trajectory(sid0).completions)
        assert committed == 4  # two httpx calls, the openai SDK's two
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as e:
            oai.chat.completions.create(model="policy", messages=USER)
        assert e.value.status_code == 503 and "gateway worker 0 is down" in e.value.message
        ant0 = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=key0, max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as a:
            ant0.messages.create(model="policy", max_tokens=8, messages=USER)
        assert a.value.status_code == 503 and "gateway worker 0 is down" in str(a.value)
        deadline = time.monotonic() + 10
        while pool.get_trajectory(sid0).status == "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        failed = pool.get_trajectory(sid0)
        assert failed.status == "failed" and "gateway worker 0 died" in (failed.error or "")
        assert len(failed.completions) == committed  # what it committed stays
        assert _chat(url, key1) == 1  # the other worker's session goes on
        assert _session(url)[2] == 1  # new sessions go to the live worker
        assert pool.get_trajectory(sid1).status == "running"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
    deadline = time.monotonic() + 10
    while _alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids[1])  # stopping the front stops its workers


def test_front_in_process(serve, tokenizer):
    """The front over two in-process gateways: sticky routing, streaming, a 100-continue, the
    loopback rule, and a stopped worker's sessions answered 503 in each API's shape."""
    import asyncio
    import socket

    from forgerl.gateway.front import Front
    from forgerl.gateway.renderers.renderer import ChatMLRenderer

    from .conftest import ScriptedEngine, reply

    renderer = ChatMLRenderer(tokenizer)
    srvs = [serve(ScriptedEngine([reply(renderer, "5")] * 8), tokenizer) for _ in range(2)]
    dead: list[tuple[int, list[str], str]] = []
    front = Front([("127.0.0.1", s.server.port) for s in srvs],
                  lambda i, ids, why: dead.append((i, ids, why)), loopback_sessions=True)
    port = asyncio.run_coroutine_threadsafe(front.start(), srvs[0].loop).result(10)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=30) as c:
        opened = [c.post("/sessions", json={}, headers=srvs[0].admin) for _ in range(2)]
        by_worker = {int(r.headers["x-forgerl-gateway"]): r.json() for r in opened}
        assert sorted(by_worker) == [0, 1]
        for w, s in by_worker.items():
            auth = {"Authorization": f"Bearer {s['api_key']}"}
            r = c.post("/chat/completions", json={"model": "tiny", "messages": USER}, headers=auth)
            assert r.status_code == 200 and r.headers["x-forgerl-gateway"] == str(w)
            assert r.json()["choices"][0]["message"]["content"] == "5"
            assert len(srvs[w].pool.get_trajectory(s["session_id"]).completions) == 1
        auth0 = {"x-api-key": by_worker[0]["api_key"]}
        with c.stream("POST", "/chat/completions", headers=auth0,
                      json={"model": "tiny", "messages": USER, "stream": True}) as r:
            events = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert r.headers["x-forgerl-gateway"] == "0" and events[-1] == "data: [DONE]"
        assert c.post("/chat/completions", json={"model": "tiny", "messages": USER},
                      headers={"Authorization": "Bearer sk-unknown"}).status_code == 401
        assert front._refusal("/v1/sessions", 0, "10.1.2.3", []).status == 401  # from afar
        assert front._refusal("/v1/sessions", 0, "127.0.0.1", []) is None

        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.sendall(b"POST /v1/sessions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                        b"content-length: 2\r\nauthorization: Bearer "
                        + srvs[0].admin["Authorization"].split()[1].encode() + b"\r\n\r\n")
            assert raw.recv(100).startswith(b"HTTP/1.1 100 ")
            raw.sendall(b"{}")
            assert raw.recv(4096).startswith(b"HTTP/1.1 200 ")

        asyncio.run_coroutine_threadsafe(srvs[0].server.stop(), srvs[0].loop).result(30)
        r = c.post("/chat/completions", json={"model": "tiny", "messages": USER},
                   headers={"Authorization": f"Bearer {by_worker[0]['api_key']}"})
        assert r.status_code == 503 and r.headers["x-should-retry"] == "false"
        err = r.json()["error"]
        assert err["code"] == "gateway_unavailable" and "gateway worker 0 is down" in err["message"]
        r = c.post("/messages", headers=auth0,
                   json={"model": "tiny", "max_tokens": 8, "messages": USER})
        assert r.status_code == 503 and r.json()["type"] == "error"
        assert "gateway worker 0 is down" in r.json()["error"]["message"]
        assert [(i, ids) for i, ids, _ in dead] == [(0, [by_worker[0]["session_id"]])]
        r = c.post("/sessions", json={}, headers=srvs[0].admin)
        assert r.status_code == 200 and r.headers["x-forgerl-gateway"] == "1"
    asyncio.run_coroutine_threadsafe(front.stop(), srvs[0].loop).result(10)


def test_front_c20_all_sessions_in_flight_at_once(serve, tokenizer):
    """CASES.md C20 through the front: 300 sessions spread over two gateways behind it, one chat
    call each at the same moment (one AsyncOpenAI client per session, as 300 agents): all 300
    are in flight at the engine at once (both gateways share one `Gate`, which answers no call
    before 300 are in), 150 on each worker, 0 errors, each session recording its own answer.
    And 300 connections to a front too busy to accept complete at once (its listen backlog)."""
    import asyncio
    import socket
    import threading

    from forgerl.gateway.front import Front
    from forgerl.gateway.renderers.renderer import ChatMLRenderer

    from .conftest import reply
    from .test_concurrency import Gate, N

    answer = reply(ChatMLRenderer(tokenizer), "ok")
    gate = Gate([answer] * N)
    srvs = [serve(gate, tokenizer) for _ in range(2)]
    front = Front([("127.0.0.1", s.server.port) for s in srvs])
    port = asyncio.run_coroutine_threadsafe(front.start(), srvs[0].loop).result(10)
    url = f"http://127.0.0.1:{port}/v1"
    with httpx.Client(base_url=url, timeout=30) as c:
        opened = [c.post("/sessions", json={}, headers=srvs[0].admin).json() for _ in range(N)]
    assert front.open_sessions == [N // 2, N // 2]

    # the listen backlog: N connections complete while the front's loop accepts none (a busy
    # front); asyncio's default backlog of 100 would leave the rest waiting for a SYN resend
    blocked, release = threading.Event(), threading.Event()
    srvs[0].loop.call_soon_threadsafe(lambda: (blocked.set(), release.wait(30)))
    blocked.wait(10)
    conns: list[socket.socket] = []
    try:
        for _ in range(N):
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
    finally:
        release.set()
        for conn in conns:
            conn.close()
    assert len(conns) == N

    async def one(key: str) -> str | None:
        async with openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0,
                                      timeout=120) as client:
            out = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}])
            return out.choices[0].message.content

    async def burst() -> list[str | BaseException | None]:
        return await asyncio.gather(*[one(s["api_key"]) for s in opened], return_exceptions=True)

    try:
        results = asyncio.run(burst())
        assert [r for r in results if isinstance(r, BaseException)] == []
        assert gate.peak == N
        assert results == ["ok"] * N
        for s in opened:
            pool = srvs[front.trajectories[s["session_id"]]].pool
            (turn,) = pool.get_trajectory(s["session_id"]).completions
            assert turn.completion_ids == answer.ids
        # a rewarded session is forgotten by the front: its key no longer routes, it no longer
        # counts as open, and a later call with it gets the workers' own 401
        with httpx.Client(base_url=url, timeout=30) as c:
            for s in opened:
                r = c.post(f"/sessions/{s['session_id']}/reward", json={"reward": 1.0},
                           headers=srvs[0].admin)
                assert r.status_code == 200, r.text
            late = c.post("/chat/completions", json={"model": "tiny", "messages": []},
                          headers={"Authorization": f"Bearer {opened[0]['api_key']}"})
        assert (front.open_sessions, front.keys, front.trajectories) == ([0, 0], {}, {})
        assert late.status_code == 401 and late.json()["error"]["code"] == "invalid_api_key"
    finally:
        asyncio.run_coroutine_threadsafe(front.stop(), srvs[0].loop).result(10)


def test_train_refuses_processes(tmp_path):
    """`forgerl train` serves one gateway process: processes > 1 is a ConfigError naming it."""
    import asyncio

    from forgerl.config import ConfigError, load_config
    from forgerl.controller import run

    config = load_config(None, ["--gateway.processes=2", f"--run_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"^gateway\.processes: forgerl train"):
        asyncio.run(run(config))
    assert not (tmp_path / "run").exists()
