"""Step timing and the progress bar of the RL loop (forgerl/controller/loop.py).

Each logged step's record gets where its wall time went: wait_seconds (admit → a batch
released), train_seconds, sync_seconds, eval_seconds, other_seconds (the rest) and
step_seconds (all of it), plus trainer_idle_fraction, rollout_tokens_per_second and
groups_without_signal; the bar shows steps, rollouts in flight, reward, held-out accuracy,
the agent summary and the mean seconds per step.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from forgerl.agents.sandbox import Sandbox
from forgerl.metrics import ProgressBar, agent_summary

if TYPE_CHECKING:
    from forgerl.controller.services import Services

log = logging.getLogger("forgerl")


class StepClock:
    """The timing and progress of `run`'s steps; a context manager that shows the bar
    (`enabled`: draw it at all) from the trainer's step at entry."""

    def __init__(self, services: Services, enabled: bool = True) -> None:
        self.s = services
        self.bar = ProgressBar(services.config.max_steps, services.trainer.step, enabled=enabled)
        self.step_seconds: list[float] = []
        self.acc = "-"
        self.start = time.time()
        self.tokens, self.env_seconds, self.gen_seconds = 0, 0.0, 0.0
        self.no_signal = 0
        self.waited = self.synced = 0.0

    def __enter__(self) -> StepClock:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(*exc)

    def show_step(self) -> None:
        """Show the trainer's step on the bar (after the warm start's steps)."""
        self.bar.update(completed=self.s.trainer.step)

    def begin(self) -> None:
        """Start timing the RL steps (after the warm start)."""
        self.start, self.no_signal, self.acc, self.tokens = time.time(), 0, "-", 0
        self.env_seconds, self.gen_seconds = self.s.env_seconds, self.engine_seconds()

    def batch_ready(self) -> None:
        """The scheduler released a batch: the wait ends here."""
        self.waited = time.time() - self.start

    def no_signal_step(self, batch: list[int], metrics: dict[str, Any]) -> None:
        """A batch without learning signal (no step taken): count its groups
        (`check_signal_streak` warns, then raises)."""
        self.no_signal += len(batch)
        check_signal_streak(self.no_signal, self.s.config.rollout.tasks_per_step, metrics)

    async def sync_weights(self) -> None:
        """`Services.sync_weights`, timed as sync_seconds."""
        synced = time.time()
        await self.s.sync_weights()
        self.synced = time.time() - synced

    def step_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """`metrics` (updated in place and returned) with this step's timing, idle fraction,
        rollout tokens per second, groups without signal, env_seconds (seconds rollouts
        spent in environments since the last step, summed over rollouts: with concurrent
        rollouts it can exceed step_seconds), generation_seconds (the engine's prefill and
        decode seconds since the last step) and sandboxes_peak (most rollout sandboxes open at
        once since the last step); its `step_seconds` (the trainer's) becomes
        train_seconds."""
        seconds, train_seconds = time.time() - self.start, metrics.pop("step_seconds")
        generated = self.s.gateway.counters["completion_tokens"] - self.tokens
        known = self.waited + train_seconds + self.synced + metrics.get("eval_seconds", 0.0)
        metrics |= {"train_seconds": train_seconds, "step_seconds": seconds,
                    "wait_seconds": self.waited, "sync_seconds": self.synced,
                    "other_seconds": max(0.0, seconds - known),
                    "trainer_idle_fraction": max(0.0, 1 - train_seconds / seconds),
                    "rollout_tokens_per_second": generated / seconds,
                    "groups_without_signal": self.no_signal,
                    "env_seconds": self.s.env_seconds - self.env_seconds,
                    "generation_seconds": self.engine_seconds() - self.gen_seconds,
                    "sandboxes_peak": Sandbox.take_peak()}
        return metrics

    def engine_seconds(self) -> float:
        """The local engine's prefill + decode seconds so far (0 for engines without them)."""
        stats = self.s.engine.stats
        return stats.get("prefill_seconds", 0.0) + stats.get("decode_seconds", 0.0)

    def step_done(self, step: int, metrics: dict[str, Any]) -> None:
        """Show the logged step on the bar, then start timing the next one."""
        if "eval_accuracy" in metrics:
            self.acc = f"{metrics['eval_accuracy']:.3f}"
        self.step_seconds.append(metrics["step_seconds"])
        self.bar.update(completed=step,
                        in_flight=len(self.s.rollouts) * self.s.config.rollout.group_size,
                        reward=f"{metrics['reward_mean']:.3f}", acc=self.acc,
                        sps=f"{sum(self.step_seconds) / len(self.step_seconds):.1f}",
                        agent=agent_summary(metrics))
        self.start, self.no_signal = time.time(), 0
        self.tokens = self.s.gateway.counters["completion_tokens"]
        self.env_seconds, self.gen_seconds = self.s.env_seconds, self.engine_seconds()


def check_signal_streak(groups: int, k: int, metrics: dict[str, Any]) -> None:
    """Warn every 50 groups in a row without learning signal (all rewards of each group equal,
    or no model calls); raise RuntimeError at max(64, 16 k) of them: the run cannot learn (e.g.
    the agent never answers right, or the reward is constant), so it stops instead of consuming
    the task stream. What was trained and checkpointed stays."""
    if groups >= max(64, 16 * k):
        raise RuntimeError(
            f"no learning signal in the last {groups} groups: every group's rewards were equal "
            f"(last batch's mean reward {metrics.get('reward_mean', 0.0):.3f}); check the "
            "agent's answers and the reward")
    if groups % 50 < k:
        log.warning("%d groups in a row had no learning signal (equal rewards or no model "
                    "calls)", groups)
