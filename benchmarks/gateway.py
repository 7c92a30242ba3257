"""Gateway overhead: ForgeRL's gateway (recording on) against a bare FastAPI stub, same bytes.

Run: `.venv/bin/python benchmarks/gateway.py [--quick]` (about two minutes on 2 cores; --quick:
a fifth of the requests). Each server runs in its own process on 127.0.0.1, the client in
this one:

- gateway: `Gateway` over `InstantEngine` (a rollout engine that returns a fixed 44-token
  completion at once, no decoding), the byte tokenizer (forgerl.models), recording into a real
  SQLitePool (WAL, synchronous=FULL) in a temporary folder; served by `Gateway.serve`, twice:
  "off" (no request log, no GET /metrics) and "on" (every request logged to requests.jsonl and
  counted for /metrics, as `forgerl gateway` and `forgerl train` run by default).
- stub: a bare FastAPI app under uvicorn that answers each route with the bytes the gateway
  answered to the same request (captured at start-up): the floor any Python ASGI server has.

Workloads, each run against the stub, then the gateway off, then on:
- sequential: 500 chat calls with the official `openai` client on one keep-alive connection:
  50 sessions x 10 turns, each turn extending the last (TITO reuse); p50 / p99 latency, and
  p50 of 500 GET /v1/models.
- concurrent: 64 clients (one httpx.AsyncClient and keep-alive connection each), 2,000 chat
  calls in 10-turn conversations; requests/s.
- stream: 16 clients, 400 `stream: true` calls; SSE events (chunks) per second, [DONE] counted.
  The engine streams its 44 tokens (`InstantEngine.stream`, all at once): 46 events per call
  (role, 43 content deltas, finish, [DONE]); the stub replays the same 46 events.
- stream latency (gateway only): a third child serves the gateway over a paced engine (a token
  every 5 ms); 50 sequential streamed calls; per token, the time from the engine's
  `TokenEvent.sampled_at` to the arrival of its content chunk in this process (one
  CLOCK_MONOTONIC clock for both processes), p50 / p99.
- sessions: 200 clients at once, each opening a session (POST /v1/sessions) and making 3 calls
  on it; wall seconds, and errors (any status but 200, or an exception), which must be 0.

Prints one table: the stub's value, the gateway's off and on, off - stub and on - off (latency:
ms added) or off / stub and on / off (rates); then the request log's size and GET /metrics'
latency after the workloads. Numbers are from one run on a shared machine: compare columns, not
runs. Reports: benchmarks/results/2026-12-01-gateway-overhead.md (the first), and
2026-12-06-gateway-request-log.md (off vs on). The issue's targets: <= 2 ms added p50, >= 1,000
requests/s at 64 clients, >= 5,000 streamed chunks/s, <= 2 ms from sampling to the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from forgerl.engines.base import TokenEvent
from forgerl.types import GenerateOutput, SamplingParams

MODEL = "bench"
ADMIN_KEY = "bench-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
REPLY = "The answer is 42. Tell me if you need more."
HERE = Path(__file__).resolve()


class InstantEngine:
    """A RolloutEngine that answers every request at once with the same completion ids.

    completion_ids: `REPLY` encoded + the end-of-turn id (44 ids with the byte tokenizer),
    logprobs -0.5 each, weight_version 0; cut at params.max_tokens (finish "length").
    `stream` yields them one TokenEvent at a time, all at once, or one every `interval_s`
    seconds; with `log` set, each stream's `sampled_at` list is appended to it as a JSON line.
    """

    def __init__(self, ids: list[int], max_model_len: int = 16384, interval_s: float = 0.0,
                 log: Path | None = None):
        self.ids, self.max_model_len, self.weight_version = ids, max_model_len, 0
        self.interval_s, self.log = interval_s, log

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerateOutput:
        ids = self.ids[: params.max_tokens]
        finish = "stop" if len(ids) == len(self.ids) else "length"
        return GenerateOutput(list(ids), [-0.5] * len(ids), [0] * len(ids), finish)

    async def stream(self, prompt_ids: list[int], params: SamplingParams,
                     ) -> AsyncIterator[TokenEvent | GenerateOutput]:
        sampled = []
        for t in self.ids[: params.max_tokens]:
            if self.interval_s:
                await asyncio.sleep(self.interval_s)
            sampled.append(time.perf_counter())
            yield TokenEvent(t, -0.5, 0, sampled[-1])
        if self.log is not None:
            with self.log.open("a") as f:
                f.write(json.dumps(sampled) + "\n")
        yield await self.generate(prompt_ids, params)

    async def update_weights(self, state_dict: Any, version: int) -> None:
        self.weight_version = version

    async def close(self) -> None:
        pass


# ---- servers (child processes) ---------------------------------------------------------------


async def serve_gateway(pool_dir: str, paced: bool = False, observed: bool = False) -> None:
    """Child process: the gateway with recording on; prints `PORT n` once it accepts.
    `paced`: the engine samples a token every 5 ms and logs when (the latency workload).
    `observed`: the request log (POOL_DIR/requests.jsonl) and GET /metrics on; else both off."""
    from forgerl.datapool.sqlite import SQLitePool
    from forgerl.gateway.app import Gateway
    from forgerl.gateway.renderers.renderer import ChatMLRenderer
    from forgerl.models import build_byte_tokenizer

    renderer = ChatMLRenderer(build_byte_tokenizer())
    ids = [*renderer.encode(REPLY), renderer.end_of_turn_id]
    engine = InstantEngine(ids, interval_s=0.005, log=Path(pool_dir) / "sampled.jsonl") if paced \
        else InstantEngine(ids)
    name = "paced" if paced else "observed" if observed else "pool"
    pool = SQLitePool(Path(pool_dir) / f"{name}.sqlite")
    gateway = Gateway(renderer, engine, pool, MODEL, admin_key=ADMIN_KEY)
    server = await gateway.serve("127.0.0.1", 0, metrics=observed,
                                 request_log=Path(pool_dir) / "requests.jsonl" if observed
                                 else None)
    print(f"PORT {server.port}", flush=True)
    await asyncio.Event().wait()


async def serve_stub(bodies_path: str) -> None:
    """Child process: a bare FastAPI app answering the captured bytes; prints `PORT n`."""
    bodies = json.loads(Path(bodies_path).read_text())
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        if json.loads(await request.body()).get("stream"):
            return StreamingResponse(iter(bodies["stream"]), media_type="text/event-stream")
        return Response(bodies["chat"], media_type="application/json")

    @app.post("/v1/sessions")
    async def sessions() -> Response:
        return Response(bodies["session"], media_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(bodies["models"], media_type="application/json")

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                            lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    print(f"PORT {server.servers[0].sockets[0].getsockname()[1]}", flush=True)
    await task


def start(kind: str, arg: str, script: Path = HERE) -> tuple[subprocess.Popen[str], str]:
    """Start a server child process (`script --serve kind arg`, which prints `PORT n` once it
    listens); returns it and its base_url."""
    proc = subprocess.Popen([sys.executable, str(script), "--serve", kind, arg],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"{kind} server did not start (said {line!r})")
    return proc, f"http://127.0.0.1:{int(line.split()[1])}/v1"


# ---- workloads (this process) ----------------------------------------------------------------


def next_messages(messages: list[dict[str, Any]], answer: dict[str, Any], turn: int):
    """The conversation after `answer`: its assistant message and the next user message."""
    return [*messages, answer, {"role": "user", "content": f"Turn {turn}: and then?"}]


FIRST = [{"role": "user", "content": "What is six times seven?"}]


def sequential(base_url: str, sessions: int, turns: int) -> dict[str, float]:
    """p50/p99 ms of sessions x turns chat calls and of as many GET /v1/models, keep-alive."""
    from openai import OpenAI

    keys = asyncio.run(open_keys(base_url, sessions))
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    chat_ms, models_ms = [], []
    for key in keys:
        auth, messages = {"Authorization": f"Bearer {key}"}, FIRST
        for turn in range(turns):
            t0 = time.perf_counter()
            r = client.chat.completions.create(model=MODEL, messages=messages, extra_headers=auth)
            chat_ms.append(1e3 * (time.perf_counter() - t0))
            answer = {"role": "assistant", "content": r.choices[0].message.content}
            messages = next_messages(messages, answer, turn)
    for _ in range(sessions * turns):
        t0 = time.perf_counter()
        client.models.list()
        models_ms.append(1e3 * (time.perf_counter() - t0))
    client.close()
    q = statistics.quantiles(chat_ms, n=100)
    return {"p50": q[49], "p99": q[98], "models_p50": statistics.median(models_ms)}


async def open_keys(base_url: str, n: int) -> list[str]:
    """n API keys from POST /v1/sessions (untimed set-up)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        return [(await client.post("/sessions", json={}, headers=ADMIN)).json()["api_key"]
                for _ in range(n)]


