"""Every shipped example config loads, and names files that exist.

Pins: each examples/*/config.toml validates; relative agent commands and task files resolve
against the example's own folder; the parallel_tools task file yields its tasks; the
mixed-domain example has both domains with their own agents.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forgerl.config import load_config
from forgerl.controller import make_task_sets

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("config", sorted(EXAMPLES.glob("*/config.toml")),
                         ids=lambda p: p.parent.name)
def test_example_config_loads_and_its_files_exist(config):
    cfg = load_config(config)
    agents = [a for a in [cfg.agent, *(d.agent for d in cfg.domains)] if a is not None]
    for agent in agents:
        script = next((a for a in agent.command or () if a.endswith(".py")), None)
        if script is not None:
            assert (Path(agent.cwd) / script).is_file(), script
    for tasks in [cfg.tasks] + [d.tasks for d in cfg.domains]:
        if tasks.dataset.endswith(".py"):
            assert Path(tasks.dataset).is_file()


def test_parallel_tools_task_sets_and_mixed_domains():
    cfg = load_config(EXAMPLES / "parallel_tools" / "config.toml", ["--tasks.size", "40"])
    train, held = make_task_sets(cfg)
    assert len(held) == 32 and 0 < len(train) <= 40
    assert all(t["question"].startswith("Compute ") for t in train + held)
    mixed = load_config(EXAMPLES / "mixed_domains" / "config.toml")
    assert [d.name for d in mixed.domains] == ["chain_sum", "calculator"]
    assert mixed.domains[1].agent.command[-3:] == ["../calculator_agent/agent.py", "--shots", "2"]
