"""CASES.md C22: tool-call ids survive the round trip and never repeat, with the official openai
client against the real app over HTTP.

Pins: a model whose template prints call ids (the Mistral-like template of test_templates.py:
the model samples a 9-character id with each call) answers, on chat and Responses, streamed and
not, with exactly the sampled ids, and the next prompt holds them (in the tool results) token for
token, extending the previous turn id for id; a model without native ids (ChatML + Hermes) mints
an id per call, unique across a session of 3 turns x 2 calls with a retried call and a windowed
history; a tool result naming a call id no earlier assistant message made is a 400 on chat,
Anthropic Messages and Responses, with nothing recorded.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from .conftest import ScriptedEngine, reply
from .test_templates import WEATHER, serve_hf

TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
FLAT = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]  # Responses' shape
ASK = "Weather and time in Paris?"


def mistral_calls(*calls: tuple[str, str]) -> str:
    """A reply of (tool, id) calls in the Mistral format, each for Paris."""
    return "[TOOL_CALLS][" + ", ".join(
        f'{{"name": "{name}", "arguments": {{"city": "Paris"}}, "id": "{cid}"}}'
        for name, cid in calls) + "]"


TURNS = [mistral_calls(("get_weather", "wthr00000"), ("get_time", "time00001")),
         mistral_calls(("get_weather", "wthr00002")), "Sunny, noon."]
SAMPLED = [["wthr00000", "time00001"], ["wthr00002"], []]


def _chat_turn(client, messages: list[dict], stream: bool) -> tuple[str, list[dict]]:
    """(content, tool calls as chat dicts) of one chat call, streamed or not."""
    if not stream:
        msg = client.chat.completions.create(model="tiny", messages=messages,
                                             tools=[WEATHER, TIME]).choices[0].message
        return msg.content or "", [c.model_dump() for c in msg.tool_calls or ()]
    content, calls = "", {}
    for chunk in client.chat.completions.create(model="tiny", messages=messages,
                                                tools=[WEATHER, TIME], stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for c in choice.delta.tool_calls or ():
                call = calls.setdefault(c.index, {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                call["id"] += c.id or ""
                call["function"]["name"] += c.function.name or ""
                call["function"]["arguments"] += c.function.arguments or ""
    return content, list(calls.values())


def _responses_turn(client, items: list[dict], stream: bool) -> tuple[str, list[dict]]:
    """(output text, function_call items) of one Responses call, streamed or not."""
    if stream:
        events = list(client.responses.create(model="tiny", input=items, tools=FLAT, stream=True))
        response = next(e.response for e in events if e.type == "response.completed")
    else:
        response = client.responses.create(model="tiny", input=items, tools=FLAT)
    calls = [{"type": "function_call", "call_id": o.call_id, "name": o.name,
              "arguments": o.arguments} for o in response.output if o.type == "function_call"]
    return response.output_text, calls


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_sampled_ids_come_back_and_reach_the_next_prompt_exactly(serve, api, stream):
    srv, r = serve_hf(serve, "mistral", TURNS)
    tid, key = srv.session()
    client = srv.client(key)
    history: list[dict] = [{"role": "user", "content": ASK}]  # a chat message or an input item
    for turn, expected in enumerate(SAMPLED):
        if api == "chat":
            content, calls = _chat_turn(client, history, stream)
            ids = [c["id"] for c in calls]
            history += [{"role": "assistant", "content": content or None,
                         **({"tool_calls": calls} if calls else {})}]
            history += [{"role": "tool", "tool_call_id": i, "content": f"result {i}"}
                        for i in ids]
        else:
            content, calls = _responses_turn(client, history, stream)
            ids = [c["call_id"] for c in calls]
            history += calls + [{"type": "function_call_output", "call_id": i,
                                 "output": f"result {i}"} for i in ids]
        assert ids == expected, (turn, ids)
    assert content == "Sunny, noon."
    c1, c2, c3 = srv.pool.get_trajectory(tid).completions
    for prev, nxt in ((c1, c2), (c2, c3)):  # each turn extends the last, id for id
        assert nxt.prompt_ids[: len(prev.prompt_ids) + len(prev.completion_ids)] == (
            prev.prompt_ids + prev.completion_ids)
    sampled = r.tokenizer.decode(c1.completion_ids + c2.completion_ids)
    assert sampled.count('"id": "wthr00000"') == sampled.count('"id": "wthr00002"') == 1
    for cid in ("wthr00000", "time00001", "wthr00002"):  # the results name them, as sent
        result = r.tokenizer.encode(f'[TOOL_RESULTS]{{"call_id": "{cid}", "content": '
                                    f'"result {cid}"}}[/TOOL_RESULTS]', add_special_tokens=False)
        tail = c3.prompt_ids
        assert any(tail[i:i + len(result)] == result for i in range(len(tail))), cid


def hermes_calls(*names: str) -> str:
    return "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {{"city": "Paris"}}}}\n'
                   "</tool_call>" for n in names)


def test_minted_ids_are_unique_across_a_session_with_a_retry_and_windowing(
        serve, tokenizer, renderer):
    script = [reply(renderer, hermes_calls("get_weather", "get_time")) for _ in range(4)]
    srv = serve(ScriptedEngine([*script, reply(renderer, "Done.")]), tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    system = {"role": "system", "content": "Be brief."}
    history = [system, {"role": "user", "content": ASK}]
    minted, used = [], []
    for turn in range(3):
        msg = client.chat.completions.create(model="tiny", messages=history,
                                             tools=[WEATHER, TIME]).choices[0].message
        if turn == 1:  # the client timed out and sends the same request again
            minted += [c.id for c in msg.tool_calls]
            msg = client.chat.completions.create(model="tiny", messages=history,
                                                 tools=[WEATHER, TIME]).choices[0].message
        ids = [c.id for c in msg.tool_calls]
        minted += ids
        used += ids
        exchange = [msg.model_dump(exclude_none=True),
                    *({"role": "tool", "tool_call_id": i, "content": "ok"} for i in ids)]
        # the history window keeps the system prompt, the question and the newest exchange
        history = [system, {"role": "user", "content": ASK}, *exchange]
    last = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER, TIME])
    assert last.choices[0].message.content == "Done."
    assert len(used) == len(set(used)) == 6 and len(minted) == len(set(minted)) == 8
    assert all(i.startswith("call_") and len(i) == 29 for i in minted)
    assert len(srv.pool.get_trajectory(tid).completions) == 5


def test_a_result_for_an_unknown_call_id_is_a_400(serve, tokenizer, renderer):
    srv = serve(ScriptedEngine([reply(renderer, hermes_calls("get_weather"))]), tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    question = [{"role": "user", "content": ASK}]
    msg = client.chat.completions.create(model="tiny", messages=question,
                                         tools=[WEATHER]).choices[0].message
    before = (srv.pool.stats(), len(srv.engine.calls))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", tools=[WEATHER], messages=[
            *question, msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": "call_bogus", "content": "sunny"}])
    assert e.value.code == "invalid_value" and "'call_bogus'" in e.value.message
    call = msg.tool_calls[0]
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic.Anthropic(base_url=srv.base_url.removesuffix("/v1"), api_key=key,
                            max_retries=0).messages.create(
            model="tiny", max_tokens=16, messages=[
                *question, {"role": "assistant", "content": [
                    {"type": "tool_use", "id": call.id, "name": "get_weather",
                     "input": json.loads(call.function.arguments)}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_bogus", "content": "sunny"}]}])
    assert "'toolu_bogus'" in e.value.message
    r = httpx.post(f"{srv.base_url}/responses", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "tiny", "input": [
                       {"type": "function_call", "call_id": call.id, "name": "get_weather",
                        "arguments": call.function.arguments},
                       {"type": "function_call_output", "call_id": "fc_bogus",
                        "output": "sunny"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1.call_id"
    assert (srv.pool.stats(), len(srv.engine.calls)) == before
    assert len(srv.pool.get_trajectory(tid).completions) == 1
