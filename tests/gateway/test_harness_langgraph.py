"""LangGraph's prebuilt ReAct agent (`create_react_agent` over `langchain_openai.ChatOpenAI`)
driven unmodified through the gateway's chat endpoint over real HTTP.

Pins: with a scripted engine, a tool loop (call get_weather, then answer) runs to the final
answer, the recorded completion ids are the engine's scripted ids, and turn 2's prompt starts
with turn 1's prompt + completion ids (token-in-token-out, no prefix miss); with the tiny random
model on the LocalEngine the loop completes and records exactly the ids the engine generated.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from .conftest import ScriptedEngine, reply
from .test_local_engine import Recording
from .test_tito import tool_call_text

os.environ.setdefault("LANGSMITH_TRACING", "false")  # no telemetry, no network
os.environ.setdefault("LANGCHAIN_TRACING_V2", "false")
prebuilt = pytest.importorskip("langgraph.prebuilt", reason="langgraph not installed")
langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai not installed")
from langchain_core.tools import tool  # noqa: E402  (langchain-core comes with langgraph)

# The issue names langgraph.prebuilt's agent; LangGraph 1.x deprecates it for langchain.agents.
pytestmark = pytest.mark.filterwarnings("ignore:create_react_agent has been moved")


@tool
def get_weather(city: str) -> str:
    """Weather in a city."""
    return f"sunny in {city}"


def react_agent(srv, key: str, **kw):
    model = langchain_openai.ChatOpenAI(model="tiny", base_url=srv.base_url, api_key=key,
                                        max_retries=0, timeout=60, **kw)
    return prebuilt.create_react_agent(model, [get_weather])


def test_react_agent_tool_loop(serve, tokenizer):
    from forgerl.gateway.renderers.renderer import ChatMLRenderer

    renderer = ChatMLRenderer(tokenizer)
    script = [reply(renderer, tool_call_text("get_weather", {"city": "Paris"})),
              reply(renderer, "It is sunny in Paris.")]
    srv = serve(ScriptedEngine(list(script)), tokenizer)
    tid, key = srv.session()
    out = react_agent(srv, key).invoke({"messages": [("user", "Weather in Paris?")]})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert out["messages"][1].tool_calls[0]["args"] == {"city": "Paris"}
    assert out["messages"][2].content == "sunny in Paris"
    assert out["messages"][-1].content == "It is sunny in Paris."
    first, second = srv.pool.get_trajectory(tid).completions
    assert [first.completion_ids, second.completion_ids] == [s.ids for s in script]
    assert [first.logprobs, second.logprobs] == [s.logprobs for s in script]
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids)
    assert second.extends_previous and srv.gateway.sessions.get(key).prefix_misses == 0


def test_react_agent_on_tiny_model(serve, tokenizer, tiny_model):
    local = pytest.importorskip("forgerl.engines.local", reason="forgerl.engines.local")
    engine = Recording(local.LocalEngine(tiny_model, max_model_len=2048, max_batch_size=4))
    srv = serve(engine, tokenizer)
    try:
        tid, key = srv.session(seed=3)
        out = react_agent(srv, key, max_tokens=12).invoke(
            {"messages": [("user", "Weather in Oslo?")]})
        assert out["messages"][-1].type == "ai"
        records = srv.pool.get_trajectory(tid).completions
        assert len(records) == len(engine.outputs) >= 1
        for rec, (prompt, gen) in zip(records, engine.outputs, strict=True):
            assert rec.prompt_ids == prompt and rec.completion_ids == gen.completion_ids
    finally:
        asyncio.run_coroutine_threadsafe(engine.engine.close(), srv.loop).result(30)
