"""Token-in-token-out through the served gateway: multi-turn prompts reuse the sampled ids.

Pins: turn k+1's prompt starts with turn k's prompt + completion ids exactly as the engine
emitted them (CASES.md C01: a decoded-then-re-encoded reply would get other ids); the
assistant->tool boundary is end-of-turn, "\\n", im_start and the whole prompt equals a fresh
rendering with a byte tokenizer (C02); a context rewrite renders from scratch, as a new trace,
and is counted (C02); every prompt ends with the assistant generation header (C03); a reply
cut by max_tokens is closed with the end-of-turn id before the next turn; an engine answer
with text but no token ids (or ids without one logprob each) answers the text and is recorded
with no ids, not token-exact and out of the loss (C01).
"""

from __future__ import annotations

import json

import httpx
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


def _text_chunk(text: str, finish: str | None = None, ids: list[int] | None = None,
                lps: list[float] | None = None) -> dict:
    """A vLLM completions SSE chunk: text, and token ids / logprob entries only when given."""
    choice: dict = {"text": text, "finish_reason": finish, "logprobs": None}
    if ids is not None:
        choice["token_ids"] = ids
    if lps is not None:
        choice["logprobs"] = {"top_logprobs": [{f"token_id:{i}": lp}
                                               for i, lp in zip(ids or [], lps, strict=False)]}
    return {"choices": [choice]}


def test_c01_text_without_token_ids_is_answered_and_kept_out_of_the_loss(serve, tokenizer,
                                                                         renderer):
    """CASES.md C01: an engine that answers text without token ids (a server without
    `return_token_ids`; ids for the first chunk only; ids without one logprob each) is never a
    200 with an empty reply and an empty token-exact turn. The client gets the engine's text
    (plain and streamed); the turn is stored with no ids and no logprobs (nothing re-encoded or
    guessed), token_exact and train False, its text noted; the next prompt is rendered from the
    messages, not appended to an empty completion; the trainer gives it no loss token."""
    from forgerl.trainer.samples import trajectory_to_samples
    from tests.engines.test_remote_vllm import mocked, sse

    sure = renderer.encode("Sure,")
    answers = [
        sse(_text_chunk("Hel"), _text_chunk("lo!<|im_end|>", "stop")),  # no ids at all
        sse(_text_chunk("Sure,", None, sure, [-0.1] * len(sure)),  # ids, then none
            _text_chunk(" again.", "stop")),
        sse(_text_chunk("Bye.", "stop", [66, 121, 101, 46], [-0.5])),  # 4 ids, 1 logprob
        sse(_text_chunk("Ok", "stop", [*renderer.encode("Ok"), renderer.end_of_turn_id],
                        [-0.25, -0.5, -0.75]))]
    bodies: list[dict] = []

    def handler(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=answers[len(bodies) - 1])

    engine = mocked(handler)
    engine.max_model_len = 4096
    srv = serve(engine, tokenizer)
    tid, key = srv.session()
    client = srv.client(key)
    chat_history = [{"role": "user", "content": "say hi"}]
    r1 = client.chat.completions.create(model="tiny", messages=chat_history)
    assert (r1.choices[0].message.content, r1.choices[0].finish_reason) == ("Hello!", "stop")
    assert r1.usage.completion_tokens == 0
    chat_history += [{"role": "assistant", "content": "Hello!"},
                     {"role": "user", "content": "again"}]
    streamed = client.chat.completions.create(model="tiny", messages=chat_history, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (
        "Sure, again.")
    chat_history += [{"role": "assistant", "content": "Sure, again."},
                     {"role": "user", "content": "bye"}]
    r3 = client.chat.completions.create(model="tiny", messages=chat_history)
    assert r3.choices[0].message.content == "Bye."
    chat_history += [{"role": "assistant", "content": "Bye."},
                     {"role": "user", "content": "ok?"}]
    assert client.chat.completions.create(
        model="tiny", messages=chat_history).choices[0].message.content == "Ok"

    turns = srv.pool.get_trajectory(tid).completions
    assert [(c.completion_ids, c.logprobs, c.token_exact, c.train) for c in turns[:3]] == [
        ([], [], False, False)] * 3
    assert [c.request["untokenized_text"] for c in turns[:3]] == [
        "Hello!<|im_end|>", "Sure, again.", "Bye."]
    last = turns[3]
    assert last.completion_ids == [*renderer.encode("Ok"), renderer.end_of_turn_id]
    assert last.logprobs == [-0.25, -0.5, -0.75] and last.token_exact and last.train
    # each prompt is the fresh rendering of its messages (an untokenized turn is no prefix)
    for k, (body, c) in enumerate(zip(bodies, turns, strict=True)):
        assert body["prompt"] == c.prompt_ids == render(renderer, chat_history[: 1 + 2 * k])
    assert srv.gateway.counters["untokenized_replies"] == srv.engine.stats["untokenized"] == 3
    samples = trajectory_to_samples(srv.pool.get_trajectory(tid), [1.0] * 4)
    assert sum(sum(s.loss_mask) for s in samples) == 3  # only the token-exact turn's ids
    assert all(len(c.completion_ids) == len(c.logprobs) for c in turns)
