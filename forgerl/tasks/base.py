"""The task-source seam: one `Environment` per standard (Harbor, ORS, OpenEnv, verifiers,
NeMo-Gym, Gymnasium), each built on the standard's own package, turning its tasks into ForgeRL
tasks, its tools into tools the agent calls through the gateway and its verifier into the reward.
reasoning-gym datasets and task files keep their own path (`forgerl.rewards.reasoning_gym`).

    Environment.tasks(split, size, seed) ─► task dicts (JSON-safe; the data pool stores them)
    Environment.open(task, sandbox) ─► Episode: prompt, tools, call(name, args) ─► Step, score

Rewards: a Step's `reward` is a process reward on the turn whose tool call produced it, except
the reward that comes with `finished`, which is the episode's outcome (the environment's return
at the end), unless the episode has its own verifier (`Episode.score`: Harbor's tests, a
verifiers rubric). A `finished` Step ends the rollout. An `EnvironmentError` raised by `open`,
`call` or `score` is an infrastructure failure (environment server unreachable, worker died,
sandbox gone): the rollout is "aborted_infra", stored and never trained or used as a baseline; a
task's own failure is a reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

Split = Literal["train", "eval"]


class EnvironmentError(RuntimeError):
    """The environment's infrastructure failed (not the policy): the rollout is aborted_infra."""


@dataclass(frozen=True)
class Step:
    """The environment's answer to one tool call.

    content: the tool message the model sees next (text).
    reward: a per-call reward (None: none given); see the module docstring for where it goes.
    finished: the environment ended the episode; no further model call is made.
    """

    content: str
    reward: float | None = None
    finished: bool = False


@dataclass
class Episode:
    """One rollout's live environment. Adapters subclass it (or fill it) and override `call`,
    `score` and `close` as their standard needs.

    prompt: the chat messages that open the episode (OpenAI chat format, roles system/user).
    tools: OpenAI function tools, `{"type": "function", "function": {"name", "description",
        "parameters"}}`; [] for an environment without tools (a command agent works in
        `workdir`, e.g. Harbor).
    workdir: the directory a command agent runs in (inside the rollout's sandbox), or None.
    env: environment variables a command agent runs with (the task's own).
    final_reward: the reward of the `finished` Step, once one came.
    verifier_status: how the episode's own verifier ended ("ok", "timeout", "error"), set by
        `score` where the episode has one (Harbor's tests); None otherwise.
    """

    prompt: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    workdir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    final_reward: float | None = None
    verifier_status: str | None = None

    async def call(self, name: str, arguments: dict[str, Any]) -> Step:
        """Run tool `name` with JSON `arguments`. An unknown tool or bad arguments is the
        policy's mistake: answer a Step whose content says so (no exception). Raises
        EnvironmentError only for infrastructure failures."""
        return Step(f"error: this environment has no tool {name!r}")

    async def score(self, answer: str | None, messages: list[dict[str, Any]]) -> float:
        """The outcome reward of the finished episode: the `finished` Step's reward, else 0.0.
        `answer`: the agent's final text; `messages`: the whole conversation (the tool agent's;
        [] for a command agent)."""
        return self.final_reward if self.final_reward is not None else 0.0

    async def close(self) -> None:
        """Release the episode (end a session on the environment server, stop a container)."""


class Environment:
    """A task source of one standard. Subclasses set `standard` and implement `tasks` and
    `open`; `start` / `stop` bracket a run (servers, workers, connections).

    `location` and `params` are `[tasks] env` and `[tasks] params`; `base_dir` is the config
    file's directory (relative paths resolve against it); `python` the interpreter of the
    standard's own venv where it cannot install beside ForgeRL (`[tasks] python`)."""

    standard: ClassVar[str] = ""
    agent: ClassVar[str] = "tools"
    """Who plays an episode: "tools", the built-in tool agent (forgerl/tasks/agent.py; the
    episode's tools); "command", the run's [agent] command in the episode's workdir (Harbor)."""
    sandboxed: ClassVar[bool] = False
    """Episodes need a Sandbox (their tool and test processes run on this machine)."""
    params_known: ClassVar[tuple[str, ...] | None] = None
    """The `[tasks] params` keys the adapter reads (any other is a config error: a typo must
    not be silently ignored); None: params pass on to the environment, which checks them."""

    def __init__(self, location: str, params: dict[str, Any], base_dir: Path,
                 python: str | None = None) -> None:
        self.location, self.params, self.base_dir, self.python = location, params, base_dir, python

    def tasks(self, split: Split, size: int, seed: int) -> list[dict[str, Any]]:
        """Up to `size` tasks of `split`, deterministic in `seed`; JSON-safe dicts, each with a
        "question" (the task's prompt text: logs and the train/held-out overlap check use it).
        Runs in a child process at the run's start (nothing of `start` is available)."""
        raise NotImplementedError

    def mounts(self, task: dict[str, Any]) -> list[str]:
        """Absolute paths inside the rollout's sandbox that are the rollout's own (each a
        directory under the sandbox's workdir, bind-mounted there) when `sandboxed`."""
        return []

    async def start(self) -> None:
        """Connect, start servers or workers; before the first `open`."""

    async def open(self, task: dict[str, Any], sandbox: Any = None) -> Episode:
        """A new episode of `task` (reset the environment). `sandbox`: the rollout's
        `forgerl.agents.sandbox.Sandbox` when `sandboxed`, else None. Raises
        EnvironmentError when the environment cannot be reached."""
        raise NotImplementedError

    async def stop(self) -> None:
        """Stop what `start` started; idempotent."""