async def _conversation(client: httpx.AsyncClient, key: str, turns: int, stream: bool,
                        counts: dict[str, int]) -> None:
    """One session's turns; counts requests, SSE events, errors."""
    auth, messages = {"Authorization": f"Bearer {key}"}, FIRST
    for turn in range(turns):
        body = {"model": MODEL, "messages": messages, "stream": stream}
        try:
            if stream:
                content = ""
                async with client.stream("POST", "/chat/completions", json=body,
                                         headers=auth) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            counts["chunks"] += 1
                            if line != "data: [DONE]":
                                for c in json.loads(line[6:])["choices"]:
                                    content += c["delta"].get("content") or ""
                ok = r.status_code == 200
            else:
                r = await client.post("/chat/completions", json=body, headers=auth)
                ok = r.status_code == 200
                content = r.json()["choices"][0]["message"]["content"] if ok else ""
        except httpx.HTTPError:
            ok = False
        counts["requests" if ok else "errors"] += 1
        if not ok:
            return
        messages = next_messages(messages, {"role": "assistant", "content": content}, turn)


async def concurrent(base_url: str, workers: int, requests: int, stream: bool,
                     turns: int = 10) -> dict[str, float]:
    """`workers` clients at once (one httpx.AsyncClient = one keep-alive connection each: a
    shared 64-connection pool costs httpx more CPU than the stub spends), each running
    conversations of `turns` turns on its own sessions until `requests` calls are made in all;
    calls/s, SSE events/s, errors."""
    counts = dict.fromkeys(("requests", "chunks", "errors"), 0)
    per_worker = requests // workers
    keys = await open_keys(base_url, workers * -(-per_worker // turns))
    clients = [httpx.AsyncClient(base_url=base_url, timeout=120) for _ in range(workers)]

    async def worker(i: int) -> None:
        for k, key in enumerate(keys[i::workers]):
            await _conversation(clients[i], key, min(turns, per_worker - k * turns), stream,
                                counts)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker(i) for i in range(workers)])
    seconds = time.perf_counter() - t0
    await asyncio.gather(*[c.aclose() for c in clients])
    return {"rps": counts["requests"] / seconds, "chunks_s": counts["chunks"] / seconds,
            "errors": counts["errors"], "chunks_per_call": counts["chunks"] / counts["requests"]}


