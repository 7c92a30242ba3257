"""Session turn trees without HTTP: which recorded turn a new request extends.

Pins: the most recent turn whose messages are a true message-level prefix and whose parsed reply
equals the next message is extended with its exact ids (CASES.md C01/C02); a changed earlier
message, a different reply, or changed tools render from scratch and count as a miss; a branch
can extend an older turn (the tree, not a list); keys are unique and closing forgets them.
"""

from __future__ import annotations

from forgerl.gateway.renderer import ChatMLRenderer
from forgerl.gateway.sessions import SessionStore, Turn, message_key

U1 = {"role": "user", "content": "a"}
U2 = {"role": "user", "content": "b"}


def answer(session, renderer, messages, completion_ids, assistant, tools=None):
    plan = session.plan(messages, tools, renderer)
    session.record(
        Turn(messages, tools, plan.prompt_ids, completion_ids, assistant, plan.parent),
        plan.extends_previous,
    )
    return plan


def test_extends_most_recent_matching_turn_and_branches(tokenizer):
    r = ChatMLRenderer(tokenizer)
    store = SessionStore()
    key = store.create("t0", temperature=0.5)
    s = store.get(key)
    assert (s.trajectory_id, s.temperature, s.max_tokens, s.training) == ("t0", 0.5, None, True)
    x_ids = [*r.encode("x"), r.end_of_turn_id]
    p0 = answer(s, r, [U1], x_ids, {"role": "assistant", "content": "x"})
    assert (p0.parent, p0.extends_previous) == (None, False)
    reply_x = {"role": "assistant", "content": " x \n"}  # whitespace differs: same turn
    p1 = answer(s, r, [U1, reply_x, U2], [*r.encode("y")], {"role": "assistant", "content": "y"})
    assert (p1.parent, p1.extends_previous) == (0, True)
    assert p1.prompt_ids[: len(p0.prompt_ids) + 2] == p0.prompt_ids + x_ids
    # branch: the agent goes back to turn 0 and asks something else: extends turn 0 again
    p2 = s.plan([U1, reply_x, {"role": "user", "content": "c"}], None, r)
    assert (p2.parent, p2.extends_previous) == (0, True)
    # turn 1 ended without <|im_end|> (finish "length"): it is closed before the next turn
    msgs = [U1, reply_x, U2, {"role": "assistant", "content": "y"}, U1]
    p3 = s.plan(msgs, None, r)
    n = len(p1.prompt_ids) + 1
    assert p3.parent == 1 and p3.prompt_ids[: n + 2] == [*p1.prompt_ids, *r.encode("y"), 2, 201]
    # the reused ids are the recorded reply "x", not the agent's whitespace variant
    assert p3.prompt_ids == r.render([U1, {"role": "assistant", "content": "x"}, *msgs[2:]])
    assert s.prefix_misses == 0


def test_mismatches_render_fresh_and_count(tokenizer):
    r = ChatMLRenderer(tokenizer)
    store = SessionStore()
    s = store.get(store.create("t1"))
    answer(s, r, [U1], [*r.encode("x"), 2], {"role": "assistant", "content": "x"})
    for msgs, tools in [
        ([U2, {"role": "assistant", "content": "x"}, U1], None),  # earlier message changed
        ([U1, {"role": "assistant", "content": "z"}, U2], None),  # reply rewritten
        ([U1, {"role": "assistant", "content": "x"}, U2], [{"function": {"name": "f"}}]),
    ]:
        plan = s.plan(msgs, tools, r)
        assert plan == plan.__class__(r.render(msgs, tools), None, False)
    answer(s, r, [U2], [2], {"role": "assistant", "content": ""})
    assert s.prefix_misses == 1


def test_message_key_compares_tool_calls_by_parsed_arguments():
    def call(args):
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": args}}],
        }

    assert message_key(call('{"a": 1, "b": 2}')) == message_key(call({"b": 2, "a": 1}))
    assert message_key(call('{"a": 1}')) != message_key(call('{"a": 2}'))
    assert message_key({"role": "user", "content": [{"type": "text", "text": " hi "}]}) == (
        message_key({"role": "user", "content": "hi"})
    )


def test_store_keys_are_unique_and_close_forgets():
    store = SessionStore()
    keys = {store.create(f"t{i}") for i in range(50)}
    assert len(keys) == 50 == len(store) and all(k.startswith("sk-forgerl-") for k in keys)
    key = next(iter(keys))
    tid = store.get(key).trajectory_id
    assert store.find(tid).api_key == key
    assert store.close(key).trajectory_id == tid
    assert store.get(key) is None and store.close(key) is None and len(store) == 49
