"""The single controller: builds every service in one process and runs the asynchronous RL loop.

    agents ──HTTP──► gateway ──► local engine          (rollouts: token-in-token-out)
       │                └──► data pool (SQLite)          (completions, trajectories, rewards)
    scheduler (fifo | fffo | windowed_fifo) ──► trainer (CISPO over prefix trees)
       ▲                                          │
       └────────── engine.update_weights ◄────────┘      (weight sync, weight_version += 1)

`run(config)` is what `forgerl train` calls; `run(config, agent=fn)` runs an async Python
callable `fn(task, base_url, api_key) -> answer` instead of the configured command. Every
service is also a plain object usable on its own (tests build them directly).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forgerl.config import Config, ConfigError

if TYPE_CHECKING:  # the heavy modules are imported lazily at run time
    from forgerl.datapool.sqlite import SQLitePool
    from forgerl.engines.local import LocalEngine
    from forgerl.gateway.app import Gateway, GatewayServer
    from forgerl.metrics import MetricsLogger
    from forgerl.scheduler.policies import Scheduler
    from forgerl.trainer.trainer import Trainer

log = logging.getLogger("forgerl")
# What SmolLM2's own chat template inserts when a conversation has no system message.
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
Agent = Callable[[dict, str, str], Awaitable[str | None]]


@dataclass
class Services:
    """The running services of one run and the rollout bookkeeping between them."""

    config: Config
    run_dir: Path
    trainer: Trainer
    engine: LocalEngine
    pool: SQLitePool
    gateway: Gateway
    server: GatewayServer
    scheduler: Scheduler
    tasks: list[dict]
    eval_tasks: list[dict]
    agent: Agent | list[str] | None
    """The callable passed to `run`, else the configured command ("python" = this interpreter)."""
    logger: MetricsLogger
    rollouts: dict[int, asyncio.Task] = field(default_factory=dict)
    group_done: asyncio.Event = field(default_factory=asyncio.Event)
    reward_status: Counter[str] = field(default_factory=Counter)
    rollout_seconds: dict[int, list[float]] = field(default_factory=dict)
    """Task index → durations of its ended training rollouts (for the duration-bias metrics)."""
    group_started: dict[int, float] = field(default_factory=dict)
    trained_tasks: list[int] = field(default_factory=list)
    closing: bool = False
    """Set at shutdown: no new rollouts are admitted while the running ones are cancelled."""
    failed_streak: int = 0
    last_rollout_error: str = ""

    # ---- rollouts ---------------------------------------------------------------------------

    async def run_agent(self, task: dict, api_key: str) -> tuple[str, str | None, str | None]:
        """One agent episode against the gateway: (status, answer, error)."""
        from forgerl.agents.runner import run_agent

        cfg = self.config
        assert self.agent is not None  # checked in run()
        cwd, env = None, None
        if cfg.agent is not None:  # a command agent: its directory and turn limit
            cwd = cfg.agent.cwd
            env = {"FORGERL_MAX_TURNS": str(cfg.agent.max_turns),
                   "OPENAI_MODEL": cfg.gateway.model_name}
        task = {"question": task["question"]}  # the agent never sees the reference answer
        result = await run_agent(self.agent, task, self.server.base_url, api_key,
                                 cfg.rollout.timeout_s, cwd=cwd, env=env)
        if result.status == "finished":
            return result.status, result.answer, None
        code = "" if result.returncode is None else f" (exit code {result.returncode})"
        tail = result.stderr_tail[-2000:]
        return result.status, result.answer, f"agent {result.status}{code}" + (
            f"\n{tail}" if tail else "")

    async def rollout(self, task_index: int, rollout_index: int, task: dict,
                      temperature: float) -> float:
        """Run one rollout, score it, and finish its trajectory in the pool; returns the reward.

        A cancelled rollout (Ctrl-C, shutdown) is marked aborted and re-run on resume; a timed-out
        one is failed (kept out of the loss) or, with `rollout.on_timeout = "redispatch"`,
        aborted so that `rollout_group` runs it again.
        """
        trajectory_id, api_key = self.gateway.open_session(
            task_index, rollout_index, temperature=temperature,
            max_tokens=self.config.rollout.max_tokens,
        )
        start = time.time()
        try:
            status, answer, error = await self.run_agent(task, api_key)
        except asyncio.CancelledError:
            self.pool.finish_trajectory(trajectory_id, "aborted", error="cancelled")
            raise
        finally:
            self.gateway.sessions.close(api_key)
        if task_index >= 0:
            self.rollout_seconds.setdefault(task_index, []).append(time.time() - start)
        if status == "finished":
            reward = await self.score(task, answer)
            self.pool.finish_trajectory(trajectory_id, "finished", reward=reward)
            return reward
        redispatch = status == "timeout" and self.config.rollout.on_timeout == "redispatch"
        self.pool.finish_trajectory(trajectory_id, "aborted" if redispatch else "failed",
                                    error=error or status)
        return 0.0

    async def score(self, task: dict, answer: str | None) -> float:
        """reasoning-gym's scorer in a child process with a timeout (CASES.md C13)."""
        from forgerl.rewards.reasoning_gym import score
        from forgerl.rewards.scoring import score_with_timeout

        [result] = await asyncio.to_thread(score_with_timeout, score, [(task, answer)],
                                           self.config.rollout.reward_timeout_s, 0.0)
        self.reward_status[result.status] += 1
        if result.status != "ok":
            log.warning("reward %s on task %r: %s", result.status, task["question"], result.error)
        return result.reward

    async def rollout_group(self, task_index: int) -> None:
        """The G rollouts of one task, concurrently; then tell the scheduler the group is done.

        After a resume only the rollouts without a finished/failed trajectory are run again;
        with `on_timeout = "redispatch"` timed-out rollouts get one more attempt.
        """
        task = self.tasks[task_index % len(self.tasks)]
        self.pool.add_task(task_index, task)
        self.group_started.setdefault(task_index, time.time())
        G, temperature = self.config.rollout.group_size, self.config.rollout.temperature
        for _ in range(2 if self.config.rollout.on_timeout == "redispatch" else 1):
            missing = self.pool.missing_rollouts(task_index, G)
            results = await asyncio.gather(
                *(self.rollout(task_index, g, task, temperature) for g in missing),
                return_exceptions=True)  # one crashed rollout must not orphan its siblings
            for result in results:
                if isinstance(result, Exception):
                    log.error("a rollout of task %d crashed: %r", task_index, result)
        self.pool.finish_group(task_index)
        group = self.pool.get_group(task_index)
        versions = [v for t in group.trajectories for c in t.completions for v in c.weight_versions]
        self.scheduler.on_group_finished(task_index,
                                         min(versions, default=self.engine.weight_version))
        self.group_done.set()
        self.admit()  # its generation slot is free (`scheduler.max_in_flight`)

    def admit(self) -> None:
        """Start the rollouts of every task the scheduler admits now (concurrency cap, lag
        bound), stamped with the engine's weight_version: between a step and its weight sync the
        engine still serves the previous version."""
        if self.closing:
            return
        for task_index in self.scheduler.admit(self.engine.weight_version):
            task = asyncio.create_task(self.rollout_group(task_index))
            self.rollouts[task_index] = task
            task.add_done_callback(lambda t, i=task_index: self._rollout_done(i, t))

    def _rollout_done(self, task_index: int, task: asyncio.Task) -> None:
        self.rollouts.pop(task_index, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("rollout group %d crashed: %r", task_index, task.exception())
            self.scheduler.on_group_finished(task_index, self.engine.weight_version)
            self.group_done.set()
            self.admit()

    async def next_batch(self) -> list[int]:
        """Wait until the scheduler's policy releases `tasks_per_step` finished groups."""
        while (batch := self.scheduler.next_batch(self.config.rollout.tasks_per_step)) is None:
            self.group_done.clear()
            self.admit()
            await self.group_done.wait()
        return batch

    # ---- training ---------------------------------------------------------------------------

    async def train(self, task_indices: list[int]) -> dict[str, float]:
        """One optimizer step on the chosen groups (in a thread: the gateway keeps serving).

        Counts `failed_streak`: groups in a row in which no rollout finished (e.g. every
        agent call rejected), with the last such rollout's error in `last_rollout_error`;
        groups whose rollouts all ran before a resume do not count.
        """
        groups = [self.pool.get_group(i) for i in task_indices]
        for i, group in zip(task_indices, groups, strict=True):
            if i not in self.rollout_seconds:
                continue  # generated by an earlier process: says nothing about this one
            if any(t.status == "finished" for t in group.trajectories):
                self.failed_streak = 0
                continue
            self.failed_streak += 1
            errors = [t.error for t in group.trajectories if t.error]
            self.last_rollout_error = errors[-1] if errors else self.last_rollout_error
        metrics = await asyncio.to_thread(self.trainer.train_step, groups)
        self.trained_tasks += task_indices
        metrics |= self.duration_bias()
        self.scheduler.on_trained(task_indices, self.trainer.step)
        self.pool.commit_trained(task_indices, self.trainer.step,
                                 {"scheduler": self.scheduler.state()})
        return metrics

    def check_failure_streak(self) -> None:
        """Raise RuntimeError, naming the last agent error (its status line and last line),
        once no rollout finished in max(16, 4k) groups in a row (`train` counts them)."""
        if self.failed_streak < max(16, 4 * self.config.rollout.tasks_per_step):
            return
        lines = [x for x in self.last_rollout_error.splitlines() if x.strip()] or ["?"]
        last = lines[0] + (f": {lines[-1]}" if len(lines) > 1 else "")
        raise RuntimeError(f"every rollout of the last {self.failed_streak} groups failed; "
                           f"last error: {last}")

    def duration_bias(self) -> dict[str, float]:
        """Rollout seconds of every task trained so far vs the same number of tasks in admission
        order, where a rollout still running counts with its elapsed time (a lower bound): a
        policy that trains quick tasks first shows trained << admitted."""
        now, G = time.time(), self.config.rollout.group_size

        def seconds(i: int) -> list[float]:
            ended = self.rollout_seconds.get(i, [])
            running = G - len(ended) if i in self.rollouts else 0
            return ended + [now - self.group_started[i]] * running

        trained = [d for i in self.trained_tasks for d in self.rollout_seconds.get(i, [])]
        first = sorted(self.group_started)[: len(self.trained_tasks)]
        admitted = [d for i in first for d in seconds(i)]
        return (_duration_stats("rollout_seconds_trained", trained)
                | _duration_stats("rollout_seconds_admitted", admitted))

    async def sync_weights(self) -> None:
        """Push the trainer's weights to the engine as weight_version = trainer.step."""
        await self.engine.update_weights(self.trainer.state_dict_for_sync(), self.trainer.step)

    async def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: each eval task once, greedy (temperature 0), concurrently."""
        if not self.eval_tasks:
            return {}
        start = time.time()
        rewards = await asyncio.gather(*(
            self.rollout(-1 - i, 0, task, temperature=0.0) for i, task in enumerate(self.eval_tasks)
        ))
        n = len(rewards)
        return {"eval_accuracy": sum(r >= 1.0 for r in rewards) / n,
                "eval_reward_mean": sum(rewards) / n, "eval_seconds": time.time() - start}

    async def checkpoint(self) -> None:
        """Save model, optimizer and scheduler state under RUN_DIR/checkpoints, in a thread so
        the gateway keeps serving (no training runs meanwhile)."""
        from forgerl.trainer.checkpoint import save_checkpoint

        await asyncio.to_thread(save_checkpoint, self.run_dir, self.trainer.model,
                                self.trainer.optimizer, self.trainer.step,
                                {"scheduler": self.scheduler.state()})

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one step record: `metrics` plus gateway, reward, engine and scheduler counters."""
        stats = {"rollouts_in_flight": len(self.rollouts),
                 **{f"gateway_{k}": v for k, v in self.gateway.counters.items()},
                 **{f"reward_{k}": v for k, v in self.reward_status.items()},
                 **{f"engine_{k}": v for k, v in self.engine.stats.items()},
                 **{f"scheduler_{k}": v for k, v in self.scheduler.metrics().items()},
                 "off_policy_lag_histogram": {str(lag): n for lag, n
                                              in sorted(self.scheduler.lag_counts.items())}}
        self.logger.log(step, metrics | stats)


def _duration_stats(name: str, seconds: list[float]) -> dict[str, float]:
    """Mean and p90 (nearest rank) of durations in seconds; empty → {}."""
    if not seconds:
        return {}
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {f"{name}_mean": sum(ordered) / len(ordered), f"{name}_p90": p90}


def load_policy(path: str) -> tuple[Any, Any, str | None]:
    """(model, tokenizer, default system prompt) for `model.path` (see ModelConfig)."""
    from forgerl.models import build_byte_tokenizer, build_tiny_model, load_pretrained

    if path == "tiny":
        return build_tiny_model(), build_byte_tokenizer(), None
    if path != "smollm2" and not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.path: {path!r} is not 'smollm2', 'tiny' or a local HF model "
                          "folder (one with a config.json)")
    model, tokenizer = load_pretrained(path)
    return model, tokenizer, SMOLLM2_SYSTEM if path == "smollm2" else None


