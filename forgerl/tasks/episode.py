"""One rollout of an environment: open the episode, let the built-in tool agent or the run's
command agent play it, score it, close it; per-call rewards become process rewards on the turn
that made the call (forgerl/tasks/base.py has the reward rules)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
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
    runner's). An EnvironmentError or SandboxError anywhere makes the rollout "aborted_infra"
    (stored, never trained)."""
    spent = [0.0]  # seconds in the environment: open, tool calls, score, close (every path)
    out, call_rewards = await _play(environment, task, play, command, sandbox_at, gateway_port,
                                    sandbox_cfg, timeout_s, spent)
    n = turns()
    if not call_rewards or n == 0:
        return replace(out, env_seconds=spent[0])
    turn_rewards = [0.0] * n
    for turn, value in call_rewards:
        turn_rewards[min(turn, n - 1)] += value
    return replace(out, turn_rewards=turn_rewards, env_seconds=spent[0])


async def _play(environment: Environment, task: dict,
                play: Callable[[Episode], Awaitable[EpisodeResult]],
                command: Callable[..., Awaitable[tuple[str, str | None, str | None]]],
                sandbox_at: Path | None, gateway_port: int | None,
                sandbox_cfg: SandboxConfig | None, timeout_s: float | None,
                spent: list[float]) -> tuple[Outcome, list[tuple[int, float]] | None]:
    """`run_episode`'s episode, and the tool agent's (turn, reward) pairs of a finished one
    (None otherwise). Environment seconds add to `spent[0]`."""
    episode, sandbox, start = None, None, time.monotonic()
    try:
        if environment.sandboxed:
            assert sandbox_at is not None
            mounts = {m: sandbox_at / "fs" / m.strip("/") for m in environment.mounts(task)}
            sandbox = await open_sandbox(sandbox_cfg or SandboxConfig(), sandbox_at,
                                         gateway_port, mounts)
        episode = await environment.open(task, sandbox)
        spent[0] += time.monotonic() - start
        if environment.agent == "tools":
            try:
                async with asyncio.timeout(timeout_s):
                    played = await play(episode)
            except TimeoutError:
                return Outcome("timeout", error=f"episode timed out after {timeout_s} s"), None
            spent[0] += played.env_seconds
            if played.status == "failed":
                return Outcome("failed", error=f"agent failed: {played.error}"), None
            answer, messages, calls = played.answer, played.messages, played.call_rewards
        else:
            status, answer, error = await command(episode, sandbox)
            if status != "finished":
                return Outcome(status, error=error), None
            messages, calls = [], None
        scoring = time.monotonic()
        reward = float(await episode.score(answer, messages))
        spent[0] += time.monotonic() - scoring
        return Outcome("finished", reward, verifier=episode.verifier_status), calls
    except (EnvironmentError, SandboxError) as e:
        what = "environment" if isinstance(e, EnvironmentError) else "sandbox"
        return Outcome("aborted_infra", error=f"infrastructure: {what} {e}"), None
    finally:
        closing = time.monotonic()
        with contextlib.suppress(Exception):  # a failed close loses nothing recorded
            if episode is not None:
                await episode.close()
        if sandbox is not None:
            await sandbox.close()
        spent[0] += time.monotonic() - closing
