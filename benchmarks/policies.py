"""Per-policy table of a multi-policy run (examples/proposer_solver): each step's reward mean,
loss tokens and weight version per policy, and the held-out evaluations, from its metrics.

    forgerl train examples/proposer_solver/config.toml --run_dir runs/proposer_solver
    python benchmarks/policies.py runs/proposer_solver     # a markdown table on stdout

It also counts, from the run's pool, the finished episodes per step and those in which the
first policy was called (the example's proposal parsed), and the calls recorded per policy.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path


def main(run_dir: Path) -> None:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    names = sorted({k.split("_")[1] for r in records for k in r
                    if k.startswith("policy_") and k.endswith("_reward_mean")})
    print("| step | s/step | " + " | ".join(f"{n} reward | {n} loss tokens | {n} version"
                                          for n in names) + " | held-out accuracy |")
    print("|---" * (2 + 3 * len(names) + 1) + "|")
    for r in records:
        cells = [f"{r.get(f'policy_{n}_reward_mean', float('nan')):.3f} | "
                 f"{r.get(f'policy_{n}_num_loss_tokens', 0):.0f} | "
                 f"{r.get(f'policy_{n}_weight_version', r['step']):.0f}" for n in names]
        held = r.get("eval_accuracy")
        print(f"| {r['step']} | {r.get('step_seconds', float('nan')):.1f} | "
              + " | ".join(cells) + f" | {'' if held is None else f'{held:.3f}'} |")
    db = sqlite3.connect(run_dir / "pool.sqlite")
    first = next(n for n in names if not any(f"policy_{n}_weight_version" in r for r in records))
    print(f"\n| step | episodes | {first} called (proposal parsed) |\n|---|---|---|")
    for step, episodes, called in db.execute(
            "SELECT k.trained_step, COUNT(DISTINCT t.id), COUNT(DISTINCT CASE WHEN c.policy = ?"
            " THEN t.id END) FROM tasks k JOIN trajectories t ON t.task_index = k.task_index"
            " LEFT JOIN completions c ON c.trajectory_id = t.id WHERE k.trained_step IS NOT NULL"
            " AND t.status = 'finished' GROUP BY k.trained_step", (first,)):
        print(f"| {step} | {episodes} | {called} |")
    calls = db.execute("SELECT c.policy, COUNT(*), SUM(LENGTH(c.completion_ids)) / 4"
                       " FROM completions c JOIN trajectories t ON c.trajectory_id = t.id"
                       " WHERE t.task_index >= 0 GROUP BY c.policy").fetchall()
    print("\n| policy | training calls recorded | completion tokens |\n|---|---|---|")
    for policy, n, tokens in calls:
        print(f"| {policy} | {n} | {tokens} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
