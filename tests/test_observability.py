"""The request log, GET /metrics and the context-length warning of a run (issue 46 item 5), for
`forgerl gateway` (a real process, stopped by SIGTERM) and `forgerl train` (`start_services`).

Pins: RUN_DIR/requests.jsonl gets one line per request, every line of a cleanly stopped gateway
included; /metrics answers without a key while the sessions API needs one; a max_model_len above
the model's max_position_embeddings (the tiny model: 2048) is warned about once, at start, in the
process's output; at or below it, nothing. Without `[gateway] admin_key` the sessions API takes
the key written to RUN_DIR/admin_key (CASES.md C26).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from forgerl.config import load_config
from forgerl.controller import start_services

WARNING = "exceeds the 2048 positions the model was trained on"
ADMIN = "admin-key-1"


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_forgerl_gateway_logs_every_request_and_stops_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    config = tmp_path / "c.toml"
    config.write_text(f"run_dir = '{run_dir}'\n[model]\npath = 'tiny'\nmax_model_len = 4096\n"
                      "[rollout]\nmax_tokens = 4\n"
                      "[tasks]\neval_size = 0\n")
    proc = subprocess.Popen([sys.executable, "-m", "forgerl", "gateway", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killer = threading.Timer(180, proc.kill)  # a hung start fails the test, never the suite
    killer.start()
    try:
        line = proc.stdout.readline()
        assert line.startswith("ForgeRL gateway at http://127.0.0.1:"), line
        base = line.split()[3]
        assert line.strip().endswith(f"; admin key in {run_dir / 'admin_key'}; metrics at "
                                     f"{base.removesuffix('/v1')}/metrics")
        assert (run_dir / "admin_key").stat().st_mode & 0o777 == 0o600  # C26: never keyless
        # no key configured: a loopback client opens a session without one, the reward
        # endpoint still needs the generated key (test_session_admin.py)
        keyless = httpx.post(f"{base}/sessions", json={}, timeout=30).json()
        r = httpx.post(f"{base}/sessions/{keyless['session_id']}/reward", json={"reward": 1.0},
                       timeout=30)
        assert r.status_code == 401, r.text
        admin = {"Authorization": f"Bearer {(run_dir / 'admin_key').read_text()}"}
        opened = httpx.post(f"{base}/sessions", json={}, headers=admin, timeout=30).json()
        chat = httpx.post(f"{base}/chat/completions", timeout=60, json={
            "model": "policy", "messages": [{"role": "user", "content": "Hi"}]},
            headers={"Authorization": f"Bearer {opened['api_key']}"})
        assert chat.status_code == 200, chat.text
        metrics = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=30)
        assert metrics.status_code == 200
        assert ('forgerl_gateway_http_requests_total{protocol="chat",status="200"} 1.0'
                in metrics.text)
        assert "forgerl_engine_requests{state=\"running\"} 0.0" in metrics.text
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        killer.cancel()
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.count(WARNING) == 1, stderr
    log = _lines(run_dir / "requests.jsonl")
    assert [(x["path"], x["status"]) for x in log] == [
        ("/v1/sessions", 200), (f"/v1/sessions/{keyless['session_id']}/reward", 401),
        ("/v1/sessions", 200), ("/v1/chat/completions", 200)]
    log = log[2:]
    usage = chat.json()["usage"]
    assert log[0]["session"] == log[1]["session"] == opened["session_id"]
    assert (log[1]["prompt_tokens"], log[1]["completion_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])


async def _agent(task: dict, base_url: str, api_key: str) -> str:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["question"]}], max_tokens=4)
    return "0"


def test_forgerl_train_logs_its_rollouts_and_warns_once(tmp_path, caplog):
    run_dir = tmp_path / "run"
    config = load_config(None, [
        "--run_dir", str(run_dir), "--model.path", "tiny", "--model.max_model_len", "4096",
        "--rollout.group_size", "2", "--rollout.tasks_per_step", "1", "--rollout.max_tokens", "4",
        "--tasks.eval_size", "0", "--gateway.admin_key", ADMIN])

    async def main() -> tuple[list[str], str]:
        async with start_services(config, _agent) as s:
            s.admit()
            batch = await s.next_batch()
            ids = [t.id for g in batch for t in s.pool.get_group(g).trajectories]
            async with httpx.AsyncClient() as client:
                r = await client.get(s.server.base_url.removesuffix("/v1") + "/metrics")
            return ids, r.text

    with caplog.at_level(logging.WARNING, logger="forgerl.controller.startup"):
        ids, metrics = asyncio.run(main())
    assert [r.message for r in caplog.records if WARNING in r.message] == [
        "model.max_model_len (4096) exceeds the 2048 positions the model was trained on "
        "(max_position_embeddings): longer contexts may degrade"]
    log = _lines(run_dir / "requests.jsonl")  # the batch's rollouts, and those admitted beside
    assert set(ids) <= {x["session"] for x in log} and len(ids) == 2
    assert {(x["protocol"], x["path"], x["status"]) for x in log} == {
        ("chat", "/v1/chat/completions", 200)}
    served = re.search(r'forgerl_gateway_http_requests_total\{protocol="chat",status="200"\} '
                       r"(\d+)\.0", metrics)
    assert served and 2 <= int(served.group(1)) <= len(log)


def test_no_warning_within_the_trained_positions(caplog):
    from forgerl.controller.startup import warn_positions
    from forgerl.models import build_tiny_model

    model_config = build_tiny_model().config
    with caplog.at_level(logging.WARNING, logger="forgerl.controller.startup"):
        assert warn_positions(2048, model_config) is None
        assert warn_positions(512, model_config) is None
        assert warn_positions(2049, model_config).startswith("model.max_model_len (2049)")
        assert warn_positions(4096, object()) is None  # a config without the field
    assert len(caplog.records) == 1
