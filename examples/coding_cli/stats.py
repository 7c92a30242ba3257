"""What the coding-CLI run's rollouts did, from its run directory.

    python examples/coding_cli/stats.py runs/coding_cli

From the SQLite pool, per finished trajectory: model calls (turns), traces (1 + the calls whose
prompt does not extend the previous call's prompt + completion id for id: a side call, a
compaction or a rewritten history would start one) and reward. From the agents' logs
(agent_logs/*.log, one summary line per episode): the tool calls Pi ran, Pi's turns and how
it ended. Training rollouts (task index >= 0) and held-out ones are counted apart; held-out
logs hold one line per evaluation, in order.
"""

from __future__ import annotations

import re
import sqlite3
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path
from statistics import mean

from forgerl.datapool.sqlite import SQLitePool

LINE = re.compile(r"^turns (\d+) tool_calls (\d+) pi (.+?) check (pass|fail)")


def traces(completions) -> int:
    """1 + the calls that do not extend the previous call id for id."""
    count = 1 if completions else 0
    for prev, c in pairwise(completions):
        count += c.prompt_ids[: len(prev.prompt_ids) + len(prev.completion_ids)] != (
            prev.prompt_ids + prev.completion_ids)
    return count


def pool_stats(run: Path) -> dict[str, dict[str, float]]:
    """Per kind ("train", "held-out"): trajectories, turns and traces per trajectory, reward."""
    with sqlite3.connect(run / "pool.sqlite") as db:  # held-out groups have no task row
        indices = [r[0] for r in db.execute("SELECT DISTINCT task_index FROM trajectories")]
    pool = SQLitePool(run / "pool.sqlite")
    rows: dict[str, list[tuple[int, int, float]]] = {"train": [], "held-out": []}
    for index in indices:
        for traj in pool.get_group(index).trajectories:
            if traj.status == "finished":
                rows["train" if index >= 0 else "held-out"].append(
                    (len(traj.completions), traces(traj.completions), traj.reward or 0.0))
    pool.close()
    return {kind: {"trajectories": len(r), "turns": mean(x[0] for x in r),
                   "traces": mean(x[1] for x in r), "max_traces": max(x[1] for x in r),
                   "reward": mean(x[2] for x in r)} for kind, r in rows.items() if r}


def log_stats(run: Path) -> dict[str, dict[str, object]]:
    """Per kind: episodes, Pi's tool calls and turns per episode, tool-call histogram, how Pi
    ended, pass rate."""
    lines: dict[str, list[tuple[int, int, str, bool]]] = {"train": [], "held-out": []}
    for log in sorted((run / "agent_logs").glob("*.log")):
        kind = "held-out" if log.name.startswith("eval") else "train"
        for line in log.read_text(errors="replace").splitlines():
            if m := LINE.match(line):
                lines[kind].append((int(m[1]), int(m[2]), m[3], m[4] == "pass"))
    return {kind: {"episodes": len(r), "tool_calls": mean(x[1] for x in r),
                   "pi_turns": mean(x[0] for x in r),
                   "tool_call_histogram": dict(sorted(Counter(x[1] for x in r).items())),
                   "pi_ended": dict(Counter(x[2] for x in r)),
                   "passed": mean(x[3] for x in r)} for kind, r in lines.items() if r}


def main() -> None:
    run = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/coding_cli")
    for name, stats in (("pool", pool_stats(run)), ("agent logs", log_stats(run))):
        for kind, values in stats.items():
            shown = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in values.items())
            print(f"{name:<11}{kind:<9} {shown}")


if __name__ == "__main__":
    main()
