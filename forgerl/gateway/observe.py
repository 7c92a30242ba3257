"""What the gateway did, for whoever runs it: a JSON-lines request log and Prometheus metrics.

Data flow: `Observer` (the app's outermost ASGI middleware) opens each HTTP request's entry
(`telemetry.begin`); the routes and the core note into it while the request runs (`telemetry.note`:
session, trace, token counts, fields ignored or applied approximately, tools left out, the error);
once the response has ended (a stream: after its last chunk, or when its client left) the
middleware stamps time, protocol, method, path, status and latency, appends the line to the run's
`RequestLog` and counts it in `Metrics`. GET /metrics (app.py) renders `Metrics`, whose gauges
(open and busy sessions, the engine's queue) and the core's counters are read at scrape time.
GET /metrics itself is neither logged nor counted.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from forgerl.gateway import core, telemetry

log = logging.getLogger(__name__)

PROTOCOLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
             "/v1/responses": "responses", "/v1/messages": "messages",
             "/v1/messages/count_tokens": "messages"}
"""The protocol of each model route; any other path is logged as protocol "http"."""

COUNTERS = {
    "requests": "model calls prepared for the engine (a call of n choices counts once)",
    "completion_tokens": "sampled tokens recorded in the pool",
    "prefix_hits": "calls whose prompt extended an earlier turn's ids (TITO reuse)",
    "prefix_misses": "calls of a session with turns whose prompt extended none (a new branch)",
    "traces": "traces started (a call that extends no earlier turn of its session)",
    "context_overflows": "calls refused because the session's context outgrew max_model_len",
    "tool_parse_errors": "tool calls kept as text (bad JSON, undeclared tool, unclosed block)",
    "engine_errors": "engine failures answered as 500",
    "client_disconnects": "calls cancelled because their client went away",
    "tokens_after_stop": "sampled tokens past a stop string, dropped from the record",
    "sessions_expired": "HTTP sessions closed after session_idle_timeout_s without a call",
    "untokenized_replies": "engine answers without token ids, recorded as context only",
    "item_token_ids": "calls whose sent-back Responses token ids were used or overruled"}
"""Help text of the core's counters (`core.Gateway.counters`); any other key is exported too."""


class RequestLog:
    """Appends one JSON object per line to `path` (created, or appended to on resume) with one
    `os.write` per line on an O_APPEND descriptor: a line is in the file (the page cache) as soon
    as its request ends, whole, so a stop of any kind loses no line already written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.failed = False

    def write(self, entry: dict[str, Any]) -> None:
        """Append `entry` (values JSON-encodable; anything else as its str) as one line. A
        failed write (disk full) is logged once and the line dropped: the request is answered."""
        if self._fd is not None:
            line = json.dumps(entry, ensure_ascii=False, separators=(",", ":"), default=str)
            try:
                os.write(self._fd, (line + "\n").encode())
            except OSError as e:
                if not self.failed:
                    log.warning("request log %s: write failed (%s); lines are dropped", self.path,
                                e.strerror or e)
                self.failed = True

    def close(self) -> None:
        """Close the file; later writes are dropped. Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Metrics:
    """The gateway's Prometheus metrics, in a registry of their own (one per app).

    Counted per logged request (`count`): forgerl_gateway_http_requests_total{protocol, status},
    forgerl_gateway_http_request_seconds{protocol} (histogram), forgerl_gateway_tokens_total
    {protocol, kind = prompt | completion}, forgerl_gateway_errors_total{protocol, code},
    forgerl_gateway_field_notes_total{protocol, kind = ignored | approximated | left_out |
    refused} (one per field or tool named). Read at scrape time (`Live`): every core counter
    as forgerl_gateway_<name>_total (traces started among them), the sessions gauges and the
    engine's queue.
    """

    def __init__(self, gateway: core.Gateway) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("forgerl_gateway_http_requests", "HTTP requests answered",
                                ["protocol", "status"], registry=r)
        self.seconds = Histogram(
            "forgerl_gateway_http_request_seconds", "HTTP request latency, until the response "
            "(a stream: its last chunk) was sent", ["protocol"], registry=r,
            buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300))
        self.tokens = Counter("forgerl_gateway_tokens", "prompt and completion tokens of "
                              "answered model calls", ["protocol", "kind"], registry=r)
        self.errors = Counter("forgerl_gateway_errors", "error answers by the gateway's error "
                              "code (context_length_exceeded: a context overflow)",
                              ["protocol", "code"], registry=r)
        self.notes = Counter("forgerl_gateway_field_notes", "fields accepted without effect, "
                             "applied approximately, tools left out, fields refused",
                             ["protocol", "kind"], registry=r)
        r.register(Live(gateway))
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)  # labels() takes a lock each time: cache the children
        if (child := self._children.get(key)) is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def count(self, line: dict[str, Any], seconds: float) -> None:
        """Count one finished request from its log line (see the class docstring)."""
        protocol = line["protocol"]
        self._child(self.requests, protocol, str(line["status"])).inc()
        self._child(self.seconds, protocol).observe(seconds)
        for kind in ("prompt", "completion"):
            if n := line.get(f"{kind}_tokens"):
                self._child(self.tokens, protocol, kind).inc(n)
        if code := line.get("code"):
            self._child(self.errors, protocol, str(code)).inc()
        for kind in ("ignored", "approximated", "left_out"):
            if n := len(line.get(kind) or ()):
                self._child(self.notes, protocol, kind).inc(n)
        if line.get("refused"):
            self._child(self.notes, protocol, "refused").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        return generate_latest(self.registry)


