"""`forgerl serve CONFIG` as a real process on the tiny model: a session with consent, a call
with the openai SDK, feedback stored in the pool; SIGTERM stops it (exit 143). Without an
[online] section it is a one-line error, exit 2."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
from openai import OpenAI

from forgerl.datapool.sqlite import SQLitePool

FORGERL = [sys.executable, "-m", "forgerl"]
ENV = {**os.environ, "PYTHONPATH": os.getcwd()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_process(tmp_path):
    port, run = free_port(), tmp_path / "run"
    config = tmp_path / "c.toml"
    config.write_text(
        f'run_dir = "{run}"\n[model]\npath = "tiny"\nmax_model_len = 512\n'
        f'[rollout]\nmax_tokens = 8\n[tasks]\neval_size = 2\n'
        f'[serve]\nport = {port}\n[gateway]\nadmin_key = "sk-admin-cli"\n[online]\n')
    proc = subprocess.Popen([*FORGERL, "serve", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"ForgeRL online at http://127.0.0.1:{port}/v1"), line
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                            headers={"Authorization": "Bearer sk-admin-cli"})
        s = http.post("/v1/online/sessions", headers={"X-ForgeRL-Consent": "true"}).json()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=s["api_key"])
        client.chat.completions.create(model="policy", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
        fb = http.post("/v1/online/feedback", json={"session_id": s["session_id"],
                                                    "outcome": "success"})
        assert fb.json() == {"session_id": s["session_id"], "reward": 1.0, "stored": True}
        status = http.get("/v1/online/status").json()
        assert status["incumbent_version"] == 0 and status["counters"]["feedback"] == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 143
    pool = SQLitePool(run / "pool.sqlite")
    try:
        [t] = pool.get_group(0).trajectories
        assert (t.id, t.status, t.reward) == (s["session_id"], "finished", 1.0)
    finally:
        pool.close()
