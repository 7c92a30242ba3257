"""Step-0 probe: run the Pi agent on held-out tasks through the real gateway and engine with the
untrained policy (no warm start, no training) and print tool use and success. Uses config.toml
with its run_dir moved to a temporary folder.

    python examples/coding_cli/probe.py --tasks 8 --samples 2 --temperature 0.7
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
                              "--warmstart.steps=0"])
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
                    print(repr(renderer.decode(c.completion_ids)))
                print("---")
        replied = sum(bool(t.completions) for t in trajs)
        print(f"T {args.temperature}: {len(rewards)} rollouts, {replied} with a reply, success "
              f"{sum(r >= 1.0 for r in rewards)}, " + ", ".join(f"{k} {v:.3f}" for k, v in
                                                             stats.items())
              + f", {time.time() - start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--show", type=int, default=4, help="rollouts whose replies to print")
    asyncio.run(probe(parser.parse_args()))


if __name__ == "__main__":
    main()
