"""Gateways that scale out: requests/s and p99 for 1, 2, 4 gateway processes behind one front.

Run: `.venv/bin/python benchmarks/gateway_scale.py [--quick] [--cells a,b] [--clients 64,256]`
(PostgreSQL's server binaries, /usr/lib/postgresql/*/bin, for the postgres cells; the benchmark
starts its own server in a temporary folder, as the `postgres` user when run as root).

Each gateway worker is a child process: `Gateway` over `InstantEngine` (benchmarks/gateway.py: a
fixed 44-token completion at once, no decoding), the byte tokenizer, no request log, recording
every call into the one pool of the cell (a SQLite file in WAL mode, or a PostgreSQL database).
The front (forgerl/gateway/front.py) is a child process too. Cells:

- `sqlite-direct`: one gateway process, no front (today's `forgerl gateway`), SQLite;
- `pg-direct`: the same on PostgreSQL (the front's cost is `pg-front-1` against it);
- `pg-front-N` (N = 1, 2, 4) and `sqlite-front-2`: N workers behind the front.

At each client count C (64, 256, 1,024): C clients at once (one httpx.AsyncClient each, one
keep-alive connection), each with its own session (opened before, one at a time, untimed)
making max(2, R / C) chat calls in one conversation, each turn extending the last (R = 2,048
requests; --quick: 512). Reported per cell and C: calls/s, p50 / p99 latency (ms), calls/s
and p99 as ratios to the `sqlite-direct` row at the same C of the same run (that cell runs
first; "-" when it is not among --cells), errors, and CPU seconds per call of the gateway
processes (their user + system time from /proc over the timed part, divided by the calls) and
of the front. On a 2-core machine shared with the client (this process), more processes than
cores cannot add throughput: the table shows where it saturates.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway import ADMIN_KEY, FIRST, MODEL, REPLY, InstantEngine, next_messages, open_keys, start

HERE = Path(__file__).resolve()
CELLS = ["sqlite-direct", "pg-direct", "pg-front-1", "pg-front-2", "pg-front-4",
         "sqlite-front-2"]


async def serve_worker(pool_url: str) -> None:
    """Child: one gateway on the shared pool; prints `PORT n` once it accepts."""
    from forgerl.datapool import open_pool
    from forgerl.gateway.app import Gateway
    from forgerl.gateway.renderers.renderer import ChatMLRenderer
    from forgerl.models import build_byte_tokenizer

    renderer = ChatMLRenderer(build_byte_tokenizer())
    engine = InstantEngine([*renderer.encode(REPLY), renderer.end_of_turn_id])
    gateway = Gateway(renderer, engine, open_pool(pool_url), MODEL, admin_key=ADMIN_KEY)
    server = await gateway.serve("127.0.0.1", 0, metrics=False, request_log=None)
    print(f"PORT {server.port}", flush=True)
    await asyncio.Event().wait()


async def serve_front(ports: str) -> None:
    """Child: the front over the workers at `ports` (comma-separated); prints `PORT n`."""
    from forgerl.gateway.front import Front

    front = Front([("127.0.0.1", int(p)) for p in ports.split(",")])
    print(f"PORT {await front.start('127.0.0.1', 0)}", flush=True)
    await asyncio.Event().wait()


def cpu_seconds(procs: list[subprocess.Popen[str]]) -> float:
    """User + system CPU seconds of these processes so far (/proc/PID/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in procs:
        fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


async def load(base_url: str, clients: int, turns: int) -> dict[str, float]:
    """`clients` conversations of `turns` chat calls at once; calls/s, p50/p99 ms, errors."""
    conns = [httpx.AsyncClient(base_url=base_url, timeout=120,
                               limits=httpx.Limits(max_connections=1)) for _ in range(clients)]
    keys = await open_keys(base_url, clients)  # untimed set-up
    ms: list[float] = []
    errors, kinds = 0, {}

    async def one(client: httpx.AsyncClient, key: str) -> None:
        nonlocal errors
        auth, messages = {"Authorization": f"Bearer {key}"}, FIRST
        for turn in range(turns):
            t0 = time.perf_counter()
            try:
                r = await client.post("/chat/completions", headers=auth,
                                      json={"model": MODEL, "messages": messages})
                why = "" if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if why:
                errors += 1
                kinds[why] = kinds.get(why, 0) + 1
                return
            ms.append(1e3 * (time.perf_counter() - t0))
            answer = {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
            messages = next_messages(messages, answer, turn)

    t0 = time.perf_counter()
    await asyncio.gather(*[one(c, k) for c, k in zip(conns, keys, strict=True)])
    seconds = time.perf_counter() - t0
    await asyncio.gather(*[c.aclose() for c in conns])
    ms.sort()
    for why, count in kinds.items():
        print(f"  {count} errors: {why}", file=sys.stderr)
    return {"rps": len(ms) / seconds, "p50": statistics.median(ms),
            "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "calls": len(ms), "errors": errors}


class Postgres:
    """A throwaway PostgreSQL server (fsync on) in a temporary folder; `url(name)` makes a
    database."""

    def __init__(self) -> None:
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not found:
            raise SystemExit("PostgreSQL server binaries absent (apt-get install postgresql)")
        self.bin, self.folder = found[-1].parent, Path(tempfile.mkdtemp(prefix="gwscale-pg-"))
        self.root = os.geteuid() == 0
        if self.root:
            shutil.chown(self.folder, "postgres", "postgres")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._run("initdb", "-D", str(self.folder / "data"), "-U", "postgres", "-A", "trust",
                  "-N", "-E", "UTF8", "--locale=C")
        self._run("pg_ctl", "start", "-w", "-D", str(self.folder / "data"), "-l",
                  str(self.folder / "log"), "-o", f"-p {self.port} -k {self.folder} -c "
                  "listen_addresses=127.0.0.1 -c fsync=on -c max_connections=300")

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bin / tool), *args]
        subprocess.run((["runuser", "-u", "postgres", "--"] if self.root else []) + cmd,
                       check=True, capture_output=True, cwd="/")

    def url(self, name: str) -> str:
        import psycopg

        base = f"postgresql://postgres@127.0.0.1:{self.port}"
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"{base}/{name}"

    def stop(self) -> None:
        self._run("pg_ctl", "stop", "-m", "immediate", "-D", str(self.folder / "data"))
        shutil.rmtree(self.folder, ignore_errors=True)


def run_cell(cell: str, pool: str, clients: list[int], requests: int,
             base: dict[int, dict]) -> list[dict]:
    """Start the cell's processes, run each client count, stop them; one row per count.
    `base`: the sqlite-direct rows by client count (the ratios' base), filled by that cell."""
    n = 1 if cell.endswith("direct") else int(cell.rsplit("-", 1)[1])
    workers = [start("worker", pool, HERE) for _ in range(n)]
    front = None if cell.endswith("direct") else start(
        "front", ",".join(str(urlsplit(url).port) for _, url in workers), HERE)
    base_url = workers[0][1] if front is None else front[1]
    rows = []
    try:
        for c in clients:
            procs = [p for p, _ in workers]
            cpu0 = cpu_seconds(procs), cpu_seconds([front[0]]) if front else 0.0
            row = asyncio.run(load(base_url, c, max(2, requests // c)))
            row["gw_cpu_ms"] = 1e3 * (cpu_seconds(procs) - cpu0[0]) / max(row["calls"], 1)
            row["front_cpu_ms"] = (1e3 * (cpu_seconds([front[0]]) - cpu0[1])
                                   / max(row["calls"], 1)) if front else 0.0
            row |= {"cell": cell, "clients": c, "load": os.getloadavg()[0]}
            rows.append(row)
            if cell == "sqlite-direct":
                base[c] = row
            ratios = (f"{row['rps'] / base[c]['rps']:5.2f} | {row['p99'] / base[c]['p99']:5.2f}"
                      if c in base else "    - |     -")
            print(f"| {cell:14} | {c:5} | {row['rps']:7.0f} | {row['p50']:7.1f} | "
                  f"{row['p99']:7.1f} | {ratios} | {row['errors']:3} | {row['gw_cpu_ms']:6.2f} | "
                  f"{row['front_cpu_ms']:6.2f} | {row['load']:4.1f} |", flush=True)
    finally:
        for p, _ in workers + ([front] if front else []):
            p.kill()
            p.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--clients", default="64,256,1024")
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--serve", nargs=2)
    args = ap.parse_args()
    if args.serve:
        kind, arg = args.serve
        asyncio.run(serve_worker(arg) if kind == "worker" else serve_front(arg))
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 16384)), hard))
    cells, clients = args.cells.split(","), [int(c) for c in args.clients.split(",")]
    cells.sort(key=lambda cell: cell != "sqlite-direct")  # the ratios' base runs first
    base: dict[int, dict] = {}
    requests = 512 if args.quick else args.requests
    pg = Postgres() if any(c.startswith("pg") for c in cells) else None
    print(f"{time.strftime('%Y-%m-%d %H:%M')} UTC; {os.cpu_count()} cores; load "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; R = {requests}\n")
    print("| cell           | clients | calls/s | p50 ms | p99 ms | calls/s ÷ sqlite-direct"
          " | p99 ÷ sqlite-direct | errors | gateway CPU ms/call"
          " | front CPU ms/call | load 1m |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, cell in enumerate(cells):
                pool = (pg.url(f"cell{i}") if cell.startswith("pg") and pg
                        else str(Path(tmp) / f"cell{i}.sqlite"))
                run_cell(cell, pool, clients, requests, base)
    finally:
        if pg is not None:
            pg.stop()


if __name__ == "__main__":
    main()
