"""The request log and GET /metrics (issue 46 item 5) through the real app over HTTP.

Pins: one JSON line per request (GET /metrics excepted) with the session's trajectory id, the
protocol, status, method, path and latency, and token counts equal to the recorded completion's
(streamed calls too, stamped when the stream ended); a 401, a refused field (400 naming it), a
context overflow and an unknown route each give one line with the error; /metrics counts the same
requests by protocol and status, the tokens, prefix hits and misses, overflows and open sessions,
in the Prometheus text format; the local engine's queue (running, waiting) is a gauge.
"""

from __future__ import annotations

import asyncio
import json
import logging

import anthropic
import httpx
from prometheus_client.parser import text_string_to_metric_families

from forgerl.engines.local import LocalEngine
from forgerl.gateway.observe import RequestLog
from forgerl.types import SamplingParams

from .conftest import ScriptedEngine, reply

USER = [{"role": "user", "content": "2 + 3?"}]


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics as {(sample name, sorted labels): value}."""
    r = httpx.get(base_url.removesuffix("/v1") + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_every_request_is_one_line_and_counted(serve, tokenizer, renderer, tmp_path):
    path = tmp_path / "requests.jsonl"
    texts = ["5", "Yes.", "Sure.", "Hi."]
    srv = serve(ScriptedEngine([reply(renderer, t) for t in texts], max_model_len=512),
                tokenizer, request_log=path)
    tid, key = srv.session()
    client = srv.client(key)
    first = client.chat.completions.create(model="tiny", messages=USER)
    turn2 = [*USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "Sure?"}]
    with client.chat.completions.create(model="tiny", messages=turn2, stream=True) as stream:
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Yes."
    r = httpx.post(f"{srv.base_url}/responses", json={"model": "tiny", "input": "Hello?"},
                   headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    message = anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key=key,
                                  max_retries=0).messages.create(
        model="tiny", max_tokens=16, messages=[{"role": "user", "content": "Hi"}])
    assert message.content[0].text == "Hi."
    assert httpx.post(f"{srv.base_url}/chat/completions", json={"model": "tiny", "messages": USER},
                      headers={"Authorization": "Bearer nope"}).status_code == 401
    refused = httpx.post(f"{srv.base_url}/chat/completions", headers={
        "Authorization": f"Bearer {key}"}, json={"model": "tiny", "messages": USER,
                                                  "logprobs": True, "top_logprobs": 3})
    assert refused.status_code == 400
    overflow = httpx.post(f"{srv.base_url}/chat/completions", headers={
        "Authorization": f"Bearer {key}"}, json={"model": "tiny", "messages": [
            {"role": "user", "content": "x" * 600}]})
    assert overflow.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(f"{srv.base_url}/models").status_code == 200
    assert httpx.get(f"{srv.base_url}/nowhere").status_code == 404
    metrics = scrape(srv.base_url)

    recorded = srv.pool.get_trajectory(tid).completions
    log = lines(path)
    assert [(x["protocol"], x["method"], x["path"], x["status"]) for x in log] == [
        ("chat", "POST", "/v1/chat/completions", 200),
        ("chat", "POST", "/v1/chat/completions", 200),
        ("responses", "POST", "/v1/responses", 200),
        ("messages", "POST", "/v1/messages", 200),
        ("chat", "POST", "/v1/chat/completions", 401),
        ("chat", "POST", "/v1/chat/completions", 400),
        ("chat", "POST", "/v1/chat/completions", 400),
        ("http", "GET", "/v1/models", 200),
        ("http", "GET", "/v1/nowhere", 404)]
    for line, c in zip(log[:4], recorded, strict=True):
        assert line["session"] == tid and line["latency_ms"] > 0
        assert (line["prompt_tokens"], line["completion_tokens"]) == (
            len(c.prompt_ids), len(c.completion_ids))
    assert first.usage.prompt_tokens == log[0]["prompt_tokens"]
    assert log[1]["first_byte_ms"] <= log[1]["latency_ms"] and "first_byte_ms" not in log[0]
    assert log[4]["code"] == "invalid_api_key" and "session" not in log[4]
    assert (log[5]["refused"], log[5]["code"]) == ("top_logprobs", "unsupported_value")
    assert log[5]["error"] == refused.json()["error"]["message"]
    assert log[6]["code"] == "context_length_exceeded" and log[6]["session"] == tid
    assert log[0]["time"].endswith("Z") or log[0]["time"].endswith("+00:00")

    def m(name: str, **labels: str) -> float:
        return metrics[(name, tuple(sorted(labels.items())))]

    assert m("forgerl_gateway_http_requests_total", protocol="chat", status="200") == 2
    assert m("forgerl_gateway_http_requests_total", protocol="chat", status="400") == 2
    assert m("forgerl_gateway_http_requests_total", protocol="messages", status="200") == 1
    assert m("forgerl_gateway_http_requests_total", protocol="http", status="404") == 1
    assert m("forgerl_gateway_tokens_total", protocol="chat", kind="completion") == sum(
        len(c.completion_ids) for c in recorded[:2])
    assert m("forgerl_gateway_tokens_total", protocol="responses", kind="prompt") == len(
        recorded[2].prompt_ids)
    assert m("forgerl_gateway_errors_total", protocol="chat", code="context_length_exceeded") == 1
    assert m("forgerl_gateway_field_notes_total", protocol="chat", kind="refused") == 1
    assert m("forgerl_gateway_http_request_seconds_count", protocol="chat") == 5
    # the core's counters: turn 2 extended turn 1; the Responses and Messages calls extended
    # no turn: 2 prefix misses, or, where the core keeps traces, 2 more traces and no miss
    assert m("forgerl_gateway_prefix_hits_total") == 1
    traces = metrics.get(("forgerl_gateway_traces_total", ()))
    assert m("forgerl_gateway_prefix_misses_total") + (traces - 1 if traces else 0) == 2
    assert m("forgerl_gateway_requests_total") == 4
    assert m("forgerl_gateway_sessions_open") == 1 and m("forgerl_gateway_calls_in_flight") == 0
    assert m("forgerl_engine_weight_version") == 0
    assert not any(name.startswith("forgerl_engine_requests") for name, _ in metrics)


def test_off_means_no_log_and_no_metrics_route(tokenizer, tmp_path):
    from forgerl.datapool.sqlite import SQLitePool
    from forgerl.gateway.app import Gateway, create_app
    from forgerl.gateway.renderers.renderer import ChatMLRenderer

    pool = SQLitePool(tmp_path / "pool.sqlite")
    gateway = Gateway(ChatMLRenderer(tokenizer), ScriptedEngine([]), pool, "tiny")
    on, off = create_app(gateway), create_app(gateway, None, metrics=False)
    assert "/metrics" in {r.path for r in on.routes}
    assert "/metrics" not in {r.path for r in off.routes} and not off.user_middleware[1:]
    pool.close()


def test_local_engine_reports_running_and_waiting(tiny_model):
    async def main() -> list[dict[str, int]]:
        engine = LocalEngine(tiny_model, max_model_len=256, max_batch_size=1, device="cpu")
        params = SamplingParams(temperature=1.0, max_tokens=200, seed=0)
        streams = [engine.stream([5, 6, 7], params) for _ in range(3)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await firsts[0]  # the first decodes; the others wait behind max_batch_size = 1
        await asyncio.sleep(0.05)
        seen = engine.load()
        for task in firsts[1:]:
            task.cancel()
        await asyncio.gather(*firsts[1:], return_exceptions=True)
        await streams[0].aclose()
        await engine.close()
        return [seen, engine.load()]

    loaded, closed = asyncio.run(main())
    assert loaded == {"running": 1, "waiting": 2}
    assert closed == {"running": 0, "waiting": 0}


def test_a_failed_write_is_logged_once_and_the_request_goes_on(caplog):
    log = RequestLog("/dev/full")  # every write fails with ENOSPC
    with caplog.at_level(logging.WARNING, logger="forgerl.gateway.observe"):
        log.write({"path": "/v1/models"})
        log.write({"path": "/v1/models"})
    log.close()
    assert [r.message for r in caplog.records] == [
        "request log /dev/full: write failed (No space left on device); lines are dropped"]
