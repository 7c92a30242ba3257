"""The guess_env servers (OpenEnv's `create_app`), run under the venv that has `openenv`.

GuessEnvironment (MCP): reset(seed, max_tries=2) sets the secret to a + b with a, b from the
seed and says so in the prompt; the `guess(n)` tool answers "correct", "higher" or "lower". Each
wrong guess that leaves tries rewards -0.1; the episode is done at the right guess (reward 1.0)
or when the tries are used up (reward 0.0).

EchoEnvironment (plain actions): each `EchoAction(message)` is echoed back with reward
len(message) / 10; done when the message is "bye" (reward 1.0).
"""

from __future__ import annotations

from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State


class GuessObservation(Observation):
    prompt: str = ""


class GuessEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("guess")

        @mcp.tool()
        def guess(n: int) -> str:
            """Guess the secret number."""
            self._tries += 1
            self._last = n
            return "correct" if n == self._secret else ("higher" if n < self._secret else "lower")

        super().__init__(mcp)
        self._secret, self._tries, self._max, self._last = 0, 0, 2, None
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, max_tries: int = 2,
              **kwargs: Any) -> GuessObservation:
        a, b = (seed or 0) % 7, (seed or 0) // 7 % 5
        self._secret, self._tries, self._max, self._last = a + b, 0, max_tries, None
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=f"Find the secret number: it is {a} + {b}. You have "
                                       f"{max_tries} guesses.")

    async def step_async(self, action: Action, timeout_s: float | None = None,
                         **kwargs: Any) -> Observation:
        self._state.step_count += 1
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and obs.error is None:
            right = self._last == self._secret
            obs.done = right or self._tries >= self._max
            obs.reward = 1.0 if right else (0.0 if obs.done else -0.1)
        return obs

    def _step_impl(self, action: Action, timeout_s: float | None = None,
                   **kwargs: Any) -> Observation:
        return GuessObservation(prompt="only MCP tool calls are understood")

    @property
    def state(self) -> State:
        return self._state


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed: str = ""


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(echoed=f"Say something (seed {seed}), then say bye.")

    def step(self, action: EchoAction, timeout_s: float | None = None,
             **kwargs: Any) -> EchoObservation:
        self._state.step_count += 1
        done = action.message == "bye"
        reward = 1.0 if done else len(action.message) / 10
        return EchoObservation(echoed=action.message, done=done, reward=reward)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, CallToolAction, CallToolObservation, env_name="guess_env",
                 max_concurrent_envs=64)
echo_app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env",
                      max_concurrent_envs=64)
