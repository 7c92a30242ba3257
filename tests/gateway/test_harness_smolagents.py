"""smolagents' `ToolCallingAgent` and `CodeAgent` over `smolagents.OpenAIServerModel`, driven
unmodified through the gateway's chat endpoint over real HTTP (scripted engine; the CodeAgent
once more on the tiny random model).

Pins: each tool loop runs to its final answer and the recorded completion ids are the engine's
scripted ids. The CodeAgent's `stop` sequences are honoured: the text it gets back ends before
"</code>" (it appends the tag itself) and drops what was sampled after it, while the record keeps
every id up to the end of the stop string. smolagents rewrites its context every turn (it
replays a tool call as an assistant text "Calling tools:\\n[{...}]" and the result as a user
"Observation:"), so no turn matches the recorded reply: each later prompt is a fresh rendering,
counted in `prefix_misses`. The CodeAgent's rewrite only appends text to the model's own words,
so with the byte tokenizer turn 2's prompt still starts with turn 1's prompt + completion ids.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json

import httpx
import pytest
import yaml

from .conftest import ScriptedEngine, reply
from .test_local_engine import Recording
from .test_tito import tool_call_text

smolagents = pytest.importorskip("smolagents", reason="smolagents not installed")
from smolagents import tool  # noqa: E402


@tool
def get_weather(city: str) -> str:
    """Weather in a city.

    Args:
        city: the city name.
    """
    return f"sunny in {city}"


def wire(sent: list[dict], got: list[dict]) -> httpx.Client:
    """An httpx client that keeps every request body in `sent` and response body in `got`."""

    def answered(response: httpx.Response) -> None:
        got.append(json.loads(response.read()))

    return httpx.Client(event_hooks={"request": [lambda r: sent.append(json.loads(r.content))],
                                     "response": [answered]})


def gateway(serve, tokenizer, texts: list[str], **client_kwargs):
    """(served gateway, trajectory id, OpenAIServerModel, scripted items) for `texts`."""
    from forgerl.gateway.renderers.renderer import ChatMLRenderer

    renderer = ChatMLRenderer(tokenizer)
    script = [reply(renderer, t) for t in texts]
    # smolagents' system prompts are ~5k bytes: one byte-tokenizer id each.
    srv = serve(ScriptedEngine(list(script), max_model_len=1 << 15), tokenizer)
    tid, key = srv.session()
    model = smolagents.OpenAIServerModel(
        model_id="tiny", api_base=srv.base_url, api_key=key,
        client_kwargs={"max_retries": 0, "timeout": 60, **client_kwargs})
    return srv, tid, model, script


def test_tool_calling_agent_tool_loop(serve, tokenizer):
    # The agent sends tool_choice "required": the gateway prefills the call's opening.
    opening = len("<tool_call>\n")
    texts = [tool_call_text("get_weather", {"city": "Paris"})[opening:],
             tool_call_text("final_answer", {"answer": "It is sunny in Paris."})[opening:]]
    srv, tid, model, script = gateway(serve, tokenizer, texts)
    agent = smolagents.ToolCallingAgent(tools=[get_weather], model=model, max_steps=3,
                                        verbosity_level=0)
    assert agent.run("Weather in Paris?") == "It is sunny in Paris."
    assert agent.memory.steps[1].observations == "sunny in Paris"
    first, second = srv.pool.get_trajectory(tid).completions
    assert [first.completion_ids, second.completion_ids] == [s.ids for s in script]
    assert [first.logprobs, second.logprobs] == [s.logprobs for s in script]
    assert first.finish_reason == second.finish_reason == "tool_calls"
    prompt = srv.renderer.decode(second.prompt_ids)
    assert "Calling tools:\n[{" in prompt and "Observation:\nsunny in Paris" in prompt
    assert not second.extends_previous and srv.gateway.counters["prefix_misses"] == 1


def test_code_agent_tool_loop_honours_stop(serve, tokenizer):
    code = "Thought: ask the tool.\n<code>\nprint(get_weather('Paris'))\n"
    after = "\nObservation: made up"  # sampled past the stop string: cut and not recorded
    texts = [code + "</code>" + after,
             "Thought: done.\n<code>\nfinal_answer('It is sunny in Paris.')\n</code>"]
    sent, got = [], []
    srv, tid, model, script = gateway(serve, tokenizer, texts, http_client=wire(sent, got))
    agent = smolagents.CodeAgent(tools=[get_weather], model=model, max_steps=3,
                                 verbosity_level=0)
    assert agent.run("Weather in Paris?") == "It is sunny in Paris."
    assert [r["stop"] for r in sent] == [["Observation:", "Calling tools:", "</code>"]] * 2
    assert got[0]["choices"][0]["message"]["content"] == code  # ends before the stop string
    assert got[0]["choices"][0]["finish_reason"] == "stop"
    step = agent.memory.steps[1]
    assert step.model_output == code + "</code>"  # got `code`; smolagents re-appended the tag
    assert "sunny in Paris" in step.observations
    first, second = srv.pool.get_trajectory(tid).completions
    kept = srv.renderer.encode(code + "</code>")
    assert first.completion_ids == kept == script[0].ids[: len(kept)]
    assert first.logprobs == script[0].logprobs[: len(kept)] and first.finish_reason == "stop"
    assert second.completion_ids == script[1].ids[:-1]  # the end-of-turn id is past "</code>"
    assert srv.gateway.counters["tokens_after_stop"] == len(srv.renderer.encode(after)) + 2
    assert second.prompt_ids[: len(first.prompt_ids) + len(kept)] == first.prompt_ids + kept
    assert "made up" not in srv.renderer.decode(second.prompt_ids)
    assert not second.extends_previous  # "\nCalling tools:" appended to the reply: a rewrite


def test_code_agent_on_tiny_model(serve, tokenizer, tiny_model):
    local = pytest.importorskip("forgerl.engines.local", reason="forgerl.engines.local")
    engine = Recording(local.LocalEngine(tiny_model, max_model_len=2048, max_batch_size=4))
    srv = serve(engine, tokenizer)
    try:
        tid, key = srv.session(seed=1)
        model = smolagents.OpenAIServerModel(model_id="tiny", api_base=srv.base_url,
                                             api_key=key, max_tokens=12,
                                             client_kwargs={"max_retries": 0, "timeout": 60})
        # The default system prompt (~5k ids) does not fit the tiny model's 2048 positions.
        prompts = importlib.resources.files("smolagents.prompts") / "code_agent.yaml"
        templates = yaml.safe_load(prompts.read_text())
        templates["system_prompt"] = "Solve the task in a <code> block."
        agent = smolagents.CodeAgent(tools=[get_weather], model=model, max_steps=1,
                                     verbosity_level=0, prompt_templates=templates)
        agent.run("Weather in Oslo?")  # step 1 (no code: an error step), then the final answer
        records = srv.pool.get_trajectory(tid).completions
        assert len(records) == len(engine.outputs) == 2
        for rec, (prompt, out) in zip(records, engine.outputs, strict=True):
            assert rec.prompt_ids == prompt
            assert rec.completion_ids == out.completion_ids[: len(rec.completion_ids)]
    finally:
        asyncio.run_coroutine_threadsafe(engine.engine.close(), srv.loop).result(30)

