"""Token-in-token-out through the served gateway: multi-turn prompts reuse the sampled ids.

Pins: turn k+1's prompt starts with turn k's prompt + completion ids exactly as the engine
emitted them (CASES.md C01: a decoded-then-re-encoded reply would get other ids); the
assistant->tool boundary is end-of-turn, "\\n", im_start and the whole prompt equals a fresh
rendering with a byte tokenizer (C02); a context rewrite renders from scratch, as a new trace,
and is counted (C02); every prompt ends with the assistant generation header (C03); a reply
cut by max_tokens is closed with the end-of-turn id before the next turn.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from forgerl.gateway.protocols import chat
from forgerl.models import CHATML_SPECIAL

from .conftest import Scripted, ScriptedEngine, render, reply


def merge_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with merges h+e, l+l, ll+o, he+llo: encode("hello") is the single id 262,
    while the ids of "he" (259) and "llo" (261) also decode to "hello"."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(CHATML_SPECIAL + alphabet + ["he", "ll", "llo", "hello"])}
    merges = [("h", "e"), ("l", "l"), ("ll", "o"), ("he", "llo")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(CHATML_SPECIAL)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def test_c01_sampled_ids_are_reused_not_reencoded(serve):
    tok = merge_tokenizer()
    assert tok.encode("hello", add_special_tokens=False) == [262]
    assert tok.decode([259, 261]) == "hello"
    end = 2
    engine = ScriptedEngine(
        [
            Scripted([259, 261, end], [-0.5, -0.7, -0.1]),
            Scripted([259, 261, end], [-0.2, -0.3, -0.4]),
        ]
    )
    srv = serve(engine, tok)
    tid, key = srv.session()
    client = srv.client(key)
    r1 = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "say hi"}]
    )
    assert r1.choices[0].message.content == "hello"
    turn2 = [
        {"role": "user", "content": "say hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "tool", "content": "42", "tool_call_id": "x"},
    ]
    client.chat.completions.create(model="tiny", messages=turn2)

    traj = srv.pool.get_trajectory(tid)
    first, second = traj.completions
    assert first.completion_ids == [259, 261, 2] and first.logprobs == [-0.5, -0.7, -0.1]
    p1 = engine.calls[0][0]
    p2 = engine.calls[1][0]
    assert first.prompt_ids == p1 and second.prompt_ids == p2
    assert p2[: len(p1) + 3] == [*p1, 259, 261, 2]
    tail = srv.renderer.encode("\n") + srv.renderer.render_turns(chat.messages(turn2)[2:])
    assert p2 == [*p1, 259, 261, 2, *tail, *srv.renderer.generation_prompt_ids]
    assert all(262 not in c.prompt_ids + c.completion_ids for c in traj.completions)
    assert second.extends_previous and not first.extends_previous
    assert srv.gateway.sessions.get(key).prefix_misses == 0
    assert all(len(c.completion_ids) == len(c.logprobs) for c in traj.completions)


def scripted_session(serve, tokenizer, texts: list[str]):
    """A served gateway whose engine answers `texts` in order, and one open session on it:
    (renderer, served gateway, trajectory id, openai client for the session)."""
    from forgerl.gateway.renderers.renderer import ChatMLRenderer

    renderer = ChatMLRenderer(tokenizer)
    srv = serve(ScriptedEngine([reply(renderer, t) for t in texts]), tokenizer)
    tid, key = srv.session()
    return renderer, srv, tid, srv.client(key)


def tool_call_text(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_c02_tool_boundary_matches_fresh_rendering(serve, tokenizer):
    texts = [tool_call_text("get_weather", {"city": "Paris"}), "It is sunny."]
    renderer, srv, tid, client = scripted_session(serve, tokenizer, texts)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r1 = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    call = r1.choices[0].message.tool_calls[0]
    assert r1.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [
        r1.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])

    first, second = srv.pool.get_trajectory(tid).completions
    boundary = len(first.prompt_ids) + len(first.completion_ids)
    end, nl, start = renderer.end_of_turn_id, renderer.encode("\n"), renderer.start_of_turn_id
    assert nl == [201]  # byte tokenizer: "\n" is byte 10 -> GPT-2 alphabet char 'Ċ'
    assert second.prompt_ids[boundary - 1 : boundary + 2] == [end, 201, start] == [2, 201, 1]
    assert second.prompt_ids == render(renderer, messages, [WEATHER])
    assert second.extends_previous


def test_c02_context_rewrite_is_counted_and_rendered_fresh(serve, tokenizer):
    """A rewrite of the session's own conversation (its opening kept: system prompt and first
    user message) renders fresh as a new trace and counts as a prefix miss; a side call with
    its own system prompt is a new trace too, but no miss."""
    renderer, srv, tid, client = scripted_session(serve, tokenizer, ["Paris", "Madrid", "T"])
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "France?"}]
    client.chat.completions.create(model="tiny", messages=first)
    rewritten = [*first, {"role": "assistant", "content": "(summary) Paris"},
                 {"role": "user", "content": "Spain?"}]
    client.chat.completions.create(model="tiny", messages=rewritten)
    side = [{"role": "system", "content": "You are a title generator."}, first[1]]
    client.chat.completions.create(model="tiny", messages=side)
    _, second, third = srv.pool.get_trajectory(tid).completions
    assert second.prompt_ids == render(renderer, rewritten)
    assert not second.extends_previous and not third.extends_previous
    assert [c.trace for c in srv.pool.get_trajectory(tid).completions] == [0, 1, 2]
    assert srv.gateway.sessions.get(client.api_key).prefix_misses == 1
    assert srv.gateway.counters["prefix_misses"] == 1 and srv.gateway.counters["traces"] == 3


def test_c03_later_turn_ends_with_generation_header(serve, tokenizer):
    _renderer, srv, tid, client = scripted_session(serve, tokenizer, ["Paris", "Madrid"])
    m = [{"role": "user", "content": "capital of France?"}]
    client.chat.completions.create(model="tiny", messages=m)
    m += [
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "capital of Spain?"},
    ]
    r2 = client.chat.completions.create(model="tiny", messages=m)
    assert r2.choices[0].message.content == "Madrid"
    second = srv.pool.get_trajectory(tid).completions[1]
    header = [1, *tokenizer.encode("assistant\n", add_special_tokens=False)]
    assert second.prompt_ids[-len(header) :] == header
    assert tokenizer.decode(second.prompt_ids[-19:]) == "Spain?<|im_end|>\n<|im_start|>assistant\n"
    assert second.extends_previous


def test_truncated_reply_is_closed_before_next_turn(serve, tokenizer):
    renderer, srv, tid, client = scripted_session(serve, tokenizer, ["abcdefgh", "ok"])
    m = [{"role": "user", "content": "letters"}]
    r1 = client.chat.completions.create(model="tiny", messages=m, max_tokens=4)
    assert r1.choices[0].finish_reason == "length" and r1.choices[0].message.content == "abcd"
    m += [{"role": "assistant", "content": "abcd"}, {"role": "user", "content": "more"}]
    client.chat.completions.create(model="tiny", messages=m)
    first, second = srv.pool.get_trajectory(tid).completions
    assert first.completion_ids == tokenizer.encode("abcd", add_special_tokens=False)
    n = len(first.prompt_ids) + 4
    assert second.prompt_ids[: n + 2] == first.prompt_ids + first.completion_ids + [2, 201]
    assert second.prompt_ids == render(renderer, m) and second.extends_previous