async def many_sessions(base_url: str, sessions: int, turns: int) -> dict[str, float]:
    """`sessions` clients at once, each opening a session and running `turns` turns on it;
    wall seconds, and errors (calls that did not answer 200)."""
    counts = dict.fromkeys(("requests", "chunks", "errors"), 0)
    clients = [httpx.AsyncClient(base_url=base_url, timeout=120) for _ in range(sessions)]

    async def one(client: httpx.AsyncClient) -> None:
        try:
            key = (await client.post("/sessions", json={}, headers=ADMIN)).json()["api_key"]
        except (httpx.HTTPError, KeyError, ValueError):
            return
        await _conversation(client, key, turns, False, counts)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(c) for c in clients])
    seconds = time.perf_counter() - t0
    await asyncio.gather(*[c.aclose() for c in clients])
    return {"errors": sessions * turns - counts["requests"], "seconds": seconds}


def capture(base_url: str) -> dict[str, Any]:
    """The gateway's bytes for each route, for the stub to replay."""
    with httpx.Client(base_url=base_url, timeout=30) as client:
        session = client.post("/sessions", json={}, headers=ADMIN)
        auth = {"Authorization": f"Bearer {session.json()['api_key']}"}
        body = {"model": MODEL, "messages": FIRST}
        chat = client.post("/chat/completions", json=body, headers=auth)
        with client.stream("POST", "/chat/completions", json={**body, "stream": True},
                           headers=auth) as r:
            events = [f"{line}\n\n" for line in r.iter_lines() if line]
        models = client.get("/models")
    return {"session": session.text, "chat": chat.text, "stream": events, "models": models.text}