def make_task_sets(config: Config) -> tuple[list[dict], list[dict]]:
    """Training tasks and held-out tasks (another seed; their questions are removed from the
    training set, so evaluation never sees a question that was trained on)."""
    from forgerl.rewards.reasoning_gym import make_tasks

    t = config.tasks
    held_out = make_tasks(t.dataset, t.eval_size, t.seed + 1_000_003, **t.params) \
        if t.eval_size else []
    held = {task["question"] for task in held_out}
    train = [task for task in make_tasks(t.dataset, t.size, t.seed, **t.params)
             if task["question"] not in held]
    if not train:
        raise ValueError("tasks: every training question is also a held-out one; raise tasks.size")
    return train, held_out


@contextlib.asynccontextmanager
async def start_services(config: Config, agent: Agent | None = None) -> AsyncIterator[Services]:
    """Build and start every service; resume from RUN_DIR/checkpoint when one exists."""
    from forgerl.datapool.sqlite import SQLitePool
    from forgerl.engines.local import LocalEngine
    from forgerl.gateway.app import Gateway
    from forgerl.gateway.renderer import ChatMLRenderer
    from forgerl.metrics import MetricsLogger
    from forgerl.scheduler.policies import Scheduler
    from forgerl.trainer.checkpoint import latest_checkpoint, load_checkpoint
    from forgerl.trainer.trainer import Trainer

    tasks, eval_tasks = make_task_sets(config)  # before anything is opened: it may raise
    model, tokenizer, system = load_policy(config.model.path)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.model_dump(), indent=2))
    tc = config.trainer
    trainer = Trainer(model.train(), lr=tc.lr, weight_decay=tc.weight_decay,
                      max_grad_norm=tc.max_grad_norm, loss_fn=tc.loss.build(),
                      temperature=config.rollout.temperature, max_row_tokens=tc.max_row_tokens,
                      merge_prefixes=tc.merge_prefixes, normalize_std=tc.normalize_std)
    pool = SQLitePool(config.datapool.path or run_dir / "pool.sqlite")
    scheduler_state = None
    if (ckpt := latest_checkpoint(run_dir)) is not None:
        trainer.step, extra = load_checkpoint(ckpt, trainer.model, trainer.optimizer)
        scheduler_state = extra.get("scheduler")
        log.info("resumed from %s at step %d", ckpt, trainer.step)
    # The pool holds the scheduler state of the last consumed batch; it is the one to resume from
    # when it matches the restored weights (e.g. batches without learning signal consumed after
    # the checkpoint, or before any checkpoint). Otherwise the checkpoint's state is used and the
    # groups trained after it go back to the queue (Scheduler.resume).
    if (latest := pool.get_meta("scheduler")) is not None and latest["version"] == trainer.step:
        scheduler_state = latest
    scheduler = Scheduler.build(config.scheduler, config.rollout, pool, scheduler_state)
    engine = LocalEngine(trainer.model,  # the engine keeps its own copy of the weights
                         max_model_len=config.model.max_model_len,
                         max_batch_size=config.engine.max_batch_size,
                         prefix_cache_tokens=config.engine.prefix_cache_tokens)
    engine.weight_version = trainer.step
    gateway = Gateway(ChatMLRenderer(tokenizer, default_system=system), engine, pool,
                      config.gateway.model_name, temperature=config.rollout.temperature,
                      max_tokens=config.rollout.max_tokens)
    server = await gateway.serve(config.gateway.host, config.gateway.port)
    if agent is None and config.agent is not None:
        command = list(config.agent.command)
        agent = [sys.executable, *command[1:]] if command[0] in ("python", "python3") else command
    services = Services(config, run_dir, trainer, engine, pool, gateway, server, scheduler, tasks,
                        eval_tasks, agent, MetricsLogger(run_dir))
    try:
        yield services
    finally:
        services.closing = True
        for task in list(services.rollouts.values()):
            task.cancel()
        await asyncio.gather(*services.rollouts.values(), return_exceptions=True)
        await server.stop()
        await engine.close()
        services.logger.close()
        pool.close()


