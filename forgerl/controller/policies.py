"""Several trained policies in one run ([[policies]]): a policy is data, not a second loop.

    agent ─ model "solver" ──► gateway ─► engine of "solver"   ─► pool (completions.policy)
          └ model "proposer" ─┘      └─► engine of "proposer"
    train: each policy's trainer on `policy_group(group, name)` of the same finished groups
    sync_weights / checkpoint: every policy (its own weight_version, RUN_DIR/policies/<name>)

The first policy is the run's main one (`Services.trainer`, `Services.engine`, RUN_DIR's own
checkpoints): the loop's step is its step. Every other one is a `Policy` here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgerl.config import Config, ConfigError
from forgerl.controller.rundir import resume
from forgerl.trainer.checkpoint import save_checkpoint
from forgerl.trainer.policies import policy_group
from forgerl.types import Group

POLICY_METRICS = ("reward_mean", "loss", "num_loss_tokens", "entropy_mean")
"""The train_step metrics logged per policy as `policy_<name>_<metric>`."""


@dataclass
class Policy:
    """One more trained policy: its own trainer (model, AdamW, step = weight version), engine
    and checkpoints under `run_dir` (RUN_DIR/policies/<name>)."""

    name: str
    trainer: Any
    engine: Any
    run_dir: Path
    weight_sync: Any = None

    async def train(self, groups: list[Group]) -> dict[str, float]:
        """One optimizer step on this policy's view of `groups` (`policy_group`), in a thread;
        its metrics as `policy_<name>_...` (POLICY_METRICS)."""
        mine = [policy_group(g, self.name) for g in groups]
        metrics = await asyncio.to_thread(self.trainer.train_step, mine)
        return named(self.name, metrics) | {f"policy_{self.name}_weight_version":
                                            float(self.trainer.step)}

    async def sync(self, weight_sync_config: Any) -> None:
        """Push its trainer's weights to its engine as weight_version = its step (a no-op when
        the engine runs them already)."""
        if self.engine.weight_version == self.trainer.step:
            return
        if self.weight_sync is None:
            from forgerl.trainer.weight_sync import WeightSync  # lazy: torch

            self.weight_sync = WeightSync(self.engine, weight_sync_config)
        await self.weight_sync.sync(self.trainer.state_dict_for_sync(), self.trainer.step)

    async def checkpoint(self, keep: int, run_step: int) -> None:
        """Save its model, AdamW and step under RUN_DIR/policies/<name>/checkpoints."""
        t = self.trainer
        await asyncio.to_thread(lambda: save_checkpoint(
            self.run_dir, t.model, t.optimizer, t.step, {"run_step": run_step}, keep,
            t.checkpoint_state()))


def named(policy: str, metrics: dict[str, Any]) -> dict[str, float]:
    """POLICY_METRICS of one policy's train_step as `policy_<name>_<metric>`."""
    return {f"policy_{policy}_{k}": metrics[k] for k in POLICY_METRICS if k in metrics}


def load_models(config: Config, tokenizer: Any) -> dict[str, Any]:
    """The model of every [[policies]] entry after the first, by name, loaded before anything
    of the run is written. Raises ConfigError (`policies.<i>.path`) when one does not share the
    first policy's tokenizer (one renderer tokenises every call)."""
    from forgerl.models import load_policy  # lazy: torch, transformers

    models = {}
    for i, entry in enumerate(config.policies[1:], start=1):
        model, own_tokenizer, _ = load_policy(entry.path)
        if own_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"policies.{i}.path: {entry.path!r} does not share the first "
                              f"policy's tokenizer ({config.policies[0].path!r})")
        models[entry.name] = model
    return models


async def build_policies(config: Config, models: dict[str, Any], run_dir: Path,
                         start_engine: Callable[[Any], Awaitable[tuple[Any, Any]]]
                         ) -> dict[str, Policy]:
    """A `Policy` per model of `load_models`: its trainer built and resumed from
    RUN_DIR/policies/<name>, its engine started by `start_engine(trainer)` (which gives
    (engine, cluster)). Raises ConfigError when a checkpoint is of another model."""
    from forgerl.trainer.data_parallel import build_trainer  # lazy: torch

    policies: dict[str, Policy] = {}
    for entry in config.policies[1:]:
        trainer = build_trainer(config, models[entry.name])
        folder = run_dir / "policies" / entry.name
        resume(folder, trainer, entry.path)
        engine, _ = await start_engine(trainer)
        policies[entry.name] = Policy(entry.name, trainer, engine, folder)
    return policies
