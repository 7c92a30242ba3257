"""Scheduler settings on the real jobs, back to back: the overlap table (issue 51, item 1).

Runs `forgerl train` once per setting under `/usr/bin/time -v`, then reads each RUN_DIR's
metrics.jsonl and pool to print one markdown table (s/step also as a ratio to `BASELINE`, or to
the first setting when that was not measured). A setting is `POLICY:L`, POLICY one of
`sync` (fifo, L forced to 0), `fifo`, `fffo` or `wN` (windowed FIFO, window N).

    python benchmarks/overlap.py --job main --settings sync:0 w4:1 w2:2 fifo:2 fffo:2 \
        --out /tmp/overlap-main
    python benchmarks/overlap.py --job chain_sum --settings fifo:2 sync:0 --out /tmp/overlap-cs
    python benchmarks/overlap.py --job main --out /tmp/overlap-main --table-only

Jobs: `main` = examples/calculator_agent with `--max_steps 4` (held-out at steps 0 and 4);
`chain_sum` = the TRL-shaped command of examples/chain_sum (held-out at 0 and 8, 64 tasks);
`tool` = the real loop on the tiny model with a tool-bound agent (`tool_job`), in-process.
`--extra=--FLAG=VALUE` (repeatable) adds an override to every run, e.g. a longer
`--rollout.timeout_s` on a loaded machine. `--fake-clock` prints the simulator's table instead.
Run from the repository root with PYTHONPATH=. (it imports `benchmarks.scheduling`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from forgerl.metrics import read_metrics
from forgerl.scheduler.policies import make_policy

BASELINE = "w4:1"  # the old default, windowed FIFO W = 4, L = 1: the ratio column's base
JOBS = {
    "main": ["examples/calculator_agent/config.toml", "--max_steps", "4"],
    "chain_sum": [
        "examples/chain_sum/config.toml", "--max_steps", "8", "--rollout.temperature", "1.0",
        "--rollout.max_tokens", "128", "--tasks.eval_size", "64", "--tasks.eval_every", "8",
        "--trainer.lr", "5e-6",
    ],
}


def parse_setting(setting: str) -> tuple[str, int | None, int]:
    """`POLICY:L` → (scheduler policy type, window or None, L). Raises ValueError for an
    unknown policy."""
    name, _, lag = setting.partition(":")
    if name == "sync":
        return "fifo", None, 0
    window = int(name[1:]) if re.fullmatch(r"w\d+", name) else None
    policy = name if window is None else "windowed_fifo"
    try:
        make_policy(policy, window)  # the scheduler's own names
    except ValueError:
        raise ValueError(f"unknown policy {name!r} in setting {setting!r}") from None
    return policy, window, int(lag or 0)


def setting_flags(setting: str) -> list[str]:
    """`POLICY:L` → CLI overrides. Raises ValueError for an unknown policy."""
    policy, window, lag_steps = parse_setting(setting)
    table = f'{{type = "{policy}"}}' if window is None else \
        f'{{type = "{policy}", window = {window}}}'
    return ["--scheduler.policy", table, "--scheduler.max_off_policy_steps", str(lag_steps)]


def load_average() -> str:
    """The 1-minute load average now (the machine is shared)."""
    return Path("/proc/loadavg").read_text().split()[0]


def run_one(job: str, setting: str, run_dir: Path, forgerl: str, extra: list[str]) -> None:
    """One `forgerl train` run into run_dir; writes run_dir.log and run_dir.json beside it."""
    cmd = [forgerl, "train", *JOBS[job], *extra, *setting_flags(setting), "--run_dir", str(run_dir)]
    start_load, t0 = load_average(), time.time()
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        rc = subprocess.call(["/usr/bin/time", "-v", *cmd], stdout=out, stderr=subprocess.STDOUT)
    info = {"setting": setting, "cmd": cmd, "rc": rc, "wall_s": time.time() - t0,
            "load_start": start_load, "load_end": load_average(), "started": t0}
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", log.read_text())
    info["peak_rss_gib"] = int(peak.group(1)) / 2**20 if peak else None
    run_dir.with_suffix(".json").write_text(json.dumps(info))
    print(f"{setting}: rc={rc} wall={info['wall_s']:.0f}s load {start_load}->{info['load_end']}",
          flush=True)


def union_overlap(spans: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    """Seconds of `windows` covered by the union of `spans` (both lists of (start, end))."""
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in windows for a, b in merged)


def task_mix(db: sqlite3.Connection) -> dict[str, float]:
    """Bias of the trained task mix: mean group duration (first rollout start → last end) and
    mean number of terms of the trained tasks over the same of the first M tasks in admission
    (index) order, M = trained count. 1.00 = unbiased, < 1 = quick/easy tasks trained first."""
    rows = db.execute(
        "SELECT t.task_index, t.payload, t.trained_step, MIN(r.started_at), MAX(r.ended_at) "
        "FROM tasks t JOIN trajectories r ON r.task_index = t.task_index "
        "WHERE t.task_index >= 0 AND r.ended_at > 0 GROUP BY t.task_index ORDER BY t.task_index"
    ).fetchall()
    trained = [r for r in rows if r[2] is not None]
    first = rows[:len(trained)]

    def terms(row: tuple) -> float:
        payload = json.loads(row[1])
        question = str(payload.get("question", payload))
        return float(len(re.findall(r"\d+", question.split("=")[0])) or 0)

    def ratio(f: Any, a: list, b: list) -> float:
        den = statistics.mean(f(r) for r in b) if b else 0.0
        return statistics.mean(f(r) for r in a) / den if a and den else float("nan")

    return {"bias_duration": ratio(lambda r: r[4] - r[3], trained, first),
            "bias_terms": ratio(terms, trained, first), "tasks_trained": len(trained)}


def summarise(run_dir: Path) -> dict[str, Any]:
    """One table row from RUN_DIR/metrics.jsonl, the pool and run.json beside it."""
    info = json.loads(run_dir.with_suffix(".json").read_text())
    records = read_metrics(run_dir)
    steps = [r for r in records if r["step"] > 0 and "step_seconds" in r]
    accuracy = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    train_windows = []
    for r in steps:  # the record is logged at the step's end: train ran after the wait
        start = r["time"] - r["step_seconds"] + r["wait_seconds"]
        train_windows.append((start, start + r["train_seconds"]))
    db = sqlite3.connect(run_dir / "pool.sqlite")
    spans = db.execute("SELECT c.started_at, c.ended_at FROM completions c JOIN trajectories t "
                       "ON t.id = c.trajectory_id WHERE t.task_index >= 0").fetchall()
    lags = [r.get("scheduler_off_policy_lag_max", 0) for r in steps]
    wall = sum(r["step_seconds"] for r in steps)
    train = sum(r["train_seconds"] for r in steps)
    row = {
        "setting": info["setting"], "wall_s": info["wall_s"], "steps": len(steps),
        "s_per_step": wall / max(1, len(steps)),
        "s_per_step_no_eval": (wall - sum(r.get("eval_seconds", 0.0) for r in steps))
        / max(1, len(steps)),
        "wait_fraction": sum(r["wait_seconds"] for r in steps) / max(wall, 1e-9),
        "train_s": train / max(1, len(steps)),
        "overlap": union_overlap(spans, train_windows) / max(train, 1e-9),
        "tokens_per_s": statistics.mean(r["rollout_tokens_per_second"] for r in steps)
        if steps else 0.0,
        "lag_mean": statistics.mean(r.get("scheduler_off_policy_lag_mean", 0) for r in steps)
        if steps else 0.0,
        "lag_max": max(lags, default=0), "accuracy": accuracy,
        "peak_rss_gib": info.get("peak_rss_gib"),
        "load": f"{info['load_start']}/{info['load_end']}",
    }
    return row | task_mix(db)


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of `summarise` rows. "vs base": s/step over the same run's
    `BASELINE` row (the old default) when measured, else over its first row."""
    base = next((r for r in rows if r["setting"] == BASELINE), rows[0] if rows else None)
    head = ("| setting | wall | s/step | s/step vs {} | s/step w/o eval | train s/step | "
            "trainer waiting | train overlapped by generation | rollout tok/s | lag mean/max | "
            "held-out by step | bias duration / terms | peak RSS | load 1-min start/end |"
            ).format(base["setting"] if base else "-")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        acc = ", ".join(f"{s}: {a:.3f}" for s, a in sorted(r["accuracy"].items()))
        lines.append(
            f"| {r['setting']} | {r['wall_s'] / 60:.1f} min | {r['s_per_step']:.1f} | "
            f"{r['s_per_step'] / (base['s_per_step'] or float('nan')):.2f} | "
            f"{r['s_per_step_no_eval']:.1f} | {r['train_s']:.1f} | {r['wait_fraction']:.0%} | "
            f"{r['overlap']:.0%} | {r['tokens_per_s']:.1f} | {r['lag_mean']:.2f}/{r['lag_max']} | "
            f"{acc} | {r['bias_duration']:.2f} / {r['bias_terms']:.2f} | "
            f"{r['peak_rss_gib'] or 0:.2f} GiB | {r['load']} |")
    return "\n".join(lines)