async def run(config: Config, agent: Agent | None = None, progress: bool = True) -> Path:
    """Train until `config.max_steps` optimizer steps; returns the run directory.

    Each step: admit rollouts → take finished groups (scheduler policy) → train (CISPO over the
    prefix tree) → sync weights to the engine → checkpoint / evaluate / log. Raises
    RuntimeError, naming the last agent error, once no rollout finished in max(16, 4k) groups
    in a row (a systematic failure, e.g. prompts longer than max_model_len): what was trained
    and checkpointed stays.
    """
    from forgerl.metrics import ProgressBar

    if agent is None and config.agent is None:
        raise ConfigError("agent.command: required (no agent callable was given)")
    async with start_services(config, agent) as s:
        with ProgressBar(config.max_steps, s.trainer.step, enabled=progress) as bar:
            if s.trainer.step == 0:
                s.log(0, await s.evaluate())
            start, no_signal, acc, tokens = time.time(), 0, "-", 0
            while s.trainer.step < config.max_steps:
                s.admit()                                   # rollouts the scheduler admits now
                batch = await s.next_batch()                # finished groups the policy releases
                metrics = await s.train(batch)              # advantages → prefix tree → CISPO
                s.check_failure_streak()                    # a systematic failure ends the run
                if metrics["num_loss_tokens"] == 0:         # every advantage 0: no step taken
                    no_signal += len(batch)
                    if no_signal % 50 < len(batch):
                        log.warning("%d groups in a row had no learning signal (equal rewards or "
                                    "no model calls)", no_signal)
                    continue
                await s.sync_weights()                      # engine runs weight_version = step
                step = s.trainer.step
                if step % config.trainer.checkpoint_every == 0 or step == config.max_steps:
                    await s.checkpoint()
                if step % config.tasks.eval_every == 0 or step == config.max_steps:
                    metrics |= await s.evaluate()
                    if "eval_accuracy" in metrics:
                        acc = f"{metrics['eval_accuracy']:.3f}"
                seconds, train_seconds = time.time() - start, metrics.pop("step_seconds")
                generated = s.gateway.counters["completion_tokens"] - tokens
                metrics |= {"train_seconds": train_seconds, "step_seconds": seconds,
                            "trainer_idle_fraction": max(0.0, 1 - train_seconds / seconds),
                            "rollout_tokens_per_second": generated / seconds,
                            "groups_without_signal": no_signal}
                s.log(step, metrics)
                bar.update(completed=step, in_flight=len(s.rollouts) * config.rollout.group_size,
                           reward=f"{metrics['reward_mean']:.3f}", acc=acc,
                           sps=f"{metrics['step_seconds']:.1f}")
                start, no_signal = time.time(), 0
                tokens = s.gateway.counters["completion_tokens"]
    return Path(config.run_dir)


async def serve_gateway(config: Config) -> None:
    """`forgerl gateway`: serve the policy to external agents (sessions via POST /v1/sessions)."""
    async with start_services(config) as s:
        print(f"ForgeRL gateway at {s.server.base_url} (model {config.gateway.model_name!r})")
        await asyncio.Event().wait()
