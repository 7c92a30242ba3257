"""A 2-turn token-native agent through POST /v1/completions and the real LocalEngine on the
tiny model.

Pins token-in-token-out end to end for the Completions protocol: each recorded completion holds
the prompt ids exactly as sent and exactly the ids and logprobs the engine generated; the
logprobs the client gets are the recorded ones; the agent's second prompt (first prompt +
returned `token_ids` + its new ids) is recorded as extending the first; streamed = recorded.
"""

from __future__ import annotations

import asyncio

import pytest

from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .test_local_engine import Recording

local = pytest.importorskip("forgerl.engines.local", reason="forgerl.engines.local not importable")


def test_token_native_two_turns_and_a_stream(serve, tokenizer, tiny_model):
    engine = Recording(local.LocalEngine(tiny_model, max_model_len=512, max_batch_size=4))
    srv = serve(engine, tokenizer)
    renderer = ChatMLRenderer(tokenizer)
    try:
        tid, key = srv.session()
        client = srv.client(key)
        prompt = [renderer.start_of_turn_id, *renderer.encode("user\nCount."),
                  renderer.end_of_turn_id, *renderer.newline_ids, *renderer.generation_prompt_ids]
        outs = []
        for turn in range(2):
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                            temperature=1.0, seed=turn, logprobs=0,
                                            extra_body={"return_token_ids": True})
            outs.append(out)
            prompt = prompt + out.choices[0].model_extra["token_ids"] + renderer.encode("\nmore")
        streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                                  seed=7, stream=True))
        records = srv.pool.get_trajectory(tid).completions
        assert len(records) == 3 == len(engine.outputs)
        for rec, (sent, gen) in zip(records, engine.outputs, strict=True):
            assert rec.prompt_ids == sent
            assert rec.completion_ids == gen.completion_ids and rec.logprobs == gen.logprobs
        for rec, out in zip(records[:2], outs, strict=True):
            c = out.choices[0]
            assert c.model_extra["token_ids"] == rec.completion_ids
            assert c.logprobs.token_logprobs == rec.logprobs
            assert len(c.logprobs.tokens) == len(rec.completion_ids) >= 1
            assert c.text == renderer.decode(rec.completion_ids)
        a, b, s = records
        assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == (
            a.prompt_ids + a.completion_ids)
        assert b.extends_previous and s.extends_previous
        assert "".join(c.choices[0].text for c in streamed if c.choices) == renderer.decode(
            s.completion_ids)
        assert srv.gateway.sessions.get(key).prefix_misses == 0
    finally:
        asyncio.run_coroutine_threadsafe(engine.engine.close(), srv.loop).result(30)
