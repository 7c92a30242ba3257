"""Gymnasium text environments (`gymnasium` package, the `gymnasium` extra): `[tasks] env` is a
registered environment id (`gymnasium.make`; "pkg.module:Name-v0" imports pkg.module first),
`params` are make's keyword arguments, except `module`: a module (dotted name, or a .py file
relative to `base_dir`) imported first so that it can call `gymnasium.register`.

    task            ─► a reset seed
    reset(seed) obs ─► the prompt (a user message)
    tool `step`     ─► env.step(action): the action is a string (Text space) or an integer
                       (Discrete space), checked against the action space
    step reward     ─► a process reward on that turn; terminated or truncated ─► finished, and
                       that step's reward is the outcome
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import gymnasium
from gymnasium import spaces

from forgerl.tasks.base import Environment, EnvironmentError, Episode, Step

TOOL = "step"


class Adapter(Environment):
    standard = "gymnasium"

    def __init__(self, location: str, params: dict[str, Any], base_dir: Path,
                 python: str | None = None) -> None:
        super().__init__(location, params, base_dir, python)
        self.kwargs = {k: v for k, v in params.items() if k != "module"}
        self.loaded = False

    def tasks(self, split, size, seed):
        env = self._make()
        try:
            out = []
            for s in range(seed, seed + size):
                obs, _ = env.reset(seed=s)
                out.append({"question": f"{self.location} seed {s}: {_text(obs)}", "seed": s})
            return out
        finally:
            env.close()

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    async def open(self, task, sandbox=None):
        try:
            env = await asyncio.to_thread(self._make)
            obs, _ = await asyncio.to_thread(env.reset, seed=int(task["seed"]))
        except Exception as e:  # the environment's own code failed: not the policy's doing
            raise EnvironmentError(f"{self.location} reset: {type(e).__name__}: {e}") from e
        return GymEpisode(prompt=[{"role": "user", "content": _text(obs)}],
                          tools=[_tool(env.action_space)], env=env)

    def _load(self) -> None:
        """Import `params.module` once (it registers the environment)."""
        module = self.params.get("module")
        if self.loaded or not module:
            self.loaded = True
            return
        path = Path(module) if module.endswith(".py") else None
        if path is not None:
            path = path if path.is_absolute() else self.base_dir / path
            if not path.is_file():
                raise ValueError(f"params.module: no file {path}")
            spec = importlib.util.spec_from_file_location(f"forgerl_gym_{path.stem}", path)
            assert spec is not None and spec.loader is not None
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        else:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ValueError(f"params.module: cannot import {module!r}: {e}") from None
        self.loaded = True

    def _make(self) -> gymnasium.Env:
        """A new environment; a ValueError (a ConfigError at the CLI) names what is wrong."""
        self._load()
        try:
            env = gymnasium.make(self.location, **self.kwargs)
        except gymnasium.error.Error as e:
            raise ValueError(f"gymnasium cannot make {self.location!r}: {e}") from None
        _tool(env.action_space)
        return env


class GymEpisode(Episode):
    """One environment instance, reset to the task's seed; `step` is its only tool."""

    def __init__(self, prompt: list[dict[str, Any]], tools: list[dict[str, Any]],
                 env: gymnasium.Env) -> None:
        super().__init__(prompt=prompt, tools=tools)
        self.env, self.done = env, False

    async def call(self, name, arguments):
        if name != TOOL:
            return await super().call(name, arguments)
        if self.done:
            return Step("error: the episode has ended", finished=True)
        action, error = _action(self.env.action_space, arguments.get("action"))
        if error:
            return Step(f"error: {error}")
        obs, reward, terminated, truncated, _ = await asyncio.to_thread(self.env.step, action)
        self.done = bool(terminated or truncated)
        return Step(_text(obs), float(reward), self.done)

    async def close(self):
        await asyncio.to_thread(self.env.close)


def _tool(space: spaces.Space) -> dict[str, Any]:
    """The `step` tool of `space`; ValueError for spaces other than Text and Discrete."""
    if isinstance(space, spaces.Discrete):
        lo, hi = int(space.start), int(space.start + space.n - 1)
        action = {"type": "integer", "minimum": lo, "maximum": hi,
                  "description": f"the action, an integer from {lo} to {hi}"}
    elif isinstance(space, spaces.Text):
        action = {"type": "string", "minLength": space.min_length,
                  "maxLength": space.max_length, "description": "the action, as text"}
    else:
        raise ValueError(f"gymnasium action space {space} is not supported (Text or Discrete)")
    return {"type": "function", "function": {
        "name": TOOL, "description": "Take one action in the environment; returns the next "
        "observation.", "parameters": {"type": "object", "properties": {"action": action},
                                       "required": ["action"]}}}


def _action(space: spaces.Space, value: Any) -> tuple[Any, str | None]:
    """(the action, None) when `value` is in `space`, else (None, what is wrong)."""
    if isinstance(space, spaces.Discrete):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            return None, f"action must be an integer, not {json.dumps(value)}"
        hi = int(space.start + space.n - 1)
        if not space.contains(value):
            return None, f"action {value} is not in {int(space.start)}..{hi}"
        return value, None
    if not isinstance(value, str):
        return None, f"action must be a string, not {json.dumps(value)}"
    if not space.contains(value):
        return None, (f"action {value!r} is not in the action space (length "
                      f"{space.min_length}..{space.max_length}, characters {space.characters!r})")
    return value, None


def _text(obs: Any) -> str:
    """An observation as text: a string as is, anything else as JSON (numpy as lists)."""
    if isinstance(obs, str):
        return obs
    return json.dumps(obs, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