def stream_latency(base_url: str, log: Path, calls: int) -> dict[str, float]:
    """Sampling -> client latency of streamed tokens (ms): `calls` sequential streamed calls to
    the paced gateway (a token every 5 ms); the k-th content chunk of a call carries its k-th
    token (the byte tokenizer: one character per id), and its arrival time here is compared
    with the `sampled_at` the engine logged (time.perf_counter is CLOCK_MONOTONIC on Linux,
    one clock for both processes)."""
    key = asyncio.run(open_keys(base_url, 1))[0]
    arrivals = []
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for _ in range(calls):
            body = {"model": MODEL, "messages": FIRST, "stream": True}
            times = []
            with client.stream("POST", "/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as r:
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if line.startswith("data: {") and any(
                            c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                        times.append(now)
            arrivals.append(times)
    sampled = [json.loads(line) for line in log.read_text().splitlines()]
    ms = [1e3 * (a - s) for times, at in zip(arrivals, sampled, strict=True)
          for a, s in zip(times, at, strict=False)]
    q = statistics.quantiles(ms, n=100)
    return {"p50": q[49], "p99": q[98], "tokens": len(ms)}


def measure(base_url: str, scale: float) -> dict[str, float]:
    """Every workload against one server."""
    seq = sequential(base_url, max(1, int(50 * scale)), 10)
    conc = asyncio.run(concurrent(base_url, 64, max(64, int(2000 * scale)), stream=False))
    strm = asyncio.run(concurrent(base_url, 16, max(16, int(400 * scale)), stream=True))
    sess = asyncio.run(many_sessions(base_url, 200, 3))
    return {
        "sequential p50 (ms)": seq["p50"],
        "sequential p99 (ms)": seq["p99"],
        "GET /v1/models p50 (ms)": seq["models_p50"],
        "requests/s, 64 clients": conc["rps"],
        "stream chunks/s, 16 clients": strm["chunks_s"],
        "chunks per streamed call": strm["chunks_per_call"],
        "200 sessions x 3 turns (s)": sess["seconds"],
        "errors (all workloads)": conc["errors"] + strm["errors"] + sess["errors"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the requests")
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "ARG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        kind, arg = args.serve
        asyncio.run(serve_stub(arg) if kind == "stub" else
                    serve_gateway(arg, kind == "paced", kind == "observed"))
        return
    scale = 0.2 if args.quick else 1.0
    with tempfile.TemporaryDirectory() as tmp:
        gateway, gateway_url = start("gateway", tmp)
        bodies = Path(tmp) / "bodies.json"
        bodies.write_text(json.dumps(capture(gateway_url)))
        stub, stub_url = start("stub", str(bodies))
        observed, observed_url = start("observed", tmp)
        paced, paced_url = start("paced", tmp)
        try:
            t0 = time.perf_counter()
            base = measure(stub_url, scale)
            off = measure(gateway_url, scale)
            on = measure(observed_url, scale)
            scrape = metrics_scrape(observed_url, Path(tmp) / "requests.jsonl")
            latency = stream_latency(paced_url, Path(tmp) / "sampled.jsonl",
                                     max(5, int(50 * scale)))
        finally:
            for proc in (gateway, stub, observed, paced):
                proc.kill()
                proc.wait()
    print(f"\ngateway (request log and /metrics off, then on) vs bare FastAPI stub, loopback, "
          f"{os.cpu_count()} cores, {time.perf_counter() - t0:.0f} s\n")
    print(f"| {'metric':30} | {'stub':>9} | {'off':>9} | {'on':>9} | {'off vs stub':>12} "
          f"| {'on vs off':>10} |")
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 11}|{'-' * 11}|{'-' * 14}|{'-' * 12}|")
    for name, b in base.items():
        print(f"| {name:30} | {b:9.2f} | {off[name]:9.2f} | {on[name]:9.2f} | "
              f"{_versus(name, b, off[name]):>12} | {_versus(name, off[name], on[name]):>10} |")
    print(f"\nrequest log: {scrape['lines']} lines, {scrape['bytes_per_line']:.0f} bytes each; "
          f"GET /metrics p50 {scrape['p50']:.2f} ms ({scrape['bytes']} bytes)")
    print(f"streamed token, sampled -> client (ms), {latency['tokens']} tokens: "
          f"p50 {latency['p50']:.2f}, p99 {latency['p99']:.2f}")


def _versus(name: str, before: float, after: float) -> str:
    """after - before (latency, seconds) or after / before (rates); "" for counts."""
    if "(ms)" in name or "(s)" in name:
        return f"{after - before:+.2f}" + (" ms" if "ms" in name else " s")
    return "" if "errors" in name or "per" in name else f"x{after / before:.2f}"


def metrics_scrape(base_url: str, log: Path, scrapes: int = 50) -> dict[str, float]:
    """GET /metrics latency (p50 ms) and size after the workloads; the request log's size."""
    url = base_url.removesuffix("/v1") + "/metrics"
    with httpx.Client(timeout=30) as client:
        ms, body = [], b""
        for _ in range(scrapes):
            t0 = time.perf_counter()
            body = client.get(url).content
            ms.append(1e3 * (time.perf_counter() - t0))
    lines = log.read_bytes().count(b"\n")
    return {"p50": statistics.median(ms), "bytes": len(body), "lines": lines,
            "bytes_per_line": log.stat().st_size / max(lines, 1)}


if __name__ == "__main__":
    main()