def fake_clock(settings: list[str], seeds: int = 5, steps: int = 200) -> str:
    """The settings on `benchmarks/scheduling.simulate`'s fake clock in the main job's shape.

    k = 2, G = 8, 16 rollout slots (the engine's default max_batch_size), a training step of
    1.0 and per-task rollout durations lognormal with median 2.5 (sigma 0.5): the main job's
    generation took about 3x its training on a quiet machine. The clock has no shared cores:
    generation beside training costs nothing here, unlike on 2 real cores. Mean over seeds.
    """
    from benchmarks.scheduling import duration_bias, lognormal_durations, simulate  # lazy: CLI
    from forgerl.scheduler.policies import Scheduler  # lazy: CLI

    lines = ["| setting | time/step (train = 1) | trainer idle | lag mean / max | bias |",
             "|---|---|---|---|---|"]
    for setting in settings:
        name, window, lag = parse_setting(setting)
        per_seed = []
        for seed in range(seeds):
            duration = lognormal_durations(seed, sigma=0.5)
            scaled = lambda i, d=duration: 2.5 * d(i)  # noqa: E731
            sched = Scheduler(make_policy(name, window), 2, lag, group_size=8)
            res = simulate(sched, scaled, 16, 1.0, steps)
            lags = list(res.lags.values())
            per_seed.append((res.end_time / steps, res.idle_time / res.end_time,
                             sum(lags) / len(lags), max(lags),
                             duration_bias(res, scaled, min(100, len(res.trained)))))
        mean = [statistics.mean(r[j] for r in per_seed) for j in range(5)]
        lines.append(f"| {setting} | {mean[0]:.2f} | {mean[1]:.0%} | {mean[2]:.2f} / "
                     f"{max(r[3] for r in per_seed)} | {mean[4]:.3f} |")
    return "\n".join(lines)


