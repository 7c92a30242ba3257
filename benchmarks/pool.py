"""Commits per second of the data pool's two backends, SQLite and PostgreSQL, in one run.

    python benchmarks/pool.py [--seconds 3] [--prompt 1024] [--completion 128] [--writers 1 2]

Two writes, each its own durable commit: `add_completion` (one completion: one transaction)
and `record_calls` with 8 calls of one completion each (the gateway's group commit: one
transaction, a savepoint per call). Each completion has `--prompt` prompt ids and
`--completion` sampled ids with float64 logprobs. Each case runs `--writers` processes at once,
each appending to its own trajectories for `--seconds`; the table gives commits/s and
completions/s summed over the writers, and "PostgreSQL / SQLite": PostgreSQL's rate over
SQLite's in the same case, measured just before in this run (one ratio for both rates: a case
writes as many completions per commit on each backend). SQLite is a WAL file with
synchronous=FULL in a temp folder; PostgreSQL is a throwaway server (tests/pg.py: fsync on, TCP
on 127.0.0.1) on the same disk, one fresh database per case. The cases run back to back, so
the ratios compare like with like on a shared machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from forgerl.datapool import open_pool  # noqa: E402
from forgerl.types import Completion, SamplingParams  # noqa: E402
from tests.pg import ABSENT, Server, pg_bin  # noqa: E402  (the tests' server)

GROUP = 8


def completion(i: int, prompt: int, sampled: int) -> Completion:
    return Completion(prompt_ids=[(i + t) % 50_000 for t in range(prompt)],
                      completion_ids=[(7 * i + t) % 50_000 for t in range(sampled)],
                      logprobs=[-0.1 - t / 977 for t in range(sampled)],
                      weight_versions=[0] * sampled, weight_version=0, finish_reason="stop",
                      sampling=SamplingParams(), started_at=time.time(), ended_at=time.time())


def writer(where: str, kind: str, k: int, seconds: float, prompt: int, sampled: int,
           start: mp.Event, out: mp.Queue) -> None:
    pool = open_pool(where)
    ids = [pool.create_trajectory(-1, g, trajectory_id=f"w{k}-{g}") for g in range(GROUP)]
    c = completion(k, prompt, sampled)
    start.wait()
    commits, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if kind == "add_completion":
            pool.add_completion(ids[commits % GROUP], c)
        else:
            pool.record_calls([(tid, [c], [[]]) for tid in ids])
        commits += 1
    out.put((commits, time.perf_counter() - t0))
    pool.close()


def case(where: str, kind: str, writers: int, args: argparse.Namespace) -> tuple[float, float]:
    """(commits/s, completions/s) summed over `writers` processes."""
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=writer, args=(where, kind, k, args.seconds, args.prompt,
                                              args.completion, start, out))
             for k in range(writers)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # every writer opened its pool and created its trajectories
    start.set()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    rate = sum(n / s for n, s in got)
    return rate, rate * (1 if kind == "add_completion" else GROUP)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    bin_dir = pg_bin()
    if bin_dir is None:
        sys.exit(f"benchmarks/pool.py: {ABSENT}")
    print("| backend | write | writers | commits/s | completions/s | PostgreSQL / SQLite |\n"
          "|---|---|---:|---:|---:|---:|")
    with Server(bin_dir) as server, tempfile.TemporaryDirectory() as tmp:
        n = 0
        for writers in args.writers:
            for kind in ("add_completion", f"record_calls x{GROUP}"):
                for backend in ("sqlite", "postgresql"):
                    n += 1
                    if backend == "sqlite":
                        where = f"{tmp}/pool{n}.sqlite"
                    else:
                        with psycopg.connect(f"{server.url}/postgres", autocommit=True) as conn:
                            conn.execute(f"CREATE DATABASE b{n}")
                        where = f"{server.url}/b{n}"
                    commits, completions = case(where, kind.split()[0], writers, args)
                    if backend == "sqlite":
                        sqlite = commits  # the ratio's base, measured just before
                    print(f"| {backend} | {kind} | {writers} | {commits:,.0f} |"
                          f" {completions:,.0f} | {commits / sqlite:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
