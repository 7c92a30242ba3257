"""Costs for the scale simulation (benchmarks/scale_sim.py), measured on this machine.

Run: `.venv/bin/python benchmarks/sim_costs.py --run RUN_DIR [--out FILE] [--quick]`
(a few minutes on 2 cores). RUN_DIR is a finished `forgerl train` run of the chain_sum job
(e.g. `forgerl train examples/chain_sum/config.toml --max_steps 6 --run_dir RUN_DIR`): its
pool gives the real rollouts' shape (calls per rollout, prompt / new prompt / completion tokens
per call, the agent's seconds between calls) and the groups the trainer is timed on.
Writes one JSON (default benchmarks/results/2026-12-07-sim-costs.json) with `uptime` and the
CPU beside every number, all in seconds, tokens or bytes:

- gateway_cpu_s_per_call: the gateway process's CPU seconds (utime + stime from /proc) per chat
  call, `benchmarks/gateway.py`'s gateway (InstantEngine: no decoding, the byte tokenizer,
  recording into SQLite in its commit thread), 32 clients of 10-turn conversations.
- pool: SQLitePool (WAL, synchronous=FULL) `record_calls` wall seconds per transaction at
  1 and 32 calls each, fitted as tx_s + n * call_s; and rollout_writes_s (create_trajectory +
  finish_trajectory, the controller's two writes per rollout).
- scheduler: the real `Scheduler.admit` seconds per admitted group at A admitted groups (it
  checks the lag bound over all of them), fitted as a + b * A.
- engine: LocalEngine (SmolLM2-135M, the run's dtype) decode step seconds at batch 1, 8, 32 with
  2 threads (alone) and 1 (beside the trainer, `forgerl.cpu_share`), fitted per thread count as
  step_s = a + b * batch; prefill tokens/s of a 256-token prompt.
- trainer: `Trainer.train_step` (CISPO, prefix tree, the run's autocast, 1 thread as beside the
  engine) on the run's first four finished groups: seconds per tree token (after merging),
  alone and beside an engine decoding 16 sequences (one `CpuShare`, as `forgerl train`).
- weight_sync: one full `WeightSync` of the trained model into the engine: bytes, seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gateway as gw
from gateway_scale import cpu_seconds

from forgerl.datapool.sqlite import SQLitePool
from forgerl.types import Completion

OUT = Path(__file__).resolve().parent / "results" / "2026-12-07-sim-costs.json"


def uptime() -> str:
    """The load averages, as `uptime` prints them."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def gateway_cost(calls: int) -> dict[str, Any]:
    """Gateway CPU seconds per chat call (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = gw.start("pool", tmp)
        try:
            asyncio.run(gw.concurrent(url, 32, calls // 5, stream=False))  # warm-up
            before = cpu_seconds([proc])
            out = asyncio.run(gw.concurrent(url, 32, calls, stream=False))
            cpu = cpu_seconds([proc]) - before
        finally:
            proc.kill()
    done = calls // 32 * 32  # `concurrent` makes requests // workers calls per client
    return {"gateway_cpu_s_per_call": cpu / done, "gateway_calls": done,
            "gateway_calls_per_s": out["rps"], "gateway_errors": out["errors"],
            "uptime_gateway": uptime()}


def completion(n: int) -> Completion:
    """A recorded call of `n` prompt and `n` completion tokens."""
    return Completion(prompt_ids=list(range(n)), completion_ids=list(range(n)),
                      logprobs=[-0.5] * n, weight_versions=[0] * n, weight_version=0,
                      finish_reason="stop", started_at=0.0, ended_at=0.0)


def pool_cost(reps: int) -> dict[str, Any]:
    """SQLite transaction and per-call seconds of group commit, and the per-rollout writes."""
    with tempfile.TemporaryDirectory() as tmp:
        pool = SQLitePool(Path(tmp) / "pool.sqlite")
        t0 = time.perf_counter()
        ids = [pool.create_trajectory(0, i) for i in range(reps)]
        create = (time.perf_counter() - t0) / reps
        per_batch = {}
        for batch in (1, 32):
            t0 = time.perf_counter()
            for r in range(reps // batch * 2 if batch > 1 else reps):
                pool.record_calls([(ids[(r * batch + j) % reps], [completion(120)], [[]])
                                   for j in range(batch)])
            txs = reps // batch * 2 if batch > 1 else reps
            per_batch[batch] = (time.perf_counter() - t0) / txs
        t0 = time.perf_counter()
        for tid in ids:
            pool.finish_trajectory(tid, "finished", reward=1.0)
        finish = (time.perf_counter() - t0) / reps
        pool.close()
    call_s = (per_batch[32] - per_batch[1]) / 31
    return {"pool_backend": "sqlite", "pool_tx_s": per_batch[1] - call_s, "pool_call_s": call_s,
            "pool_tx_s_at_1": per_batch[1], "pool_tx_s_at_32": per_batch[32],
            "rollout_writes_s": create + finish, "uptime_pool": uptime()}


def scheduler_cost() -> dict[str, Any]:
    """Seconds per admission of the real Scheduler at a backlog of A admitted groups."""
    from forgerl.scheduler.policies import Scheduler, WindowedFifo

    points = []
    for k in (16, 128, 512):
        s = Scheduler(WindowedFifo(k), k, 4, group_size=8)
        t0 = time.perf_counter()
        n = len(s.admit(0))
        points.append((n / 2, (time.perf_counter() - t0) / n))  # mean backlog over the fill
    (a1, s1), (a2, s2) = points[0], points[-1]
    slope = (s2 - s1) / (a2 - a1)
    return {"scheduler_admit_s": max(0.0, s1 - slope * a1),
            "scheduler_admit_s_per_admitted": slope,
            "scheduler_points": points, "uptime_scheduler": uptime()}


async def engine_cost(model: Any, batches: tuple[int, ...], tokens: int) -> dict[str, Any]:
    """Decode step seconds per batch size at 2 and 1 threads, and prefill tokens/s."""
    import torch  # lazy: heavy

    from forgerl.engines.local import LocalEngine
    from forgerl.types import SamplingParams

    out: dict[str, Any] = {}
    engine = LocalEngine(model, max_model_len=1024, max_batch_size=max(batches))
    for threads in (2, 1):
        torch.set_num_threads(threads)
        steps = {}
        for b in batches:
            params = SamplingParams(temperature=1.0, max_tokens=tokens, seed=0)
            prompts = [[1, *range(10 + i, 40 + i)] for i in range(b)]
            await engine.generate(prompts[0], SamplingParams(max_tokens=2))
            t0 = time.perf_counter()
            await asyncio.gather(*[engine.generate(p, params) for p in prompts])
            steps[b] = (time.perf_counter() - t0) / tokens  # one decode step per token
        lo, hi = min(batches), max(batches)
        slope = (steps[hi] - steps[lo]) / (hi - lo)
        out[f"engine_t{threads}"] = {"step_s": steps[lo] - slope * lo, "step_s_per_seq": slope,
                                     "measured": steps}
    torch.set_num_threads(1)  # prefills run at the engine's count beside the trainer
    prompt = list(range(5, 261))
    times = []
    for i in range(3):
        t0 = time.perf_counter()
        await engine.generate([i + 1, *prompt], SamplingParams(max_tokens=1))
        times.append(time.perf_counter() - t0)
    out["engine_prefill_tokens_per_s"] = len(prompt) / statistics.median(times)
    out["uptime_engine"] = uptime()
    return out, engine


async def trainer_cost(model: Any, engine: Any, run: Path, autocast: str) -> dict[str, Any]:
    """CISPO prefix-tree step seconds per tree token on the run's first four finished groups,
    alone and beside a decoding engine (one CpuShare, as `forgerl train` runs them); one full
    weight sync."""
    import torch  # lazy: heavy

    from forgerl.cpu_share import CpuShare
    from forgerl.engines.local import LocalEngine
    from forgerl.trainer.trainer import Trainer
    from forgerl.trainer.weight_sync import WeightSync
    from forgerl.types import SamplingParams

    torch.set_num_threads(1)
    pool = SQLitePool(run / "pool.sqlite")
    tasks = sorted({i for i in pool.task_indices() if i >= 0})
    groups = [g for g in (pool.get_group(i) for i in tasks)
              if g.trajectories and all(t.status == "finished" for t in g.trajectories)][:4]
    trainer = Trainer(model, lr=5e-6, autocast=autocast, device="cpu")
    trainer.train_step(groups)  # warm-up
    m = trainer.train_step(groups)
    alone = m["step_seconds"] / m["tokens_after_merge"]
    share = CpuShare(2)
    trainer.cpu_share = share
    beside = LocalEngine(engine.model, max_model_len=1024, max_batch_size=16, cpu_share=share)
    stop = asyncio.Event()

    async def decode() -> None:
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
        while not stop.is_set():
            await asyncio.gather(*[beside.generate([1, *range(10 + i, 40 + i)], params)
                                   for i in range(16)])

    task = asyncio.create_task(decode())
    await asyncio.sleep(1.0)
    m = await asyncio.to_thread(trainer.train_step, groups)
    stop.set()
    await task
    await beside.close()
    shared = m["step_seconds"] / m["tokens_after_merge"]
    sync = WeightSync(engine, "full")
    seconds = []
    for v in (1, 2):
        await sync.sync(trainer.state_dict_for_sync(), v)
        seconds.append(sync.stats["seconds"])
    return {"trainer_step_s": 0.0, "trainer_s_per_token": alone,
            "trainer_s_per_token_shared": shared, "trainer_tokens": m["tokens_after_merge"],
            "weight_sync_bytes": sync.stats["bytes"], "weight_sync_s": min(seconds),
            "uptime_trainer": uptime()}


async def model_costs(config: dict[str, Any], run: Path, quick: bool) -> dict[str, Any]:
    """Engine, trainer and weight-sync costs in one event loop (the engine's)."""
    from forgerl.models import load_pretrained  # lazy: heavy (torch)

    model = load_pretrained(config["model"]["path"])[0]
    out, engine = await engine_cost(model, (1, 8, 32), 8 if quick else 24)
    trained = load_pretrained(config["model"]["path"])[0]
    out |= await trainer_cost(trained, engine, run, config["trainer"]["autocast"])
    await engine.close()
    return out


def run_shape(run: Path) -> dict[str, Any]:
    """The real rollouts' shape from the run's pool (training trajectories, task_index >= 0)."""
    import sqlite3

    db = sqlite3.connect(run / "pool.sqlite")
    rows = db.execute(
        "SELECT t.id, t.started_at, t.ended_at, c.turn, length(c.prompt_ids) / 4,"
        " length(c.completion_ids) / 4, c.started_at, c.ended_at FROM trajectories t JOIN"
        " completions c ON c.trajectory_id = t.id WHERE t.task_index >= 0 AND"
        " t.status = 'finished' ORDER BY t.id, c.turn").fetchall()
    by: dict[str, list[tuple]] = {}
    for r in rows:
        by.setdefault(r[0], []).append(r)
    gaps, prompts, news, outs, calls = [], [], [], [], []
    for turns in by.values():
        calls.append(len(turns))
        gaps.append(turns[0][6] - turns[0][1])  # agent start → first call
        for i, r in enumerate(turns):
            prompts.append(r[4])
            outs.append(r[5])
            news.append(r[4] - (turns[i - 1][4] + turns[i - 1][5] if i else 0))
            end = turns[i + 1][6] if i + 1 < len(turns) else r[2]
            gaps.append(end - r[7])  # call end → next call (or rollout end)
    n = len(calls)
    return {"rollouts": n, "calls_per_rollout": sum(calls) / n,
            "prompt_tokens_per_call": statistics.mean(prompts),
            "new_prompt_tokens_per_call": statistics.mean(news),
            "completion_tokens_per_call": statistics.mean(outs),
            "env_s_per_call": sum(gaps) / sum(calls), "env_s_per_rollout": sum(gaps) / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True, help="a finished chain_sum run dir")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    args = parser.parse_args()
    if not (args.run / "pool.sqlite").exists():
        sys.exit(f"sim_costs: {args.run}/pool.sqlite not found (pass a finished run's folder)")
    config = json.loads((args.run / "config.json").read_text())
    costs: dict[str, Any] = {"machine": f"{platform.processor() or platform.machine()}, "
                             f"{os.cpu_count()} cores", "uptime_start": uptime(),
                             "run": str(args.run)}
    costs |= run_shape(args.run)
    costs |= gateway_cost(400 if args.quick else 2000)
    costs |= pool_cost(64 if args.quick else 320)
    costs |= scheduler_cost()
    import torch  # lazy: heavy

    from forgerl.models import engine_dtype  # lazy: heavy (torch)

    dtype = engine_dtype(config["engine"]["dtype"], torch.device("cpu"))
    costs |= asyncio.run(model_costs(config, args.run, args.quick)) | {"engine_dtype": str(dtype)}
    costs["uptime_end"] = uptime()
    args.out.write_text(json.dumps(costs, indent=1) + "\n")
    print(json.dumps(costs, indent=1))


if __name__ == "__main__":
    main()
