"""A 3-turn tool conversation through the gateway and the real LocalEngine on the tiny model.

Pins token-in-token-out end to end: each recorded completion holds exactly the ids and logprobs
the engine generated, and turn k+1's prompt starts with turn k's prompt + completion ids (the
agent echoes the gateway's replies back as plain chat messages, as OpenAI agents do).
"""

from __future__ import annotations

import asyncio

import pytest

from .test_tito import WEATHER

local = pytest.importorskip("forgerl.engines.local", reason="forgerl.engines.local not importable")


class Recording:
    """Wraps an engine and keeps every (prompt_ids, GenerateOutput) it produced."""

    def __init__(self, engine):
        self.engine, self.outputs = engine, []
        self.max_model_len = engine.max_model_len

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    async def generate(self, prompt_ids, params):
        out = await self.engine.generate(prompt_ids, params)
        self.outputs.append((list(prompt_ids), out))
        return out


def test_three_turn_tool_conversation(serve, tokenizer, tiny_model):
    engine = Recording(local.LocalEngine(tiny_model, max_model_len=2048, max_batch_size=4))
    srv = serve(engine, tokenizer)
    try:
        tid, key = srv.session()
        client = srv.client(key)
        messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
        for turn in range(3):
            r = client.chat.completions.create(
                model="tiny",
                messages=messages,
                tools=[WEATHER],
                max_tokens=12,
                temperature=1.0,
                seed=turn,
            )
            messages += [
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": f"c{turn}", "content": f"{turn} C"},
            ]
        records = srv.pool.get_trajectory(tid).completions
        assert len(records) == 3 == len(engine.outputs)
        for rec, (prompt, out) in zip(records, engine.outputs, strict=True):
            assert rec.prompt_ids == prompt
            assert rec.completion_ids == out.completion_ids and rec.logprobs == out.logprobs
            assert 1 <= len(rec.completion_ids) <= 12 and rec.weight_versions == [0] * len(
                rec.completion_ids
            )
        for k in range(2):
            prev, nxt = records[k], records[k + 1]
            assert nxt.prompt_ids[: len(prev.prompt_ids) + len(prev.completion_ids)] == (
                prev.prompt_ids + prev.completion_ids
            )
            assert nxt.extends_previous
        assert srv.gateway.sessions.get(key).prefix_misses == 0
    finally:
        asyncio.run_coroutine_threadsafe(engine.engine.close(), srv.loop).result(30)