class Live:
    """A collector of what is read at scrape time: the core's counters
    (forgerl_gateway_<name>_total), forgerl_gateway_sessions_open (sessions whose key works),
    forgerl_gateway_sessions_active (with a model call running), forgerl_gateway_calls_in_flight,
    forgerl_engine_weight_version and, for an engine with `load()` (local, vllm, a router of
    them), forgerl_engine_requests{state = running | waiting}."""

    def __init__(self, gateway: core.Gateway) -> None:
        self.gateway = gateway

    def collect(self) -> Iterator[Metric]:
        g = self.gateway
        for name, value in g.counters.items():
            yield CounterMetricFamily(f"forgerl_gateway_{name}",
                                      COUNTERS.get(name, f"gateway counter {name}"), value=value)
        sessions = g.sessions.open()
        for name, text, value in (
                ("sessions_open", "open sessions (their keys authenticate)", len(sessions)),
                ("sessions_active", "sessions with a model call running",
                 sum(s.in_flight > 0 for s in sessions)),
                ("calls_in_flight", "model calls running", sum(s.in_flight for s in sessions))):
            yield GaugeMetricFamily(f"forgerl_gateway_{name}", text, value=value)
        yield GaugeMetricFamily("forgerl_engine_weight_version", "weight version new requests "
                                "are served by", value=g.engine.weight_version)
        if callable(load := getattr(g.engine, "load", None)):
            family = GaugeMetricFamily("forgerl_engine_requests", "requests at the engine: "
                                       "decoding (running) or queued (waiting)", labels=["state"])
            for state, n in load().items():
                family.add_metric([state], n)
            yield family


ASGIApp = Callable[[dict, Callable, Callable], Coroutine[Any, Any, None]]


class Observer:
    """ASGI middleware: one `RequestLog` line (when `log` is set) and one `Metrics.count` (when
    `metrics` is set) per HTTP request but GET /metrics, stamped once the response has ended.

    Line fields: time (ISO 8601 UTC, the request's arrival), protocol (`PROTOCOLS`), method,
    path, status (499: the client left before an answer), latency_ms, first_byte_ms (streams:
    until the response headers were sent), then whatever was noted (`telemetry.note`): session,
    trace, prompt_tokens, completion_tokens, ignored, approximated, left_out, refused, error,
    code.
    """

    def __init__(self, app: ASGIApp, log: RequestLog | None, metrics: Metrics | None) -> None:
        self.app, self.log, self.metrics = app, log, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            return await self.app(scope, receive, send)
        entry, began, wall = telemetry.begin(), time.perf_counter(), time.time()
        answer: dict[str, Any] = {}

        async def sent(message: dict) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                if any(k == b"content-type" and v.startswith(b"text/event-stream")
                       for k, v in message.get("headers", ())):
                    answer["first_byte_ms"] = round(1e3 * (time.perf_counter() - began), 2)
            await send(message)

        status = 499  # no answer sent: the client left (the task was cancelled)
        try:
            await self.app(scope, receive, sent)
        except Exception:
            status = 500  # the server answers it
            raise
        finally:
            seconds = time.perf_counter() - began
            path = scope["path"]
            line = {"time": datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds"),
                    "protocol": PROTOCOLS.get(path, "http"), "method": scope["method"],
                    "path": path, "status": status, "latency_ms": round(1e3 * seconds, 2),
                    **answer, **entry}
            if self.log is not None:
                self.log.write(line)
            if self.metrics is not None:
                self.metrics.count(line, seconds)
