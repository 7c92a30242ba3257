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
        tid, key, _ = srv.converse(
            "What is the weather in Oslo?", 3,
            lambda turn: {"role": "tool", "tool_call_id": f"c{turn}", "content": f"{turn} C"},
            tools=[WEATHER], max_tokens=12)
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


def test_seeded_sessions_replay_their_samples(serve, tokenizer, tiny_model):
    """A session opened with a seed samples each turn with seed + turn: two sessions with the
    same seed record the same ids and logprobs for a 2-turn conversation at temperature 1.5
    (requests sent one at a time, so each decodes alone: batching is the stated limit of
    reproducibility); another seed gives other samples."""
    engine = local.LocalEngine(tiny_model, max_model_len=512, prefix_cache_tokens=0)
    srv = serve(engine, tokenizer)

    def conversation(seed: int) -> list:
        tid, key = srv.session(seed=seed, temperature=1.5)
        client = srv.client(key)
        messages = [{"role": "user", "content": "Count to three."}]
        for _ in range(2):
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Again."}]
        return [(c.completion_ids, c.logprobs, c.sampling.seed)
                for c in srv.pool.get_trajectory(tid).completions]

    try:
        first, again, other = conversation(11), conversation(11), conversation(12)
        assert [s for _, _, s in first] == [11, 12]  # seed + turn index
        assert [ids for ids, _, _ in first] == [ids for ids, _, _ in again]
        for (_, a, _), (_, b, _) in zip(first, again, strict=True):
            assert a == pytest.approx(b, abs=1e-6)  # same kernels, same inputs: same floats
        assert [ids for ids, _, _ in other] != [ids for ids, _, _ in first]
    finally:
        asyncio.run_coroutine_threadsafe(engine.close(), srv.loop).result(30)
