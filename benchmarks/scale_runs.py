"""The scale simulation's scenarios: validation against a real run, saturation, Forge scale.

Run: `.venv/bin/python benchmarks/scale_runs.py validate|saturation|forge [--costs FILE]`
(costs: benchmarks/sim_costs.py's JSON, default benchmarks/results/2026-12-07-sim-costs.json).

- validate: the model with this machine's layout (1 engine sharing the CPU with the trainer,
  the chain_sum job: k = 2, G = 8, FIFO, L = 2, its measured rollout shape) against the real
  run the costs came from (its metrics.jsonl): steady-state seconds per step, both.
- saturation: a Forge-like agent workload (lognormal calls per rollout and environment seconds:
  rollouts of seconds to hours) at growing session counts on ONE controller, scheduler,
  gateway and pool, engines scaled with the sessions: each component's busy fraction and the
  calls/s; plot docs/img/simulation-saturation.png. Capacities at 100 % are 1 / cost.
- forge: 1,000 engines and 100,000 sessions, a few layouts (gateways, pool shards, k, L, W):
  trainer busy fraction, lag, component busy fractions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale_sim import Costs, Layout, Workload, simulate

from forgerl.metrics import read_metrics

HERE = Path(__file__).resolve().parent
COSTS = HERE / "results" / "2026-12-07-sim-costs.json"
PLOT = HERE.parent / "docs" / "img" / "simulation-saturation.png"

# Forge-like agent sessions (assumed shape, not measured): median 8 calls of 200 tokens, each
# after a median 5 s of tools / environment; lognormal spreads give rollouts from seconds to
# hours (calls 1..~150, environment 0.1 s..~10 min per call; mean rollout ~26 min)
FORGE = Workload(group_size=8, calls=8, calls_sigma=1.2, env_s=5.0, env_sigma=1.5,
                 completion_tokens=200, completion_sigma=0.7, prompt_tokens=1000,
                 new_prompt_tokens=300)
# PostgreSQL, one connection, durable commit (part A's benchmarks/pool.py, results
# 2026-12-07-pool.md, same machine and load): ~12.9 ms for 1 call, ~32 ms for 8 → tx + n * call
POSTGRES = {"pool_tx_s": 0.0102, "pool_call_s": 0.0027}
ENGINE_SPEED = 50.0  # an accelerator engine against the measured 2-core CPU one (assumed)


def validate(costs: Costs, raw: dict, args: argparse.Namespace) -> None:
    """Predicted vs measured steady-state s/step for the chain_sum run on this machine."""
    run = Path(raw["run"])
    steps = [r for r in read_metrics(run) if r["step"] > 0]
    last = steps[-1]
    work = Workload(group_size=8, calls=raw["calls_per_rollout"],
                    env_s=raw["env_s_per_rollout"] / (raw["calls_per_rollout"] + 1),
                    completion_tokens=raw["completion_tokens_per_call"],
                    prompt_tokens=raw["prompt_tokens_per_call"],
                    new_prompt_tokens=last["engine_prefill_tokens"] / last["gateway_requests"],
                    group_tree_tokens=sum(r["tokens_after_merge"] for r in steps)
                    / sum(len(r["trained_tasks"]) for r in steps))
    layout = Layout(engines=1, max_batch=48, k=2, max_off_policy_steps=2, policy="fifo",
                    shared_cpu=True)
    # the same model with the run's own component speeds (its counters): the model's structure
    # apart from the costs measured by sim_costs.py
    row_s = last["engine_decode_seconds"] / last["engine_decode_rows"]
    train_s = sum(r["train_seconds"] for r in steps) / sum(r["tokens_after_merge"] for r in steps)
    own = replace(costs, step_a=0.0, step_b=row_s, shared_step_a=0.0, shared_step_b=row_s,
                  prefill_tokens_per_s=last["engine_prefill_tokens"]
                  / last["engine_prefill_seconds"], trainer_step_s=0.0,
                  trainer_s_per_token=train_s, trainer_s_per_token_shared=train_s)
    steady = [r["step_seconds"] for r in steps[1:] if not r.get("eval_seconds")]
    measured, first = sum(steady) / len(steady), steps[0]["step_seconds"]
    print(f"real run {run}: steps {[r['step'] for r in steps]}, steady steps (no eval, not the "
          f"first): {[round(s, 1) for s in steady]}")
    print(f"{'costs':34} {'':6} {'measured':>9} {'predicted':>9} {'error':>7}")
    for name, c in (("sim_costs.py (measured apart)", costs), ("the run's own counters", own)):
        out = simulate(c, work, layout, steps=len(steps))
        for what, real, pred in (("s/step", measured, out["step_s"]),
                                 ("first", first, out["first_step_s"])):
            print(f"{name:34} {what:6} {real:9.1f} {pred:9.1f} {pred / real - 1:+7.1%}")
    print(f"decode: the run {row_s:.3f} s per sequence-step, sim_costs.py "
          f"{costs.shared_step_b + costs.shared_step_a / 16:.3f} (1 thread, batch 16); trainer: "
          f"the run {train_s:.4f} s per tree token, sim_costs.py "
          f"{costs.trainer_s_per_token_shared or costs.trainer_s_per_token:.4f} (beside a decode)")


def saturation(costs: Costs, raw: dict, args: argparse.Namespace) -> None:
    """One of each component under growing load; table and plot."""
    print(f"capacities at 100 %: gateway {1 / costs.gateway_cpu_s_per_call:,.0f} calls/s; "
          f"pool ({args.pool}) {1 / (costs.pool_tx_s + costs.pool_call_s):,.0f} calls/s alone, "
          f"{1 / costs.pool_call_s:,.0f} calls/s at large group commits; controller "
          f"{1 / costs.rollout_writes_s:,.0f} rollouts/s")
    rows = []
    head = (f"{'sessions':>8} {'calls/s':>8} {'rollouts/s':>10} {'gateway':>8} {'pool':>6} "
            f"{'ctrl':>6} {'sched':>6} {'engines':>8} {'wall s':>7}")
    print(head)
    for sessions in (1000, 4000, 8000, 16000, 32000):
        groups = sessions // FORGE.group_size
        layout = Layout(engines=max(1, sessions // 100), max_batch=128, k=max(1, groups // 4),
                        max_off_policy_steps=None, policy="fffo", max_in_flight=groups,
                        engine_speed=ENGINE_SPEED, trainer_speed=1e9)
        t0 = time.perf_counter()
        out = simulate(costs, FORGE, layout, steps=10**9, max_seconds=args.seconds)
        rows.append((sessions, out))
        print(f"{sessions:>8} {out['calls_per_s']:>8.0f} {out['rollouts_per_s']:>10.1f} "
              f"{out['gateway_busy_max']:>8.0%} {out['pool_busy_max']:>6.0%} "
              f"{out['controller_busy']:>6.0%} {out['scheduler_busy']:>6.0%} "
              f"{out['engine_busy_mean']:>8.0%} {time.perf_counter() - t0:>7.1f}")
    if args.pool == "sqlite":
        plot(rows)


def plot(rows: list) -> None:
    """Busy fraction of each component against sessions (PNG at PLOT)."""
    import matplotlib  # lazy: only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [s for s, _ in rows]
    for key, label in (("gateway_busy_max", "one gateway"), ("pool_busy_max", "one pool (SQLite)"),
                       ("controller_busy", "one controller"), ("scheduler_busy", "one scheduler"),
                       ("engine_busy_mean", "engines (mean)")):
        ax.plot(xs, [min(1.0, o[key]) for _, o in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("concurrent agent sessions (engines = sessions / 100)")
    ax.set_ylabel("busy fraction")
    ax.set_title("Which single component saturates first (simulated, measured costs)")
    ax.legend()
    ax.grid(alpha=0.3)
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)
    print(f"plot: {PLOT}")


def forge(costs: Costs, raw: dict, args: argparse.Namespace) -> None:
    """1,000 engines and 100,000 sessions: a few layouts."""
    base = Layout(engines=1000, max_batch=128, engine_speed=ENGINE_SPEED, policy="windowed_fifo",
                  k=625, max_off_policy_steps=19, window=625, trainer_speed=args.trainer_speed,
                  rollout_timeout_s=args.rollout_timeout)
    layouts = {  # (L + 1) k = 12,500 groups = 100,000 sessions of G = 8 may run at once
        "1 of each": base,
        "16 gw, 8 sh, 4 ctl": replace(base, gateways=16, pool_shards=8, controllers=4),
        "same, W = k/4": replace(base, gateways=16, pool_shards=8, controllers=4, window=156),
        "16 gw, 8 sh, 16 ctl": replace(base, gateways=16, pool_shards=8, controllers=16),
        "same, W = 8k": replace(base, gateways=16, pool_shards=8, controllers=16, window=5000),
        # tenth-scale `configs` rows at ten times the scale
        "16/8/16 FFFO k=2500": replace(base, gateways=16, pool_shards=8, controllers=16,
                                      policy="fffo", k=2500, max_off_policy_steps=4),
        "16/8/16 FIFO k=625": replace(base, gateways=16, pool_shards=8, controllers=16,
                                     policy="fifo"),
    }
    layouts = {n: lay for n, lay in layouts.items() if not args.only or n in args.only}
    print(f"{'layout':>19} {'steps':>5} {'s/step':>7} {'trainer':>8} {'lag mean':>8} "
          f"{'lag max':>7} {'calls/s':>8} {'gateway':>8} {'pool':>6} {'ctrl':>6} {'sched':>6} "
          f"{'engines':>8} {'timed out':>9} {'wall s':>7}")
    for name, layout in layouts.items():
        t0 = time.perf_counter()
        out = simulate(costs, FORGE, layout, steps=10**9, max_seconds=args.seconds)
        print(f"{name:>19} {out['steps']:>5} {out['step_s']:>7.1f} "
              f"{out['trainer_busy_steady']:>8.0%} {out['lag_mean']:>8.2f} {out['lag_max']:>7} "
              f"{out['calls_per_s']:>8.0f} "
              f"{out['gateway_busy_max']:>8.0%} {out['pool_busy_max']:>6.0%} "
              f"{out['controller_busy']:>6.0%} {out['scheduler_busy']:>6.0%} "
              f"{out['engine_busy_mean']:>8.0%} {out['timed_out']:>9.1%} "
              f"{time.perf_counter() - t0:>7.1f}", flush=True)


def configs(costs: Costs, raw: dict, args: argparse.Namespace) -> None:
    """A tenth of Forge (100 engines, 10,000 sessions, 2 of each component): the scheduler
    settings against the trainer's busy fraction and lag; trainer sized to the rollouts."""
    base = Layout(engines=100, max_batch=128, engine_speed=ENGINE_SPEED, gateways=2,
                  pool_shards=2, controllers=2, trainer_speed=args.trainer_speed / 10,
                  rollout_timeout_s=args.rollout_timeout)
    print(f"{'policy':>14} {'k':>4} {'L':>3} {'W':>5} {'steps':>5} {'s/step':>7} {'trainer':>8} "
          f"{'lag mean':>8} {'lag max':>7} {'in flight':>9} {'timed out':>9}")
    for policy, k, lag, window in (("fifo", 62, 19, 1), ("windowed_fifo", 62, 19, 62),
                                   ("windowed_fifo", 62, 19, 500), ("fffo", 62, 19, 0),
                                   ("fffo", 62, 4, 0), ("fffo", 250, 4, 0)):
        layout = replace(base, policy=policy, k=k, max_off_policy_steps=lag, window=window or 1)
        out = simulate(costs, FORGE, layout, steps=10**9, max_seconds=args.seconds)
        print(f"{policy:>14} {k:>4} {lag:>3} {window or '∞':>5} {out['steps']:>5} "
              f"{out['step_s']:>7.1f} {out['trainer_busy_steady']:>8.0%} {out['lag_mean']:>8.2f} "
              f"{out['lag_max']:>7} {(lag + 1) * k * FORGE.group_size:>9} "
              f"{out['timed_out']:>9.1%}", flush=True)


commands = {"validate": validate, "saturation": saturation, "forge": forge, "configs": configs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=sorted(commands))
    parser.add_argument("--costs", type=Path, default=COSTS)
    parser.add_argument("--seconds", type=float, default=120.0, help="simulated seconds")
    parser.add_argument("--trainer-speed", type=float, default=14000.0,
                        help="forge: trainer throughput / the measured one")
    parser.add_argument("--only", nargs="*", help="forge: these layouts (names as printed)")
    parser.add_argument("--rollout-timeout", type=float, default=float("inf"),
                        help="forge, configs: [rollout] timeout_s, simulated seconds")
    parser.add_argument("--pool", choices=["sqlite", "postgresql"], default="sqlite",
                        help="pool costs: measured SQLite, or PostgreSQL from benchmarks/pool.py")
    args = parser.parse_args()
    if not args.costs.exists():
        raise SystemExit(f"scale_runs: {args.costs} not found (run benchmarks/sim_costs.py)")
    raw = json.loads(args.costs.read_text())
    costs = Costs.load(args.costs)
    if args.pool == "postgresql":
        costs = replace(costs, **POSTGRES)
    commands[args.what](costs, raw, args)


if __name__ == "__main__":
    main()
