"""Step-0 probe: run the calculator agent on a few tasks through the real gateway and engine
(no training) and print tool use and accuracy. Uses config.toml with its run_dir moved to a
temporary folder.

    python examples/calculator_agent/probe.py --tasks 8 --samples 4 --temperature 1.0 --shots 2
    python examples/calculator_agent/probe.py --tasks 32 --samples 1 --temperature 0   # greedy
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from forgerl.config import load_config
from forgerl.controller import make_task_sets, start_services
from forgerl.metrics import rollout_stats


async def probe(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(Path(__file__).with_name("config.toml"),
                             [f"--run_dir={tmp}", f"--tasks.eval_size={args.tasks}",
                              f'--agent.command=["python", "agent.py", "--shots", "{args.shots}"]'])
        _, tasks = make_task_sets(config)  # held-out tasks
        start = time.time()
        async with start_services(config) as s:
            jobs = [(i * args.samples + g, task) for i, task in enumerate(tasks)
                    for g in range(args.samples)]
            rewards = await asyncio.gather(*(s.rollout(-1 - k, 0, task, args.temperature)
                                             for k, task in jobs))
            trajs = [s.pool.get_group(-1 - k).trajectories[0] for k, _ in jobs]
            renderer = s.gateway.renderer
            stats = rollout_stats(trajs, renderer.decode, renderer.parser.parse)
            for traj in trajs[: args.show]:
                for c in traj.completions:
                    print(repr(s.gateway.renderer.decode(c.completion_ids)))
                print("---")
        accuracy = sum(r >= 1.0 for r in rewards) / len(rewards)
        print(f"shots {args.shots} T {args.temperature}: {len(rewards)} rollouts, accuracy "
              f"{accuracy:.3f}, " + ", ".join(f"{k} {v:.3f}" for k, v in stats.items())
              + f", {time.time() - start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--shots", type=int, default=2)
    parser.add_argument("--show", type=int, default=4, help="rollouts whose replies to print")
    asyncio.run(probe(parser.parse_args()))


if __name__ == "__main__":
    main()
