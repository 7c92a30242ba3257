"""Rollouts: admitting tasks, running each task's group of agent episodes against the gateway,
scoring them and telling the scheduler, plus the held-out evaluation.

    scheduler.admit ─► rollout_group (G rollouts: agent ─HTTP─► gateway ─► engine; score)
                           └─► pool.finish_group ─► scheduler.on_group_finished ─► next_batch

`Rollouts` holds these steps of `Services` (forgerl/controller/services.py), which owns the
state they share; a rollout's sampling seed is `rollout_seed`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from forgerl.agents.forkserver import ForkServer, script_imports
from forgerl.agents.runner import infra_cause, run_agent
from forgerl.agents.sandbox import SandboxError
from forgerl.config import AgentConfig, ConfigError
from forgerl.metrics import rollout_stats
from forgerl.rewards.composite import duration_s
from forgerl.rewards.reasoning_gym import score
from forgerl.rewards.scoring import score_with_timeout
from forgerl.tasks.agent import play
from forgerl.tasks.base import Environment, Episode
from forgerl.tasks.episode import open_sandbox, run_episode
from forgerl.types import NO_CALL

if TYPE_CHECKING:
    from forgerl.agents.sandbox import Sandbox
    from forgerl.gateway.sessions import Session
    from forgerl.types import Trajectory

log = logging.getLogger("forgerl")
Agent = Callable[[dict, str, str], Awaitable[str | None]]


class Rollouts:
    """The rollout steps of `Services` (a base class of it): they read and update its fields
    (config, engine, pool, gateway, server, scheduler, tasks, the rollout bookkeeping)."""

    def agent_for(self, task: dict) -> tuple[Agent | list[str] | None, AgentConfig | None]:
        """The agent that runs `task` and its section: its [[domains]] entry's own, else the
        run's."""
        return self.domain_agents.get(task.get("domain", ""), (self.agent, self.config.agent))

    async def run_agent(self, task: dict, api_key: str, log_name: str,
                        session: Session | None = None, cwd: str | None = None,
                        episode_env: dict[str, str] | None = None, sandbox: Sandbox | None = None
                        ) -> tuple[str, str | None, str | None]:
        """One agent episode against the gateway: (status, answer, error), status "finished",
        "failed", "timeout" or "aborted_infra" (`runner.infra_cause`, counting the engine errors
        of `session`). A command agent's stderr is appended to RUN_DIR/agent_logs/`log_name`.log;
        it runs with `episode_env` added, inside `sandbox` when given (`cwd` a path inside).
        """
        cfg = self.config
        agent, agent_cfg = self.agent_for(task)
        assert agent is not None  # checked in run()
        env, log_path = None, None
        if isinstance(agent, list):  # a command agent: directory, turn limit, reaper tag
            cwd = cwd or (agent_cfg.cwd if agent_cfg is not None else None)
            env = {"FORGERL_MAX_TURNS": str(agent_cfg.max_turns if agent_cfg else 1),
                   "FORGERL_MAX_TOKENS": str(cfg.rollout.max_tokens),
                   "OPENAI_MODEL": cfg.gateway.model_name,
                   "FORGERL_SESSION_ID": self.gateway.sessions.get(api_key).trajectory_id,
                   **(self.reaper.env() if self.reaper else {}), **(episode_env or {})}
            log_path = self.run_dir / "agent_logs" / f"{log_name}.log"
        own = None  # `[sandbox] agents`: this rollout's own sandbox, closed with its episode
        if sandbox is None and isinstance(agent, list) and cfg.sandbox.agents:
            try:
                sandbox = own = await open_sandbox(
                    cfg.sandbox, self.run_dir / "sandboxes" / log_name, self.server.port)
            except SandboxError as e:
                return "aborted_infra", None, f"infrastructure: sandbox: {e}"
        if sandbox is not None and isinstance(agent, list) and agent_cfg and agent_cfg.cwd:
            here = [os.path.join(agent_cfg.cwd, a) for a in agent]  # it starts elsewhere
            agent = [h if os.path.isfile(h) else a for a, h in zip(agent, here, strict=True)]
        preload = preload_of(agent, agent_cfg)
        forkserver = (await self.forkserver(preload, env or {})
                      if preload and sandbox is None else None)  # a fork is not in the sandbox
        task = {"question": task["question"]}  # the agent never sees the reference answer
        try:
            result = await run_agent(agent, task, self.server.base_url, api_key,
                                     cfg.rollout.timeout_s, cwd=cwd, env=env, log_path=log_path,
                                     forkserver=forkserver, sandbox=sandbox)
        finally:
            if own is not None:
                await own.close()
        if result.status == "finished":
            return result.status, result.answer, None
        code = "" if result.returncode is None else f" (exit code {result.returncode})"
        tail = result.stderr_tail[-2000:]
        error = f"agent {result.status}{code}" + (f"\n{tail}" if tail else "")
        cause = infra_cause(result, session.engine_errors if session is not None else 0)
        if cause is not None:  # the machinery ended it, not the policy (CASES.md C24)
            return "aborted_infra", result.answer, f"infrastructure: {cause}; {error}"
        return result.status, result.answer, error

    async def run_episode(self, environment: Environment, task: dict, api_key: str,
                          log_name: str, session: Session
                          ) -> tuple[str, float, list[float] | None, str | None]:
        """One episode of an environment (`forgerl.tasks.episode.run_episode`): (status,
        reward, turn_rewards, error); its environment seconds add to `env_seconds`, its
        verifier's status (Harbor's tests) to `reward_status`; a `sandboxed` environment's
        sandbox is RUN_DIR/sandboxes/`log_name`."""
        cfg = self.config

        async def command(episode: Episode, sandbox: Sandbox | None
                          ) -> tuple[str, str | None, str | None]:
            cwd = None if episode.workdir is None else str(episode.workdir)
            return await self.run_agent(task, api_key, log_name, session, cwd=cwd,
                                        episode_env=episode.env, sandbox=sandbox)

        out = await run_episode(environment, task, play=functools.partial(
            play, base_url=self.server.base_url, api_key=api_key, model=cfg.gateway.model_name,
            max_turns=self.agent_turns(task), max_tokens=cfg.rollout.max_tokens,
            timeout_s=cfg.rollout.timeout_s), command=command, turns=lambda: len(session.turns),
            sandbox_at=self.run_dir / "sandboxes" / log_name, gateway_port=self.server.port,
            sandbox_cfg=cfg.sandbox, timeout_s=cfg.rollout.timeout_s)
        self.env_seconds += out.env_seconds
        if out.verifier is not None:
            self.reward_status[f"verifier_{out.verifier}"] += 1
        return out.status, out.reward, out.turn_rewards, out.error

    def agent_turns(self, task: dict) -> int:
        """Model calls an episode may make: its agent section's max_turns (default 8 for the
        built-in tool agent)."""
        _, agent_cfg = self.agent_for(task)
        return agent_cfg.max_turns if agent_cfg is not None else 8

    async def forkserver(self, preload: tuple[str, ...], env: dict[str, str]) -> Any:
        """The run's ForkServer for `preload` (started at the run's start, else now, with this
        environment plus `env`: the reaper's tag); None (agents are exec'd) when it cannot."""
        if preload not in self.forkservers:
            self.forkservers[preload] = start_forkserver(preload, env)
        return await asyncio.shield(self.forkservers[preload])

    async def rollout(self, task_index: int, rollout_index: int, task: dict,
                      temperature: float) -> float:
        """Run one rollout, score it, and finish its trajectory in the pool; returns the reward.

        A cancelled rollout (Ctrl-C, shutdown) is marked aborted and re-run on resume; a timed-out
        one is failed (kept out of the loss) or, with `rollout.on_timeout = "redispatch"`,
        aborted so that `rollout_group` runs it again; one whose session recorded no model call
        is failed with error `NO_CALL`, never scored (nothing to train); one that the machinery
        ended (`runner.infra_cause`: SIGKILL from outside, the engine failing) is
        "aborted_infra": stored, never trained, no member of its group's baseline.
        """
        trajectory_id, api_key = self.gateway.open_session(
            task_index, rollout_index, temperature=temperature,
            max_tokens=self.config.rollout.max_tokens,
            seed=rollout_seed(self.config.seed, task_index, rollout_index),
        )
        session = self.gateway.sessions.get(api_key)
        start = time.time()
        name = (f"task{task_index:06d}_r{rollout_index}" if task_index >= 0
                else f"eval{-1 - task_index:04d}")
        environment = self.environments.get(task.get("domain", ""))
        try:
            if environment is not None:
                status, reward, turn_rewards, error = await self.run_episode(
                    environment, task, api_key, name, session)
            else:
                status, answer, error = await self.run_agent(task, api_key, name, session)
        except asyncio.CancelledError:
            self.pool.finish_trajectory(trajectory_id, "aborted", error="cancelled")
            raise
        finally:
            self.gateway.sessions.close(api_key)
        if task_index >= 0:
            self.rollout_seconds.setdefault(task_index, []).append(time.time() - start)
        if status == "finished" and not session.turns:
            status, error = f"failed: {NO_CALL}", NO_CALL
        if status == "finished":
            if environment is None:
                reward, turn_rewards = await self.score(task, answer), None
            try:
                reward, policy_rewards = self.policy_rewards(reward)
            except ValueError as e:  # failed, with the reason: never a silent drop
                status, error = "failed", str(e)
            else:
                self.pool.finish_trajectory(trajectory_id, "finished", reward=reward,
                                            turn_rewards=turn_rewards,
                                            policy_rewards=policy_rewards)
                return reward
        redispatch = status == "timeout" and self.config.rollout.on_timeout == "redispatch"
        final = status if status == "aborted_infra" else ("aborted" if redispatch else "failed")
        self.pool.finish_trajectory(trajectory_id, final, error=error or status)
        command = isinstance(self.agent_for(task)[0], list)  # only commands have a log file
        where = f"; agent log agent_logs/{name}.log" if command else ""
        what = (f"rollout {rollout_index} of task {task_index}" if task_index >= 0
                else f"held-out task {-1 - task_index}")
        log.warning("%s (session %s) %s%s%s", what, trajectory_id, status,
                    ", re-dispatched" if redispatch else "", where)
        return 0.0

    def policy_rewards(self, reward: float | dict[str, float]
                       ) -> tuple[float, dict[str, float] | None]:
        """(the trajectory's reward, its per-policy rewards) of a score: a dict (one reward per
        [[policies]] name) gives the first policy's as the trajectory's reward (0.0 when it
        has none). Raises ValueError for a name that is no policy of the run."""
        if not isinstance(reward, dict):
            return reward, None
        names = [p.name for p in self.config.policies] or [self.config.gateway.model_name]
        if unknown := sorted(set(reward) - set(names)):
            raise ValueError(f"the episode rewarded {unknown[0]!r}, which is no policy of "
                             f"this run ({', '.join(names)})")
        return reward.get(names[0], 0.0), reward

    async def score(self, task: dict, answer: str | None) -> float | dict[str, float]:
        """reasoning-gym's scorer in a child process with a timeout (CASES.md C13)."""
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
        first = self.config.gateway.model_name  # the run's step is its weight version
        versions = [v for t in group.trajectories for c in t.completions
                    if c.policy in ("", first) for v in c.weight_versions]
        self.scheduler.on_group_finished(task_index,
                                         min(versions, default=self.engine.weight_version))
        self.group_done.set()
        self.admit()  # its generation slot is free (`scheduler.max_in_flight`)

    def admit(self) -> None:
        """Start the rollouts of every task the scheduler admits now (concurrency cap, lag
        bound, within `run` no more untrained tasks than the steps left can train), stamped with
        the engine's weight_version: between a step and its weight sync the engine still serves
        the previous version."""
        if self.closing:
            return
        left = None if self.max_steps is None else max(
            0, (self.max_steps - self.trainer.step) * self.config.rollout.tasks_per_step)
        for task_index in self.scheduler.admit(self.engine.weight_version, left):
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

    def rollout_stats(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """`metrics.rollout_stats` of these rollouts, decoded and parsed by the gateway's
        renderer (its configured tool-call format)."""
        renderer = self.gateway.renderer
        return rollout_stats(trajectories, renderer.decode, renderer.parser.parse)

    def domain_of(self, task_index: int) -> str:
        """The [[domains]] name of a training task ("" without domains)."""
        return self.tasks[task_index % len(self.tasks)].get("domain", "")

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

    async def evaluate(self) -> dict[str, float]:
        """Held-out accuracy: each eval task once, greedy (temperature 0), concurrently
        ([tasks] eval_concurrency at most).

        eval_accuracy = fraction of tasks with reward >= 1 (and `domain_<name>_eval_accuracy`
        per [[domains]] domain), eval_reward_mean, eval_seconds (wall time of the evaluation),
        and the tool-call rate, parallel-call rate and model calls per rollout of these rollouts
        (`rollout_stats`) and their mean wall-clock seconds, eval_rollout_seconds; {} without
        held-out tasks."""
        if not self.eval_tasks:
            return {}
        start, limit = time.time(), self.config.tasks.eval_concurrency or len(self.eval_tasks)
        gate = asyncio.Semaphore(limit)

        async def one(i: int, task: dict) -> float:
            async with gate:
                return await self.rollout(-1 - i, 0, task, temperature=0.0)

        rewards = await asyncio.gather(*(one(i, t) for i, t in enumerate(self.eval_tasks)))
        n = len(rewards)
        # each held-out task's newest trajectory: earlier evaluations share its task index
        trajs = [self.pool.get_group(-1 - i).trajectories[-1] for i in range(n)]
        stats = self.rollout_stats(trajs)
        by_domain: dict[str, list[float]] = {}
        for task, r in zip(self.eval_tasks, rewards, strict=True):
            if "domain" in task:
                by_domain.setdefault(task["domain"], []).append(r)
        return {**{f"domain_{d}_eval_accuracy": sum(r >= 1.0 for r in rs) / len(rs)
                   for d, rs in by_domain.items()},
                "eval_accuracy": sum(r >= 1.0 for r in rewards) / n,
                "eval_reward_mean": sum(rewards) / n, "eval_seconds": time.time() - start,
                "eval_tool_call_rate": stats["tool_call_rate"],
                "eval_parallel_call_rate": stats["parallel_call_rate"],
                "eval_rollout_seconds": sum(map(duration_s, trajs)) / n,
                "eval_turns_per_trajectory": stats["turns_per_trajectory"]}


def _duration_stats(name: str, seconds: list[float]) -> dict[str, float]:
    """Mean and p90 (nearest rank) of durations in seconds; empty → {}."""
    if not seconds:
        return {}
    ordered = sorted(seconds)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {f"{name}_mean": sum(ordered) / len(ordered), f"{name}_p90": p90}


def preload_of(agent: Agent | list[str] | None, agent_cfg: AgentConfig | None) -> tuple[str, ...]:
    """What a Python script agent's fork server imports: `[agent] preload`, else the packages
    the script imports at its top level (`script_imports`); () for any other agent."""
    if not (isinstance(agent, list) and agent_cfg is not None and agent[0] == sys.executable
            and len(agent) > 1 and agent[1][:1] != "-"):
        return ()
    return tuple(agent_cfg.preload if agent_cfg.preload is not None else script_imports(
        os.path.join(agent_cfg.cwd or os.getcwd(), agent[1])))


def start_forkserver(preload: tuple[str, ...], env: dict[str, str]) -> asyncio.Future:
    """Start an agent ForkServer importing `preload` (forgerl/agents/forkserver.py) with this
    environment plus `env`; its future gives None, with a warning, when it cannot start."""
    async def start() -> ForkServer | None:
        try:
            return await ForkServer.start(list(preload), {**os.environ, **env})
        except OSError as exc:
            log.warning("%s; agents start as plain processes", exc)
            return None

    return asyncio.ensure_future(start())


def check_agent_command(agent: AgentConfig | None) -> None:
    """Raise ConfigError (`agent.command`) when the agent cannot start: a "python" command's
    script is not a file in the agent's directory, or its program is not an executable (a
    path relative to that directory, else a name on PATH). Nothing to check for None."""
    if agent is None or agent.command is None:
        return
    cwd, (program, *args) = agent.cwd or os.getcwd(), agent.command
    if program in ("python", "python3"):
        if args and not args[0].startswith("-") and not os.path.isfile(os.path.join(cwd, args[0])):
            raise ConfigError(f"agent.command: script {args[0]!r} not found in {cwd}")
    elif not shutil.which(os.path.join(cwd, program) if os.sep in program else program):
        raise ConfigError(f"agent.command: {program!r} is not an executable "
                          f"{'in ' + cwd if os.sep in program else 'on PATH'}")


def agent_command(agent: AgentConfig) -> list[str]:
    """The agent's command, a leading "python" replaced by this interpreter."""
    command = list(agent.command or ())
    return [sys.executable, *command[1:]] if command[0] in ("python", "python3") else command


def rollout_seed(seed: int, task_index: int, rollout_index: int) -> int:
    """The sampling seed of one rollout's session, in [0, 2**63): a hash of the run's `seed`,
    the task's queue index and the rollout's index, so a re-run rollout replays its seeds."""
    digest = hashlib.blake2b(f"{seed}/{task_index}/{rollout_index}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1
