"""litellm's client (`litellm.completion` and `litellm.responses` with an "openai/" model and
`api_base`) driven through the gateway over real HTTP.

Pins: with a scripted engine, a chat tool loop and a Responses tool loop chained by litellm's
(re-encoded) `previous_response_id` reach the final answer; the recorded completion ids are the
engine's scripted ids and turn 2's prompt starts with turn 1's prompt + completion ids
(`extends_previous`, no prefix miss). With the tiny model on the LocalEngine a 3-turn chat
records exactly the ids the engine generated, each turn extending the last.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import pytest

from .conftest import ScriptedEngine, reply
from .test_local_engine import Recording
from .test_responses import FLAT
from .test_tito import WEATHER, tool_call_text

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no model cost map download
litellm = pytest.importorskip("litellm", reason="litellm not installed")
litellm.telemetry = False
# litellm's own TypedDicts, first built during a call, trip a pydantic warning.
pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")


def scripted(serve, tokenizer, texts: list[str]):
    """(served gateway, trajectory id, api key, scripted items) answering `texts`."""
    from forgerl.gateway.renderers.renderer import ChatMLRenderer

    renderer = ChatMLRenderer(tokenizer)
    script = [reply(renderer, t) for t in texts]
    srv = serve(ScriptedEngine(list(script)), tokenizer)
    tid, key = srv.session()
    return srv, tid, key, script


def assert_tito(srv, tid: str, script) -> None:
    """The records hold the scripted ids; turn 2 extends turn 1's prompt + completion ids."""
    first, second = srv.pool.get_trajectory(tid).completions
    assert [first.completion_ids, second.completion_ids] == [s.ids for s in script]
    assert [first.logprobs, second.logprobs] == [s.logprobs for s in script]
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
        first.prompt_ids + first.completion_ids)
    assert second.extends_previous and srv.gateway.counters["prefix_misses"] == 0


def test_completion_tool_loop(serve, tokenizer):
    texts = [tool_call_text("get_weather", {"city": "Paris"}), "It is sunny in Paris."]
    srv, tid, key, script = scripted(serve, tokenizer, texts)
    kw = {"model": "openai/tiny", "api_base": srv.base_url, "api_key": key, "tools": [WEATHER],
          "num_retries": 0, "timeout": 60}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = litellm.completion(messages=messages, **kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = litellm.completion(messages=messages, **kw)
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert r.usage.prompt_tokens == len(srv.pool.get_trajectory(tid).completions[1].prompt_ids)
    assert_tito(srv, tid, script)


def test_responses_tool_loop(serve, tokenizer):
    texts = [tool_call_text("get_weather", {"city": "Paris"}), "It is sunny in Paris."]
    srv, tid, key, script = scripted(serve, tokenizer, texts)
    kw = {"model": "openai/tiny", "api_base": srv.base_url, "api_key": key, "tools": [FLAT],
          "num_retries": 0, "timeout": 60}
    r = litellm.responses(input="Weather in Paris?", **kw)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    r = litellm.responses(input=[output], previous_response_id=r.id, **kw)
    assert r.output[0].content[0].text == "It is sunny in Paris."
    assert_tito(srv, tid, script)


def test_completion_on_tiny_model(serve, tokenizer, tiny_model):
    local = pytest.importorskip("forgerl.engines.local", reason="forgerl.engines.local")
    engine = Recording(local.LocalEngine(tiny_model, max_model_len=2048, max_batch_size=4))
    srv = serve(engine, tokenizer)
    try:
        tid, key = srv.session(seed=2)
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        for turn in range(3):
            r = litellm.completion(model="openai/tiny", api_base=srv.base_url, api_key=key,
                                   messages=messages, tools=[WEATHER], max_tokens=12,
                                   num_retries=0, timeout=60)
            # The random model writes no tool calls: answer with a user message instead.
            messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                         {"role": "user", "content": f"{turn} C, go on."}]
        records = srv.pool.get_trajectory(tid).completions
        assert len(records) == 3 == len(engine.outputs)
        for rec, (prompt, out) in zip(records, engine.outputs, strict=True):
            assert rec.prompt_ids == prompt and rec.completion_ids == out.completion_ids
        for prev, nxt in itertools.pairwise(records):
            assert nxt.prompt_ids[: len(prev.prompt_ids) + len(prev.completion_ids)] == (
                prev.prompt_ids + prev.completion_ids)
            assert nxt.extends_previous
    finally:
        asyncio.run_coroutine_threadsafe(engine.engine.close(), srv.loop).result(30)
