"""QA defects in the gateway's input checking, found by abuse over real HTTP.

Pins: a reward report must be a finite number (a NaN is stored as NULL and an Infinity as inf
in the pool, and the trainer's `group_advantages` later refuses non-finite rewards), so
`{"reward": NaN}` / `Infinity` / `1e400` must get a 400 and leave the trajectory running;
a request `seed` outside the 64-bit range must be a 400, not a 500 from the rollout engine.
Both currently fail: the gateway answers 200 (reward) and 500 (seed).
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
from forgerl.gateway.renderer import ChatMLRenderer
from forgerl.models import build_byte_tokenizer, build_tiny_model


async def _with_gateway(tmp_path, body):
    torch.set_num_threads(1)
    engine = LocalEngine(build_tiny_model(), max_model_len=256, max_batch_size=2)
    pool = SQLitePool(tmp_path / "pool.sqlite")
    gateway = Gateway(ChatMLRenderer(build_byte_tokenizer()), engine, pool, "tiny", max_tokens=2)
    server = await gateway.serve()
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
            return await body(client)
    finally:
        await server.stop()
        await engine.close()
        pool.close()


@pytest.mark.parametrize("raw", [b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": 1e400}'])
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
    # Observed: 200 {"status": "finished", "reward": null}; pool row ('finished', None or inf).
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
    # Observed: 500 {"error": {"message": "engine error: ValueError: Overflow when unpacking
    # long long", "type": "server_error", ...}}.
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "seed"
