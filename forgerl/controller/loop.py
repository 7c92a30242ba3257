"""The RL loop: what `forgerl train` runs (`run`) and what `forgerl gateway` serves.

    agents ──HTTP──► gateway ──► engine                  (rollouts: token-in-token-out)
       │                └──► data pool (SQLite)          (completions, trajectories, rewards)
    scheduler (fifo | fffo | windowed_fifo) ──► trainer  (CISPO over prefix trees)
       ▲                                          │
       └────────── engine.update_weights ◄────────┘      (weight sync, weight_version += 1)

Each step reads as its verbs: admit, next_batch, train, sync_weights, evaluate, log,
checkpoint. The services are built by `start_services` (startup.py), rollouts run in
rollouts.py, training steps in services.py, timing and the progress bar in progress.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from forgerl.config import Config, ConfigError
from forgerl.controller.memory import peak_rss_gib, release_heap, share_malloc_arena
from forgerl.controller.progress import StepClock
from forgerl.controller.rollouts import Agent
from forgerl.controller.scale import serve_one, serve_scaled
from forgerl.controller.startup import start_services
from forgerl.tasks.sources import PLAYED_BY_TOOL_AGENT
from forgerl.trainer.checkpoint import checkpoint_step


async def run(config: Config, agent: Agent | None = None, progress: bool = True) -> Path:
    """Train until `config.max_steps` optimizer steps; returns the run directory.

    Each step: admit rollouts → take finished groups (scheduler policy) → train (CISPO over the
    prefix tree) → sync weights to the engine → evaluate / log → checkpoint. A run already at
    `max_steps` says so in one line and returns without work. Raises RuntimeError, naming the
    last agent error, once no rollout finished in max(16, 4k) groups in a row (a systematic
    failure, e.g. prompts longer than max_model_len): what was trained and checkpointed stays.
    """
    if config.gateway.processes > 1:
        raise ConfigError("gateway.processes: forgerl train serves one gateway process (its "
                          "engine lives in the controller); processes > 1 is for forgerl gateway")
    share_malloc_arena()  # before the engine, trainer and gateway threads allocate
    sections = [(d.agent, d.tasks) for d in config.domains] or [(None, config.tasks)]
    if agent is None and (config.agent is None or config.agent.command is None) and any(
            (a is None or a.command is None) and t.source not in PLAYED_BY_TOOL_AGENT
            for a, t in sections):
        raise ConfigError("agent.command: required (no agent callable was given)")
    if (done := checkpoint_step(config.run_dir)) >= config.max_steps and done > 0:
        print(f"forgerl: {config.run_dir} is finished: step {done} of max_steps "
              f"{config.max_steps}; nothing to do (raise --max_steps to continue)")
        return Path(config.run_dir)
    began = time.time()
    async with start_services(config, agent) as s:
        s.max_steps = config.max_steps
        with StepClock(s, enabled=progress) as clock:
            if s.trainer.step == 0 and not s.logger.logged(0):
                s.log(0, await s.evaluate())
            if s.trainer.step < config.warmstart.steps:
                from forgerl.controller.warmstart import warm_start  # lazy: gateway pulls torch

                await warm_start(s)                         # supervised steps on demonstrations
                clock.show_step()
            clock.begin()
            while s.trainer.step < config.max_steps:
                s.admit()                                   # rollouts the scheduler admits now
                batch = await s.next_batch()                # finished groups the policy releases
                clock.batch_ready()
                metrics = await s.train(batch)              # advantages → prefix tree → CISPO
                s.check_failure_streak()                    # a systematic failure ends the run
                if metrics["num_loss_tokens"] == 0:         # every advantage 0: no step taken
                    clock.no_signal_step(batch, metrics)
                    continue
                await clock.sync_weights()                  # engine runs weight_version = step
                step = s.trainer.step
                if step % config.tasks.eval_every == 0 or step == config.max_steps:
                    metrics |= await s.evaluate()
                await asyncio.to_thread(release_heap)       # freed activations back to the OS
                s.log(step, clock.step_metrics(metrics))    # before the checkpoint: see resume
                if step % config.trainer.checkpoint_every == 0 or step == config.max_steps:
                    await s.checkpoint()
                clock.step_done(step, metrics)
        print(summary(s.logger.records, s.trainer.step, time.time() - began), flush=True)
    return Path(config.run_dir)


def summary(records: list[dict[str, Any]], steps: int, seconds: float) -> str:
    """The one-line end-of-run report: steps, wall time of this process, held-out accuracy
    first → last (from the metrics records) and this process's peak RSS (GiB, `ru_maxrss`)."""
    accuracy = [r["eval_accuracy"] for r in records if r.get("eval_accuracy") is not None]
    held_out = (f"held-out accuracy {accuracy[0]:.3f} → {accuracy[-1]:.3f}" if accuracy
                else "no held-out evaluation")
    minutes, secs = divmod(int(seconds), 60)
    return (f"forgerl: done: {steps} steps; {minutes} min {secs:02d} s; {held_out}; "
            f"peak RSS {peak_rss_gib():.1f} GiB")


async def serve_gateway(config: Config) -> None:
    """`forgerl gateway`: serve the policy to external agents (sessions via POST /v1/sessions);
    `[gateway] processes` > 1: that many gateway processes behind one front (scale.py)."""
    await (serve_scaled(config) if config.gateway.processes > 1 else serve_one(config))
