"""Completion-time reward on vs off (issue 11 item 2, Forge §4.2): held-out evaluation of
trained run directories, one after the other in this process's session on the same machine.

For each RUN_DIR (a finished `forgerl train` run of examples/parallel_tools, its config.json
beside its checkpoint) the held-out tasks are run greedily with the run's latest checkpoint,
`--repeats` times, through the real gateway, engine and agent processes. Printed per run:
held-out accuracy, mean completion time of a rollout (wall seconds from session open to the
agent's exit, `eval_rollout_seconds`), the share of rollouts with a reply holding >= 2 tool
calls (parallel calls), model calls per rollout and the share of tool calls to `--slow-tool`
(default calculator_remote: `agent.py --tools` with an "r"; 0 when the agent never declares
it); the last column is the completion time against the first run's at the same concurrency.
`--concurrency K ...` evaluates each run at each K held-out rollouts in flight at once ([tasks]
eval_concurrency; 0 = all at once, as in training): at K above the engine's batch the rollouts
queue for it, and the queueing hides the tools' own seconds.

Run: `.venv/bin/python benchmarks/completion_time.py runs/pt_off runs/pt_on [--repeats 2]
[--concurrency 0 4]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
from pathlib import Path

from forgerl.config import Config
from forgerl.controller import start_services
from forgerl.trainer.checkpoint import latest_checkpoint


async def evaluate(run_dir: Path, repeats: int, slow_tool: str,
                   concurrency: int = 0) -> list[dict[str, float]]:
    """Held-out metrics of `run_dir`'s latest checkpoint, `repeats` times, at most `concurrency`
    rollouts at once (0: all), each with `slow_tool_share`: the fraction of the agents' tool
    calls (over all repeats) to `slow_tool`. A scratch copy of the run directory holds the eval
    trajectories, so the run itself is not changed."""
    config = Config.model_validate(json.loads((run_dir / "config.json").read_text()))
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise SystemExit(f"{run_dir}: no checkpoint")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "run"
        (scratch / "checkpoints").mkdir(parents=True)
        shutil.copytree(ckpt, scratch / "checkpoints" / ckpt.name)
        tasks = config.tasks.model_copy(update={"eval_concurrency": concurrency})
        config = config.model_copy(update={"run_dir": str(scratch), "tasks": tasks})
        async with start_services(config, training=False) as s:
            results = [await s.evaluate() for _ in range(repeats)]
        # the agents' logs name each tool they ran: "tool NAME {arguments} -> result"
        names = [line.split()[1] for log in (scratch / "agent_logs").glob("eval*.log")
                 for line in log.read_text().splitlines() if line.startswith("tool ")]
        share = names.count(slow_tool) / len(names) if names else float("nan")
        return [r | {"slow_tool_share": share} for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--slow-tool", default="calculator_remote",
                        help="tool whose share of calls is reported (agent.py --tools r)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[0],
                        help="held-out rollouts in flight at once, one table row each (0: all)")
    args = parser.parse_args()
    rows = []
    for k in args.concurrency:
        for run_dir in args.run_dirs:
            results = asyncio.run(evaluate(run_dir, args.repeats, args.slow_tool, k))
            mean = {key: sum(r[key] for r in results) / len(results) for key in results[0]
                    if isinstance(results[0][key], float)}
            rows.append((k, run_dir, mean, [r["eval_rollout_seconds"] for r in results]))
    print(f"| run | in flight | held-out accuracy | completion time (s), mean of {args.repeats} | "
          "per repeat | eval wall (s) | parallel-call share | model calls / rollout | calls to "
          "the slow tool | time vs first |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    first: dict[int, float] = {}  # per concurrency: the first run's completion time
    for k, run_dir, m, each in rows:
        base = first.setdefault(k, m["eval_rollout_seconds"])
        print(f"| {run_dir} | {k or 'all'} | {m['eval_accuracy']:.3f} | "
              f"{m['eval_rollout_seconds']:.2f} | {', '.join(f'{x:.2f}' for x in each)} | "
              f"{m['eval_seconds']:.1f} | {m['eval_parallel_call_rate']:.3f} | "
              f"{m['eval_turns_per_trajectory']:.2f} | {m['slow_tool_share']:.3f} | "
              f"{m['eval_rollout_seconds'] / base:.3f} |")


if __name__ == "__main__":
    main()
