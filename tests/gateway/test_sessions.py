"""Session turn trees without HTTP: which recorded turn a new request extends.

Pins: the most recent turn whose messages are a true message-level prefix and whose parsed reply
equals the next message is extended with its exact ids (CASES.md C01/C02); a changed earlier
message, a different reply, or changed tools render from scratch and count as a miss; a branch
can extend an older turn (the tree, not a list); the n choices of one call are sibling turns
in one trace and count one miss at most; a call that extends no turn starts a trace, a miss
only with the opening of an earlier trace; keys are unique and closing forgets them. Messages
are the internal form (conversation.py).
"""

from __future__ import annotations

from forgerl.gateway.conversation import Message, Tool, ToolCall
from forgerl.gateway.renderers.renderer import ChatMLRenderer
from forgerl.gateway.sessions import SessionStore, Turn, message_key

U1 = Message("user", "a")
U2 = Message("user", "b")


def said(text: str) -> Message:
    return Message("assistant", text)


def answer(session, renderer, messages, completion_ids, assistant, tools=()):
    plan = session.plan(messages, tools, renderer)
    place = session.place(plan, messages)
    session.record(
        [Turn(messages, tools, plan.prompt_ids, completion_ids, assistant, plan.parent,
              place.trace)],
        place.miss,
    )
    return plan


def test_extends_most_recent_matching_turn_and_branches(tokenizer):
    r = ChatMLRenderer(tokenizer)
    store = SessionStore()
    key = store.create("t0", temperature=0.5)
    s = store.get(key)
    assert (s.trajectory_id, s.temperature, s.max_tokens, s.training) == ("t0", 0.5, None, True)
    x_ids = [*r.encode("x"), r.end_of_turn_id]
    p0 = answer(s, r, [U1], x_ids, said("x"))
    assert (p0.parent, p0.extends_previous) == (None, False)
    reply_x = said(" x \n")  # whitespace differs: same turn
    p1 = answer(s, r, [U1, reply_x, U2], [*r.encode("y")], said("y"))
    assert (p1.parent, p1.extends_previous) == (0, True)
    assert p1.prompt_ids[: len(p0.prompt_ids) + 2] == p0.prompt_ids + x_ids
    # branch: the agent goes back to turn 0 and asks something else: extends turn 0 again
    p2 = s.plan([U1, reply_x, Message("user", "c")], (), r)
    assert (p2.parent, p2.extends_previous) == (0, True)
    # turn 1 ended without <|im_end|> (finish "length"): it is closed before the next turn
    msgs = [U1, reply_x, U2, said("y"), U1]
    p3 = s.plan(msgs, (), r)
    n = len(p1.prompt_ids) + 1
    assert p3.parent == 1 and p3.prompt_ids[: n + 2] == [*p1.prompt_ids, *r.encode("y"), 2, 201]
    # the reused ids are the recorded reply "x", not the agent's whitespace variant
    assert p3.prompt_ids == r.render([U1, said("x"), *msgs[2:]])
    assert s.prefix_misses == 0


def test_mismatches_render_fresh_and_count(tokenizer):
    r = ChatMLRenderer(tokenizer)
    store = SessionStore()
    s = store.get(store.create("t1"))
    answer(s, r, [U1], [*r.encode("x"), 2], said("x"))
    for msgs, tools in [
        ([U2, said("x"), U1], ()),  # earlier message changed
        ([U1, said("z"), U2], ()),  # reply rewritten
        ([U1, said("x"), U2], (Tool("f"),)),
    ]:
        plan = s.plan(msgs, tools, r)
        assert plan == plan.__class__(r.render(msgs, tools), None, False)
    answer(s, r, [U1, said("z"), U2], [2], said(""))  # its own conversation, rewritten: a miss
    answer(s, r, [U2], [2], said(""))  # another opening (a side call): a new trace, no miss
    answer(s, r, [U2, said(""), U1], [2], said(""))  # extends the side call: joins its trace
    assert [t.trace for t in s.turns] == [0, 1, 2, 2] and s.prefix_misses == 1
    assert [k for k, _ in s.traces] == [(message_key(U1),), (message_key(U1),),
                                        (message_key(U2),)]


def test_message_key_compares_tool_calls_by_parsed_arguments():
    def call(args):
        return Message("assistant", "", (ToolCall("f", args, "call_1"),))

    assert message_key(call('{"a": 1, "b": 2}')) == message_key(call('{"b": 2, "a": 1}'))
    assert message_key(call('{"a": 1}')) != message_key(call('{"a": 2}'))
    assert message_key(call("")) == message_key(call("{}"))
    assert message_key(Message("user", " hi ")) == message_key(Message("user", "hi"))
    assert message_key(Message("assistant", "x", reasoning="r")) == message_key(said("x"))


def test_choices_of_one_call_are_sibling_turns(tokenizer):
    r = ChatMLRenderer(tokenizer)
    store = SessionStore()
    s = store.get(store.create("t2"))
    answer(s, r, [U1], [*r.encode("x"), 2], said("x"))
    rewrite = [U1, said("w"), U2]
    plan = s.plan(rewrite, (), r)  # a rewrite: one miss for the whole call, one trace
    place = s.place(plan, rewrite)
    s.record([Turn(rewrite, (), plan.prompt_ids, [*r.encode(t), 2], said(t), plan.parent,
                   place.trace) for t in ("p", "q", "s")], place.miss)
    assert s.prefix_misses == 1 and len(s.turns) == 4 and place.trace == 1
    # the agent continues from the second choice: its ids are reused, in the same trace
    follow = s.plan([*rewrite, said("q"), U1], (), r)
    assert follow.parent == 2 and follow.extends_previous
    assert s.place(follow, rewrite).trace == 1 and len(s.traces) == 2
    assert follow.prompt_ids[: len(plan.prompt_ids) + 2] == [*plan.prompt_ids, *r.encode("q"), 2]


def test_store_keys_are_unique_and_close_forgets():
    store = SessionStore()
    keys = {store.create(f"t{i}") for i in range(50)}
    assert len(keys) == 50 == len(store) and all(k.startswith("sk-forgerl-") for k in keys)
    key = next(iter(keys))
    tid = store.get(key).trajectory_id
    assert store.find(tid).api_key == key
    assert store.close(key).trajectory_id == tid
    assert store.get(key) is None and store.close(key) is None and len(store) == 49
