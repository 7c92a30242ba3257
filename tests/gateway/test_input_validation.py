"""Gateway input checking over real HTTP (found by abuse testing).

Pins: a reward report must be a finite JSON number (NaN / Infinity / 1e400 / "1.0" get a 400
and the trajectory stays running: the trainer refuses non-finite rewards later); a `seed`
outside the 64-bit range is a 400 naming `seed`, not an engine 500; `n` above 128 (OpenAI's
bound) is a 400 naming `n`, while n = 2 on the tiny model records two completions; unknown routes
and methods answer OpenAI-shaped JSON errors.
"""

from __future__ import annotations

import asyncio
import sqlite3

import httpx
import pytest
import torch

from forgerl.datapool.sqlite import SQLitePool
from forgerl.engines.local import LocalEngine
from forgerl.gateway.app import Gateway
from forgerl.gateway.renderers.renderer import ChatMLRenderer
from forgerl.models import build_byte_tokenizer, build_tiny_model


async def _with_gateway(tmp_path, body, gateway_ref: list | None = None):
    torch.set_num_threads(1)
    engine = LocalEngine(build_tiny_model(), max_model_len=256, max_batch_size=2)
    pool = SQLitePool(tmp_path / "pool.sqlite")
    gateway = Gateway(ChatMLRenderer(build_byte_tokenizer()), engine, pool, "tiny", max_tokens=2,
                      admin_key="admin")
    server = await gateway.serve()
    if gateway_ref is not None:
        gateway_ref.append(gateway)
    try:  # the admin key by default; model calls send their session's key
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30,
                                     headers={"Authorization": "Bearer admin"}) as client:
            return await body(client)
    finally:
        await server.stop()
        await engine.close()
        pool.close()


@pytest.mark.parametrize(
    "raw", [b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": 1e400}', b'{"reward": "1"}']
)
def test_non_finite_reward_is_refused(tmp_path, raw):
    async def body(client):
        session = (await client.post("/sessions", json={})).json()
        r = await client.post(
            f"/sessions/{session['session_id']}/reward",
            content=raw,
            headers={"content-type": "application/json"},
        )
        return session["session_id"], r

    sid, r = asyncio.run(_with_gateway(tmp_path, body))
    row = sqlite3.connect(tmp_path / "pool.sqlite").execute(
        "SELECT status, reward FROM trajectories WHERE id=?", (sid,)
    ).fetchone()
    assert r.status_code == 400, r.text
    assert "error" in r.json()
    assert row == ("running", None)


def test_out_of_range_seed_is_a_400_not_a_500(tmp_path):
    async def body(client):
        session = (await client.post("/sessions", json={})).json()
        return await client.post(
            "/chat/completions",
            headers={"Authorization": f"Bearer {session['api_key']}"},
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                  "seed": 2**70},
        )

    r = asyncio.run(_with_gateway(tmp_path, body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "seed"


def test_n_bounds_and_unknown_routes_are_openai_errors(tmp_path):
    async def body(client):
        session = (await client.post("/sessions", json={})).json()
        auth = {"Authorization": f"Bearer {session['api_key']}"}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        n2 = await client.post("/chat/completions", headers=auth, json={**chat, "n": 2, "seed": 3})
        n129 = await client.post("/chat/completions", headers=auth, json={**chat, "n": 129})
        missing = await client.post("/embeddings", headers=auth, json={})
        wrong_method = await client.get("/chat/completions", headers=auth)
        return session["session_id"], n2, n129, missing, wrong_method

    sid, n2, n129, missing, wrong_method = asyncio.run(_with_gateway(tmp_path, body))
    assert n2.status_code == 200 and [c["index"] for c in n2.json()["choices"]] == [0, 1]
    pool = SQLitePool(tmp_path / "pool.sqlite")
    a, b = pool.get_trajectory(sid).completions
    pool.close()
    assert a.prompt_ids == b.prompt_ids and len(a.completion_ids) == len(b.completion_ids) == 2
    assert (a.sampling.seed, b.sampling.seed) == (3, 4)  # choice i samples with seed + i
    assert n2.json()["usage"]["completion_tokens"] == 4
    assert n129.status_code == 400 and n129.json()["error"]["param"] == "n"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"


def test_controller_rollouts_take_no_reward_over_http(tmp_path):
    """Only sessions opened with POST /v1/sessions are rewarded over HTTP; a rollout the
    controller opened (and will score itself) answers 403 and stays running."""
    async def body(client):
        trajectory_id, _ = gateway_ref[0].open_session(task_index=3, rollout_index=1)
        r = await client.post(f"/sessions/{trajectory_id}/reward", json={"reward": 1.0})
        return trajectory_id, r

    gateway_ref: list = []
    sid, r = asyncio.run(_with_gateway(tmp_path, body, gateway_ref))
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    row = sqlite3.connect(tmp_path / "pool.sqlite").execute(
        "SELECT status, reward FROM trajectories WHERE id=?", (sid,)
    ).fetchone()
    assert row == ("running", None)
