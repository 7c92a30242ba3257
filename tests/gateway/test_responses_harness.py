"""POST /v1/responses driven by real harnesses: openai-agents' default Responses model (scripted
engine) and the official client over the real LocalEngine on the tiny model.

Pins: an unmodified `agents.Agent` with a function tool runs its tool loop through the gateway
(the agent re-sends its items each turn); with the tiny model, a 3-turn tool conversation chained
by `previous_response_id` records exactly the ids and logprobs the engine generated, and turn k+1's
prompt extends turn k's prompt + completion ids.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from .conftest import ScriptedEngine, reply
from .test_local_engine import Recording
from .test_responses import CALL, FLAT, tool_turn

local = pytest.importorskip("forgerl.engines.local", reason="forgerl.engines.local not importable")


def test_openai_agents_tool_loop(serve, tokenizer):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    from forgerl.gateway.renderers.renderer import ChatMLRenderer

    renderer = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(renderer, CALL), reply(renderer, "It is sunny in Paris.")]),
                tokenizer)
    tid, key = srv.session()
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        asked.append(city)
        return "sunny"

    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather])
    provider = agents.OpenAIProvider(openai_client=AsyncOpenAI(
        base_url=srv.base_url, api_key=key, max_retries=0), use_responses=True)
    config = agents.RunConfig(model="tiny", model_provider=provider, tracing_disabled=True)
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", run_config=config))
    assert result.final_output == "It is sunny in Paris." and asked == ["Paris"]
    first, second = srv.pool.get_trajectory(tid).completions
    call_id = next(i.raw_item.call_id for i in result.new_items if i.type == "tool_call_item")
    assert second.prompt_ids == first.prompt_ids + first.completion_ids + tool_turn(
        srv, call_id, "sunny")
    assert second.extends_previous
    assert srv.gateway.sessions.get(key).prefix_misses == 0


def test_tiny_model_tool_conversation_via_previous_response_id(serve, tokenizer, tiny_model):
    engine = Recording(local.LocalEngine(tiny_model, max_model_len=2048, max_batch_size=4))
    srv = serve(engine, tokenizer)
    try:
        tid, key = srv.session(seed=5)
        client = srv.client(key)
        r = client.responses.create(model="tiny", input="What is the weather in Oslo?",
                                    tools=[FLAT], max_output_tokens=12)
        for turn in range(2):
            # The random model writes no tool calls: answer with a user message instead.
            r = client.responses.create(model="tiny", previous_response_id=r.id, tools=[FLAT],
                                        max_output_tokens=12, input=f"{turn} C, go on.")
        records = srv.pool.get_trajectory(tid).completions
        assert len(records) == 3 == len(engine.outputs)
        for rec, (prompt, out) in zip(records, engine.outputs, strict=True):
            assert rec.prompt_ids == prompt
            assert rec.completion_ids == out.completion_ids and rec.logprobs == out.logprobs
        for prev, nxt in itertools.pairwise(records):
            assert nxt.prompt_ids[: len(prev.prompt_ids) + len(prev.completion_ids)] == (
                prev.prompt_ids + prev.completion_ids)
            assert nxt.extends_previous
        assert r.usage.input_tokens == len(records[-1].prompt_ids)
    finally:
        asyncio.run_coroutine_threadsafe(engine.engine.close(), srv.loop).result(30)
