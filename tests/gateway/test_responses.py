"""POST /v1/responses through the official `openai` client over real HTTP (scripted engine).

Pins: a plain call and a tool call answer Responses objects whose usage and ids match the
record; a full tool loop chained by `previous_response_id` and the same loop with the input
items re-sent both give turn 2 the prompt turn 1's prompt + completion ids + the tool turn
(TITO, `extends_previous`), with nothing duplicated; CASES.md C15 (one tool in chat and
Responses shape renders identical ids), C16 (the context `previous_response_id` rebuilds:
user, assistant reasoning + call_1, tool; a re-sent function_call is not duplicated; call_9 is a
400 naming it), C17 at the gateway (a retried first turn is accepted; the later turn extends the
retry); the SDK's streams parse the event sequence; refused fields are 400s naming them (what
the policy accepts, approximates or leaves out: test_policy.py).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from forgerl.gateway.conversation import Message, ToolCall
from forgerl.gateway.protocols import responses
from forgerl.gateway.sessions import Session, Turn

from .conftest import render, served
from .test_tito import WEATHER, tool_call_text

FLAT = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = tool_call_text("get_weather", {"city": "Paris"})


def tool_turn(srv, call_id: str, output: str) -> list[int]:
    """Ids appended after a recorded assistant turn: "\\n", the tool turn, generation prompt."""
    r = srv.renderer
    return [*r.newline_ids, *r.render_turns([Message("tool", output, tool_call_id=call_id)]),
            *r.generation_prompt_ids]


def test_plain_response_matches_the_record(serve, tokenizer):
    srv, tid, client = served(serve, tokenizer, ["Hello there."])
    r = client.responses.create(model="tiny", input="Say hi.", instructions="Be brief.",
                                temperature=0.7, max_output_tokens=50)
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert r.object == "response" and r.status == "completed" and r.output_text == "Hello there."
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text"
    assert rec.prompt_ids == render(srv.renderer, [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "Say hi."}])
    assert rec.completion_ids == [*srv.renderer.encode("Hello there."), srv.renderer.end_of_turn_id]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(rec.prompt_ids),
                                                             len(rec.completion_ids))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert srv.engine.calls[0][1].temperature == 0.7 and srv.engine.calls[0][1].max_tokens == 50


def test_tool_loop_via_previous_response_id(serve, tokenizer):
    srv, tid, client = served(serve, tokenizer, [CALL, "It is sunny."])
    r1 = client.responses.create(model="tiny", input="Weather in Paris?", tools=[FLAT])
    (call,) = r1.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    r2 = client.responses.create(model="tiny", tools=[FLAT], previous_response_id=r1.id,
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": "sunny"}])
    assert r2.output_text == "It is sunny." and r2.previous_response_id == r1.id
    first, second = srv.pool.get_trajectory(tid).completions
    assert second.prompt_ids == first.prompt_ids + first.completion_ids + tool_turn(
        srv, call.call_id, "sunny")
    assert second.extends_previous and not first.extends_previous
    assert [p for p, _ in srv.engine.calls] == [first.prompt_ids, second.prompt_ids]


def test_tool_loop_with_resent_items_is_not_duplicated(serve, tokenizer):
    """The agent re-sends its whole history (the SDK's output items as dicts, ids included);
    with previous_response_id as well, the re-sent items are not added a second time."""
    srv, tid, client = served(serve, tokenizer, [CALL, "It is sunny.", CALL, "Sunny again."])
    history = [{"role": "user", "content": "Weather in Paris?"}]
    expected = []
    for chained in (False, True):
        r1 = client.responses.create(model="tiny", input=history, tools=[FLAT])
        out = [o.model_dump(exclude_none=True) for o in r1.output]
        tool = {"type": "function_call_output", "call_id": r1.output[0].call_id, "output": "sunny"}
        r2 = client.responses.create(model="tiny", input=[*history, *out, tool], tools=[FLAT],
                                     previous_response_id=r1.id if chained else None)
        assert r2.status == "completed"
        expected.append(r1.output[0].call_id)
    recs = srv.pool.get_trajectory(tid).completions
    assert len(recs) == 4
    for (first, second), call_id in zip((recs[:2], recs[2:]), expected, strict=True):
        assert second.prompt_ids == first.prompt_ids + first.completion_ids + tool_turn(
            srv, call_id, "sunny")
        assert second.extends_previous
    assert recs[0].prompt_ids == recs[2].prompt_ids


def session_with_reasoning_turn() -> tuple[Session, str]:
    """C16 turn 1 as the session holds it: reply = reasoning "need the tool" + call_1."""
    session = Session("sk-test", "traj-1")
    reply_msg = Message("assistant", "", (ToolCall("get_weather", '{"city":"Paris"}', "call_1"),),
                        reasoning="need the tool")
    session.turns.append(Turn((Message("user", "Weather in Paris?"),), (), [1, 2], [3, 4],
                              reply_msg))
    session.response_ids["resp_n" + "0" * 32] = 0
    return session, "resp_n" + "0" * 32


def conversation(session: Session, body: dict) -> tuple[Message, ...]:
    return responses.parse(json.dumps({"model": "tiny", **body}).encode(), session)[1].messages


def test_c16_previous_response_id_keeps_the_tool_exchange_once():
    session, r1 = session_with_reasoning_turn()
    output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    resent = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city":"Paris"}', "id": "fc_x"}
    expected = (
        Message("user", "Weather in Paris?"),
        Message("assistant", "", (ToolCall("get_weather", '{"city":"Paris"}', "call_1"),),
                reasoning="need the tool"),
        Message("tool", "sunny", tool_call_id="call_1"),
    )
    assert conversation(session, {"previous_response_id": r1, "input": [output]}) == expected
    assert conversation(session, {"previous_response_id": r1, "input": [resent, output]}) == \
        expected
    # The whole history re-sent as items, reasoning item first: the same context.
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "reasoning", "id": "rs_x", "summary": [],
              "content": [{"type": "reasoning_text", "text": "need the tool"}]}, resent, output]
    assert conversation(session, {"input": items}) == expected
    for body in ({"previous_response_id": r1}, {}):
        with pytest.raises(responses.GatewayError) as e:
            conversation(session, {**body, "input": [{**output, "call_id": "call_9"}]})
        assert e.value.status == 400 and e.value.param == "input.0.call_id"
        assert "call_9" in e.value.message


def test_c16_unknown_call_id_and_response_id_over_http(serve, tokenizer):
    srv, tid, client = served(serve, tokenizer, [CALL])
    r1 = client.responses.create(model="tiny", input="Weather in Paris?", tools=[FLAT])
    bad = [{"type": "function_call_output", "call_id": "call_9", "output": "sunny"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", tools=[FLAT], previous_response_id=r1.id,
                                input=bad)
    assert e.value.body["param"] == "input.0.call_id" and "call_9" in e.value.body["message"]
    for rid in ("resp_nope", r1.id[:-1] + ("0" if r1.id[-1] != "0" else "1")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", previous_response_id=rid, input="hi")
        assert e.value.body["code"] == "previous_response_not_found" and rid in e.value.message
    _, other_key = srv.session()  # another session cannot continue this one's response
    with pytest.raises(openai.BadRequestError):
        srv.client(other_key).responses.create(model="tiny", previous_response_id=r1.id,
                                               input="hi")
    assert len(srv.engine.calls) == 1 and len(srv.pool.get_trajectory(tid).completions) == 1


@pytest.mark.parametrize(("item", "param"), [
    ({"type": "message", "role": "user"}, "input.0.content"),
    ({"role": "user", "content": [{"type": "input_text"}]}, "input.0.content.0.text"),
    ({"role": "assistant", "content": [{"type": "refusal"}]}, "input.0.content.0.refusal"),
])
def test_an_item_missing_its_content_is_a_400_naming_it(serve, tokenizer, item, param):
    """A message item without content, or a text part without its text, is refused as OpenAI
    refuses it (it was rendered as an empty turn), and nothing is recorded."""
    srv, tid, client = served(serve, tokenizer, ["one"])
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=[item])
    assert (e.value.body["code"], e.value.body["param"]) == ("missing_required_parameter", param)
    assert srv.pool.get_trajectory(tid).completions == [] and srv.engine.calls == []


def test_store_false_answers_an_id_no_request_can_continue(serve, tokenizer):
    srv, tid, client = served(serve, tokenizer, ["one"])
    r = client.responses.create(model="tiny", input="hi", store=False)
    assert r.store is False and r.output_text == "one"
    assert len(srv.pool.get_trajectory(tid).completions) == 1  # recorded all the same
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="tiny", previous_response_id=r.id, input="again")


def test_c15_one_tool_in_chat_and_responses_shape_renders_identical_ids(serve, tokenizer):
    """(a) chat shape, (b) chat with strict false and keys reordered, (c) Responses flat shape;
    history holds an assistant call whose arguments is the JSON string '{"city": "Paris"}'."""
    srv, _, _ = served(serve, tokenizer, ["ok"] * 3)
    args = '{"city": "Paris"}'
    chat_history = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": args}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": args},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]
    reordered = {"function": {"strict": False, "parameters": WEATHER["function"]["parameters"],
                              "description": "Weather in a city", "name": "get_weather"},
                 "type": "function"}
    for tool in (WEATHER, reordered):
        _, key = srv.session()
        srv.client(key).chat.completions.create(model="tiny", messages=chat_history, tools=[tool])
    _, key = srv.session()
    srv.client(key).responses.create(model="tiny", input=items, tools=[FLAT])
    (a, _), (b, _), (c, _) = srv.engine.calls
    assert a == b == c == render(srv.renderer, chat_history, [WEATHER])
    assert '"arguments": {"city": "Paris"}' in tokenizer.decode(c)  # an object, not a string
    r = httpx.post(f"{srv.base_url}/responses", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "tiny", "input": "hi",
                         "tools": [{**FLAT, "parameters": "not a schema"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.parameters"


def test_c17_retried_first_turn_is_accepted_and_the_retry_is_extended(serve, tokenizer):
    srv, tid, client = served(serve, tokenizer, [CALL, CALL, "It is sunny."])
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[FLAT])
    retry = client.responses.create(model="tiny", input="Weather in Paris?", tools=[FLAT])
    assert first.id != retry.id
    call_id = retry.output[0].call_id
    client.responses.create(model="tiny", tools=[FLAT], previous_response_id=retry.id, input=[
        {"type": "function_call_output", "call_id": call_id, "output": "sunny"}])
    c1, c1b, c2 = srv.pool.get_trajectory(tid).completions
    assert c1.prompt_ids == c1b.prompt_ids and not c1b.extends_previous
    assert c2.prompt_ids == c1b.prompt_ids + c1b.completion_ids + tool_turn(srv, call_id, "sunny")
    assert c2.extends_previous


def test_max_output_tokens_gives_an_incomplete_response(serve, tokenizer):
    srv, tid, client = served(serve, tokenizer, ["a long answer"])
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert rec.finish_reason == "length" and len(rec.completion_ids) == 3
    assert r.output_text == tokenizer.decode(rec.completion_ids)


def test_logprobs_are_the_recorded_ones(serve, tokenizer):
    srv, tid, client = served(serve, tokenizer, ["hi"])
    r = client.responses.create(model="tiny", input="x", include=["message.output_text.logprobs"])
    (rec,) = srv.pool.get_trajectory(tid).completions
    lps = r.output[0].content[0].logprobs
    assert [t.logprob for t in lps] == rec.logprobs[:-1]  # the end-of-turn id has no text
    assert "".join(t.token for t in lps) == "hi"


def test_stream_events_parse_in_the_sdk(serve, tokenizer):
    srv, tid, client = served(serve, tokenizer, ["Hello.", CALL])
    with client.responses.stream(model="tiny", input="Say hi.") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    deltas = kinds.count("response.output_text.delta")  # one per decoded piece
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert final.output_text == "Hello." and final.usage.output_tokens == len(
        srv.pool.get_trajectory(tid).completions[0].completion_ids)
    events = list(client.responses.create(model="tiny", input="Weather?", tools=[FLAT],
                                          stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events][2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    args = "".join(e.delta for e in events if e.type.endswith("arguments.delta"))
    assert json.loads(args) == {"city": "Paris"}
    done = events[-1].response
    assert done.output[0].call_id == events[2].item.call_id and done.usage.input_tokens == len(
        srv.pool.get_trajectory(tid).completions[1].prompt_ids)


@pytest.mark.parametrize(("body", "param"), [
    ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id"),
])
def test_refused_fields_are_400s_naming_them(serve, tokenizer, body, param):
    srv, _, client = served(serve, tokenizer, [])
    r = httpx.post(f"{srv.base_url}/responses", json={"model": "tiny", "input": "hi", **body},
                   headers={"Authorization": f"Bearer {client.api_key}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert srv.engine.calls == []


def test_unauthenticated_is_401(serve, tokenizer):
    srv, _, _ = served(serve, tokenizer, [])
    r = httpx.post(f"{srv.base_url}/responses", json={"model": "tiny", "input": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
