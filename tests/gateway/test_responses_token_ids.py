"""NeMo-Gym's token contract on POST /v1/responses, over real HTTP (scripted engine).

NeMo-Gym's vLLM model server (`return_token_id_information: true`) puts `prompt_token_ids`,
`generation_token_ids` and `generation_log_probs` on the last output item of each response, and
its agents send those items back unchanged as input of the next call. Pins: under
`[gateway] responses_token_ids` the last item carries exactly the pool's record (plain and
streamed: output_item.done and response.completed), and nothing does without it; items sent
back (raw JSON in NeMo-Gym's shapes, and the openai SDK's dumped output) extend token-exactly;
in a session with no record of that reply (another session) the item's ids ARE the record: the
prompt is its prompt + generation ids + the tool turn, ids re-encoding would never give
included, noted `from input.N` and counted; ids that differ from the session's record lose to
it, noted and counted; malformed ids are 400s naming the field, and nothing is recorded.
"""

from __future__ import annotations

import json

import httpx
import pytest

from forgerl.gateway.conversation import Message
from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import Scripted, ScriptedEngine, reply
from .test_responses import CALL, FLAT, tool_turn
from .test_tito import merge_tokenizer

USER = {"role": "user", "content": "Weather in Paris?", "type": "message"}  # EasyInputMessage
FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def post(srv, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/responses", json={"model": "tiny", **body},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60)


def with_ids(serve, tokenizer, script: list[str]):
    """A gateway under `responses_token_ids` answering `script` in order (`reply`)."""
    renderer = ChatMLRenderer(tokenizer)
    return serve(ScriptedEngine([reply(renderer, x) for x in script]), tokenizer,
                 responses_token_ids=True)


def carried(rec) -> dict:
    return {"prompt_token_ids": rec.prompt_ids, "generation_token_ids": rec.completion_ids,
            "generation_log_probs": rec.logprobs}


def tool_output(item: dict, text: str = "sunny") -> dict:
    return {"call_id": item["call_id"], "output": text, "type": "function_call_output"}


def test_last_item_carries_the_record_and_only_when_asked(serve, tokenizer):
    srv = with_ids(serve, tokenizer, ["Sure. " + CALL])
    tid, key = srv.session()
    out = post(srv, key, {"input": [USER], "tools": [FLAT]}).json()["output"]
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert [o["type"] for o in out] == ["message", "function_call"]
    assert {k: out[-1][k] for k in FIELDS} == carried(rec)
    assert rec.logprobs == pytest.approx([-0.01 * (i + 1) for i in range(len(rec.logprobs))])
    assert not any(k in out[0] for k in FIELDS)  # the last item only, as NeMo-Gym's server
    plain = serve(ScriptedEngine([reply(srv.renderer, "Hi.")]), tokenizer)
    _, key = plain.session()
    (item,) = post(plain, key, {"input": "Say hi."}).json()["output"]
    assert item["type"] == "message" and not any(k in item for k in FIELDS)


def test_items_sent_back_extend_token_exactly(serve, tokenizer):
    srv = with_ids(serve, tokenizer, [CALL, "It is sunny.", CALL, "Sunny again."])
    tid, key = srv.session()
    (call,) = post(srv, key, {"input": [USER], "tools": [FLAT]}).json()["output"]
    second = post(srv, key, {"input": [USER, call, tool_output(call)], "tools": [FLAT]})
    first, rec = srv.pool.get_trajectory(tid).completions
    assert second.status_code == 200
    assert rec.prompt_ids == first.prompt_ids + first.completion_ids + tool_turn(
        srv, call["call_id"], "sunny")
    assert rec.extends_previous and "token_ids" not in rec.request
    assert {k: second.json()["output"][-1][k] for k in FIELDS} == carried(rec)
    # The openai SDK keeps the extra fields on its output models: dumped items go back as well.
    client = srv.client(key)
    r1 = client.responses.create(model="tiny", input=[USER], tools=[FLAT])
    assert r1.output[-1].model_extra["generation_token_ids"] == (
        srv.pool.get_trajectory(tid).completions[2].completion_ids)
    items = [o.model_dump(exclude_none=True) for o in r1.output]
    client.responses.create(model="tiny", tools=[FLAT],
                            input=[USER, *items, tool_output(items[-1])])
    third, fourth = srv.pool.get_trajectory(tid).completions[2:]
    assert fourth.prompt_ids == third.prompt_ids + third.completion_ids + tool_turn(
        srv, items[-1]["call_id"], "sunny")
    assert srv.gateway.counters["item_token_ids"] == 0


def test_foreign_ids_are_the_record_when_the_session_has_none(serve):
    """Ids re-encoding never gives ([259, 261] for "hello", not [262]) come back on an item in
    another session: its prompt is built on them, noted and counted, a new trace, no miss."""
    tok, end = merge_tokenizer(), 2
    engine = ScriptedEngine([Scripted([259, 261, end], [-0.5, -0.7, -0.1]),
                             Scripted([259, 261, end], [-0.2, -0.3, -0.4])])
    srv = serve(engine, tok, responses_token_ids=True)
    tid_a, key_a = srv.session()
    (msg,) = post(srv, key_a, {"input": "say hi"}).json()["output"]
    assert msg["content"][0]["text"] == "hello" and msg["generation_token_ids"] == [259, 261, end]
    tid_b, key_b = srv.session()
    body = {"input": [{"role": "user", "content": "say hi"}, msg,
                      {"role": "user", "content": "again"}]}
    assert post(srv, key_b, body).status_code == 200
    (a,), (b,) = (srv.pool.get_trajectory(t).completions for t in (tid_a, tid_b))
    r = srv.renderer
    tail = [*r.newline_ids, *r.render_turns([Message("user", "again")]), *r.generation_prompt_ids]
    assert b.prompt_ids == [*a.prompt_ids, 259, 261, end, *tail] and 262 not in b.prompt_ids
    assert b.extends_previous and b.request["token_ids"] == "from input.1"
    assert srv.gateway.counters["item_token_ids"] == 1
    assert srv.gateway.counters["prefix_misses"] == 0


def test_ids_that_differ_from_the_record_lose_to_it(serve, tokenizer):
    srv = with_ids(serve, tokenizer, [CALL, "It is sunny."])
    tid, key = srv.session()
    (call,) = post(srv, key, {"input": [USER], "tools": [FLAT]}).json()["output"]
    forged = {**call, "generation_token_ids": [*call["generation_token_ids"][:-2], 65, 2]}
    assert post(srv, key, {"input": [USER, forged, tool_output(call)],
                           "tools": [FLAT]}).status_code == 200
    first, rec = srv.pool.get_trajectory(tid).completions
    assert rec.prompt_ids == first.prompt_ids + first.completion_ids + tool_turn(
        srv, call["call_id"], "sunny")
    assert rec.request["token_ids"] == "session record (input.1 differs)"
    assert srv.gateway.counters["item_token_ids"] == 1


@pytest.mark.parametrize(("change", "param", "code"), [
    ({"generation_token_ids": [5, 100000], "generation_log_probs": [-0.1, -0.2]}, "input.1",
     "invalid_value"),
    ({"prompt_token_ids": [-1]}, "input.1", "invalid_value"),
    ({"generation_log_probs": [-0.1]}, "input.1.generation_log_probs", "invalid_value"),
    ({"generation_token_ids": None}, "input.1.generation_token_ids",
     "missing_required_parameter"),
    ({"prompt_token_ids": []}, "input.1.prompt_token_ids", "invalid_value"),
])
def test_malformed_ids_are_400s_naming_the_field(serve, tokenizer, change, param, code):
    srv = with_ids(serve, tokenizer, [CALL, "never sampled"])
    tid, key = srv.session()
    (call,) = post(srv, key, {"input": [USER], "tools": [FLAT]}).json()["output"]
    bad = {k: v for k, v in {**call, **change}.items() if v is not None}
    r = post(srv, key, {"input": [USER, bad, tool_output(call)], "tools": [FLAT]})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == code
    assert len(srv.pool.get_trajectory(tid).completions) == 1 and len(srv.engine.calls) == 1


def test_ids_on_a_user_message_are_refused(serve, tokenizer):
    srv = with_ids(serve, tokenizer, ["never sampled"])
    _, key = srv.session()
    r = post(srv, key, {"input": [{**USER, "prompt_token_ids": [1], "generation_token_ids": [2]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.prompt_token_ids"
    assert srv.engine.calls == []


def test_streamed_final_items_carry_the_record(serve, tokenizer):
    srv = with_ids(serve, tokenizer, ["Sure. " + CALL])
    tid, key = srv.session()
    with httpx.stream("POST", f"{srv.base_url}/responses", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny", "input": [USER], "tools": [FLAT],
                            "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    (rec,) = srv.pool.get_trajectory(tid).completions
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    (final,) = [e["response"] for e in events if e["type"] == "response.completed"]
    assert [d["type"] for d in done] == ["message", "function_call"]
    assert {k: done[-1][k] for k in FIELDS} == carried(rec) == {
        k: final["output"][-1][k] for k in FIELDS}
    assert not any(k in done[0] for k in FIELDS)
