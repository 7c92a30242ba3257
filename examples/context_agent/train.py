"""Train or evaluate the context-management agent (agent.py) with ForgeRL.

    python examples/context_agent/train.py --cm learned              # train, CM as an action
    python examples/context_agent/train.py --cm truncate --eval      # held-out eval only
    python examples/context_agent/train.py --cm none --eval --run_dir runs/x --tasks.eval_size 8

`--cm`: learned | truncate | none | summarize | drop | forget (agent.py). `--eval`: run the
held-out tasks once, greedy, with the run directory's latest checkpoint (the base model when it
has none), print accuracy, tool use and context overflows, and train nothing. Other arguments
are config overrides, as for `forgerl train`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from agent import MODES, make_agent

from forgerl.config import ConfigError, load_config
from forgerl.controller import run, start_services


async def evaluate(config, agent) -> dict[str, float]:
    async with start_services(config, agent, training=False) as s:
        metrics = await s.evaluate()
        metrics["context_overflows"] = float(s.gateway.counters["context_overflows"])
        return metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cm", choices=MODES, default="learned")
    parser.add_argument("--eval", action="store_true", help="held-out evaluation only")
    args, overrides = parser.parse_known_args()
    try:
        config = load_config(Path(__file__).with_name("config.toml"), overrides)
    except ConfigError as e:
        sys.exit(f"train.py: {e}")
    agent = make_agent(args.cm, max_turns=config.agent.max_turns if config.agent else 5)
    if args.eval:
        metrics = asyncio.run(evaluate(config, agent))
        print(json.dumps({"cm": args.cm, **{k: round(v, 4) for k, v in metrics.items()}}))
    else:
        asyncio.run(run(config, agent=agent))


if __name__ == "__main__":
    main()
