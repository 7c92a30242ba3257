"""A 3-turn Anthropic tool loop through the gateway and the real LocalEngine on the tiny model.

Pins token-in-token-out end to end for the Messages protocol: each recorded completion holds
exactly the ids and logprobs the engine generated (streamed turns too), and turn k+1's prompt
starts with turn k's prompt + completion ids while the agent echoes the replies back as
Anthropic content blocks with tool_result blocks.
"""

from __future__ import annotations

import asyncio

import pytest

from .test_anthropic import TOOL, client
from .test_local_engine import Recording

local = pytest.importorskip("forgerl.engines.local", reason="forgerl.engines.local not importable")


def test_three_turn_anthropic_tool_loop(serve, tokenizer, tiny_model):
    engine = Recording(local.LocalEngine(tiny_model, max_model_len=2048, max_batch_size=4))
    srv = serve(engine, tokenizer)
    try:
        tid, key = srv.session()
        c = client(srv, key)
        messages: list[dict] = [{"role": "user", "content": "What is the weather in Oslo?"}]
        for turn in range(3):
            kw = {"model": "tiny", "max_tokens": 12, "messages": messages, "tools": [TOOL],
                  "system": "You help."}
            if turn == 1:
                with c.messages.stream(**kw) as s:
                    r = s.get_final_message()
            else:
                r = c.messages.create(**kw)
            assert r.usage.output_tokens >= 1 and r.stop_reason in ("end_turn", "max_tokens",
                                                                      "tool_use")
            results = [{"type": "tool_result", "tool_use_id": b.id, "content": f"{turn} C"}
                       for b in r.content if b.type == "tool_use"]
            messages += [{"role": "assistant", "content": r.content},
                         {"role": "user", "content": results or f"turn {turn} done?"}]
        records = srv.pool.get_trajectory(tid).completions
        assert len(records) == 3 == len(engine.outputs)
        for rec, (prompt, out) in zip(records, engine.outputs, strict=True):
            assert rec.prompt_ids == prompt
            assert rec.completion_ids == out.completion_ids and rec.logprobs == out.logprobs
        for k in range(2):
            prev, nxt = records[k], records[k + 1]
            assert nxt.prompt_ids[: len(prev.prompt_ids) + len(prev.completion_ids)] == (
                prev.prompt_ids + prev.completion_ids)
            assert nxt.extends_previous
        assert srv.gateway.sessions.get(key).prefix_misses == 0
    finally:
        asyncio.run_coroutine_threadsafe(engine.engine.close(), srv.loop).result(30)
