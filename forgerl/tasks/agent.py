"""The built-in tool agent: the white-box loop that plays an environment's episode through the
gateway, for environments whose tools the agent calls (ORS, OpenEnv, verifiers, NeMo-Gym,
Gymnasium).

    messages = episode.prompt
    repeat up to max_turns:  POST /v1/chat/completions {messages, tools}  (one recorded turn)
        no tool call ─► the reply's text is the answer; stop
        each tool call ─► episode.call(name, args) ─► a tool message; `finished` ─► stop

It is an ordinary OpenAI client of the gateway (one session, one API key), so its turns are
recorded token-exactly like any agent's. Tool-call arguments that are not a JSON object are the
policy's mistake: the tool message says so and the environment is not called.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from forgerl.tasks.base import EnvironmentError, Episode


@dataclass
class EpisodeResult:
    """What the tool agent played.

    status: "finished" (the model answered without a tool call, or the environment sent
        `finished`), "failed" (a model call was refused, e.g. the context is full) or
        "max_turns" (out of turns: scored like a finished episode).
    answer: the last reply's text (None when it had none).
    call_rewards: (turn, reward) of each tool call that returned a reward, the turn being the
        0-based index of the model call that made it; the `finished` Step's reward is not
        among them (it is `Episode.final_reward`, the outcome).
    messages: the conversation, prompt first.
    env_seconds: wall-clock seconds in `episode.call`.
    error: why a "failed" episode failed (the gateway's error message).
    """

    status: str = "finished"
    answer: str | None = None
    call_rewards: list[tuple[int, float]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    env_seconds: float = 0.0
    error: str | None = None


async def play(episode: Episode, base_url: str, api_key: str, model: str, max_turns: int,
               max_tokens: int | None = None, timeout_s: float = 600.0) -> EpisodeResult:
    """Play `episode` through the gateway at `base_url` (ending in /v1) with session `api_key`.

    Raises EnvironmentError from `episode.call` (infrastructure); a model call the gateway
    refuses, or one that gets no answer in `timeout_s` (httpx's per-request timeout), ends the
    episode as "failed" with the reason.
    """
    out = EpisodeResult(messages=[dict(m) for m in episode.prompt])
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s) as http:
        for turn in range(max_turns):
            body: dict[str, Any] = {"model": model, "messages": out.messages}
            if episode.tools:
                body["tools"] = episode.tools
            if max_tokens is not None:
                body["max_tokens"] = max_tokens
            try:
                reply = await http.post("/chat/completions", json=body)
            except httpx.TransportError as e:  # a timeout or a dropped connection: no answer
                out.status, out.error = "failed", f"model call: {type(e).__name__}: {e}"
                return out
            if reply.status_code != 200:
                out.status, out.error = "failed", _error_text(reply)
                return out
            message = reply.json()["choices"][0]["message"]
            out.messages.append({k: v for k, v in message.items() if v is not None})
            out.answer = message.get("content")
            calls = message.get("tool_calls") or []
            if not calls:
                return out
            for call in calls:
                step_content, finished = await _run_call(episode, call, turn, out)
                out.messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": step_content})
                if finished:
                    return out
    out.status = "max_turns"
    return out


async def _run_call(episode: Episode, call: dict[str, Any], turn: int,
                    out: EpisodeResult) -> tuple[str, bool]:
    """One tool call of `turn` against the environment: (tool message text, finished)."""
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError as e:
        return f"error: the arguments are not JSON ({e.msg})", False
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object", False
    start = time.monotonic()
    try:
        step = await episode.call(function.get("name", ""), arguments)
    except EnvironmentError:
        raise
    except Exception as e:  # the environment's own code failed on this call: its fault, said
        raise EnvironmentError(f"tool {function.get('name')!r}: {type(e).__name__}: {e}") from e
    finally:
        out.env_seconds += time.monotonic() - start
    if step.finished:
        episode.final_reward = step.reward
    elif step.reward is not None:
        out.call_rewards.append((turn, float(step.reward)))
    return step.content, step.finished


def _error_text(reply: httpx.Response) -> str:
    """The gateway's error message (OpenAI or Anthropic shape), else the body's start."""
    try:
        error = reply.json().get("error", {})
        return f"{reply.status_code} {error.get('message') or error}"
    except (ValueError, AttributeError):
        return f"{reply.status_code} {reply.text[:300]}"