def tool_job(settings: list[str], steps: int = 8, scale: float = 5.0, seed: int = 0) -> str:
    """The settings on the real loop with a CPU-light, tool-bound agent (`--job tool`).

    `benchmarks/scheduling.py`'s part 2: tiny model, gateway over HTTP, SQLite pool, CISPO
    trainer; G = 4, k = 2, max_in_flight at its default (L + 1) k; each rollout sleeps a
    lognormal "tool" time (median 0.3 s x `scale`) between chat calls. Little CPU per rollout,
    so a loaded machine moves these numbers less than the model jobs'.
    """
    from benchmarks.scheduling import (  # lazy: CLI
        lognormal_tool_seconds,
        make_tool_agent,
        real_config,
        summarize_run,
        true_bias,
    )
    from forgerl.controller import run  # lazy: CLI

    tool = lognormal_tool_seconds(seed)
    lines = ["| setting | s/step | trainer idle | lag mean / max | bias (tool s) | load |",
             "|---|---|---|---|---|---|"]
    for setting in settings:
        policy, window, lag_steps = parse_setting(setting)
        load = load_average()
        with tempfile.TemporaryDirectory(prefix="forgerl-overlap-") as tmp:
            run_dir = Path(tmp) / "run"
            config = real_config(run_dir, policy, window, steps, lag_steps, (lag_steps + 1) * 2,
                                 4, 2, seed)
            agent = make_tool_agent(lambda q: scale * tool(q), seed)
            asyncio.run(run(config, agent=agent, progress=False))
            r = summarize_run(run_dir, 2)
            bias = true_bias(run_dir, tool)
        lines.append(f"| {setting} | {r['s_per_step']:.2f} | {r['idle']:.0%} | "
                     f"{r['lag_mean']:.2f} / {r['lag_max']} | {bias:.2f} | "
                     f"{load}/{load_average()} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", choices=[*sorted(JOBS), "tool"], default="main")
    ap.add_argument("--settings", nargs="+", default=["sync:0", "w4:1", "w2:2", "fifo:2", "fffo:2"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--forgerl", default=str(Path(sys.executable).parent / "forgerl"))
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--extra", action="append", default=[], help="a `forgerl train` override, "
                    "repeatable: --extra=--tasks.eval_size=16 (split at the first =)")
    ap.add_argument("--fake-clock", action="store_true", help="only the fake-clock table")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (--job tool)")
    args = ap.parse_args()
    if args.fake_clock:
        print(fake_clock(args.settings))
        return
    if args.job == "tool":
        print(tool_job(args.settings, steps=args.steps))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    run_dirs = [args.out / setting.replace(":", "_L") for setting in args.settings]
    if not args.table_only:
        extra = [part for flag in args.extra for part in flag.split("=", 1)]
        for setting, run_dir in zip(args.settings, run_dirs, strict=True):
            run_one(args.job, setting, run_dir, args.forgerl, extra)
    rows = [summarise(run_dir) for run_dir in run_dirs if (run_dir / "metrics.jsonl").exists()]
    print(table(rows))


if __name__ == "__main__":
    main()
