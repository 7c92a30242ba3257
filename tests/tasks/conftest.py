"""Environment-source fixtures: a scripted policy over the real run.

The tiny random model never writes a tool call, so an environment's end-to-end test replaces what
the run's engine *samples* (not how it is recorded): `script_policy` makes the engine answer each
request with the text `policy(prompt_text)` returns, encoded by the run's renderer and ended with
its end-of-turn id, logprob -1.0 per token, at the engine's weight version. Everything else is the
real run: the gateway over HTTP, the data pool file, the trainer's step on the recorded ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from forgerl.types import GenerateOutput


def script_policy(services: Any, policy: Callable[[str], str], delay_s: float = 0.0) -> list[str]:
    """Patch `services.engine`'s generate and stream so every model call of the run answers
    `policy(decoded prompt)` (after `delay_s` seconds); returns the list the answers are
    appended to."""
    engine, renderer = services.engine, services.gateway.renderer
    answers: list[str] = []

    async def stream(prompt_ids, params):
        await asyncio.sleep(delay_s)
        text = policy(renderer.decode(prompt_ids))
        answers.append(text)
        ids = [*renderer.encode(text), renderer.end_of_turn_id][: params.max_tokens]
        finish = "stop" if ids[-1] == renderer.end_of_turn_id else "length"
        yield GenerateOutput(ids, [-1.0] * len(ids), [engine.weight_version] * len(ids), finish)

    async def generate(prompt_ids, params):
        *_, out = [item async for item in stream(prompt_ids, params)]
        return out

    engine.stream, engine.generate = stream, generate
    return answers



async def _take(services: Any) -> tuple[list[int], list]:
    services.admit()
    batch = await services.next_batch()
    return batch, [t for i in batch for t in services.pool.get_group(i).trajectories]


async def first_batch(services: Any) -> list:
    """Admit tasks and wait for the first batch the scheduler releases: its trajectories."""
    return (await _take(services))[1]


async def one_step(services: Any) -> tuple[list, dict]:
    """`first_batch`, then one training step on it: (its trajectories, the step's metrics)."""
    batch, trajs = await _take(services)
    return trajs, await services.train(batch)
