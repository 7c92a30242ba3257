"""One rollout of an environment: open the episode, let the built-in tool agent or the run's
command agent play it, score it, close it; per-call rewards become process rewards on the turn
that made the call (forgerl/tasks/base.py has the reward rules)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from forgerl.agents.sandbox import Sandbox, SandboxError
from forgerl.config import SandboxConfig
from forgerl.tasks.agent import EpisodeResult
from forgerl.tasks.base import Environment, EnvironmentError, Episode


@dataclass(frozen=True)
class Outcome:
    """status: "finished", "failed", "timeout" or "aborted_infra"; reward: the outcome reward
    (0.0 unless finished); turn_rewards: per recorded turn, or None without per-call rewards;
    error: why it did not finish; env_seconds: open + tool calls + score + close;
    verifier: how the episode's own verifier ended ("ok", "timeout", "error"), where it has
    one (Harbor's tests)."""

    status: str
    reward: float = 0.0
    turn_rewards: list[float] | None = None
    error: str | None = None
    env_seconds: float = 0.0
    verifier: str | None = None


async def open_sandbox(cfg: SandboxConfig, at: Path, gateway_port: int | None,
                       mounts: dict[str, Path] | None = None) -> Sandbox:
    """A rollout's sandbox at `at` under `[sandbox]` `cfg`, reaching the gateway on
    `gateway_port`; raises SandboxError when it cannot be made."""
    return await Sandbox.open(at.parent, at.name, cfg.limits(), gateway_port=gateway_port,
                              mounts=mounts, network=cfg.network, isolation=cfg.isolation)


async def run_episode(
    environment: Environment, task: dict,
    play: Callable[[Episode], Awaitable[EpisodeResult]],
    command: Callable[[Episode, Sandbox | None], Awaitable[tuple[str, str | None, str | None]]],
    turns: Callable[[], int], sandbox_at: Path | None = None, gateway_port: int | None = None,
    sandbox_cfg: SandboxConfig | None = None, timeout_s: float | None = None,
) -> Outcome:
    """Play one episode of `task`. `play(episode)`: the built-in tool agent (environments whose
    `agent` is "tools"); `command(episode, sandbox)`: the run's command agent in the episode's
    workdir with its env (inside the sandbox), as (status, answer, error); `turns()`: the turns
    the session recorded, to place per-call rewards (the k-th model call is the k-th turn). A
    `sandboxed` environment's episode gets a Sandbox at `sandbox_at` (its mounts, reaching the
    gateway on `gateway_port`, `sandbox_cfg`'s limits and isolation), closed after it;
    `timeout_s`: the tool agent's whole episode (status "timeout"; a command agent has the
    runner's). An
    EnvironmentError or SandboxError anywhere makes the rollout "aborted_infra" (stored, never
    trained)."""
    episode, env_s, played, sandbox = None, 0.0, None, None
    start = time.monotonic()
    try:
        if environment.sandboxed:
            assert sandbox_at is not None
            mounts = {m: sandbox_at / "fs" / m.strip("/") for m in environment.mounts(task)}
            sandbox = await open_sandbox(sandbox_cfg or SandboxConfig(), sandbox_at,
                                         gateway_port, mounts)
        episode = await environment.open(task, sandbox)
        env_s += time.monotonic() - start
        if environment.agent == "tools":
            try:
                async with asyncio.timeout(timeout_s):
                    played = await play(episode)
            except TimeoutError:
                return Outcome("timeout", error=f"episode timed out after {timeout_s} s",
                               env_seconds=env_s)
            env_s += played.env_seconds
            if played.status == "failed":
                return Outcome("failed", error=f"agent failed: {played.error}", env_seconds=env_s)
            answer, messages = played.answer, played.messages
        else:
            status, answer, error = await command(episode, sandbox)
            if status != "finished":
                return Outcome(status, error=error, env_seconds=env_s)
            messages = []
        scoring = time.monotonic()
        reward = float(await episode.score(answer, messages))
        env_s += time.monotonic() - scoring
        verifier = getattr(episode, "verifier_status", None)
    except (EnvironmentError, SandboxError) as e:
        what = "environment" if isinstance(e, EnvironmentError) else "sandbox"
        return Outcome("aborted_infra", error=f"infrastructure: {what} {e}", env_seconds=env_s)
    finally:
        closing = time.monotonic()
        with contextlib.suppress(Exception):  # a failed close loses nothing recorded
            if episode is not None:
                await episode.close()
        if sandbox is not None:
            await sandbox.close()
        env_s += time.monotonic() - closing
    n = turns()
    if played is None or not played.call_rewards or n == 0:
        return Outcome("finished", reward, env_seconds=env_s, verifier=verifier)
    turn_rewards = [0.0] * n
    for turn, value in played.call_rewards:
        turn_rewards[min(turn, n - 1)] += value
    return Outcome("finished", reward, turn_rewards, env_seconds=env_s, verifier=verifier)
