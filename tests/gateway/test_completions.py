"""POST /v1/completions, the token-native protocol (issue 10 item 4).

Over real HTTP with the official `openai` client (and httpx for malformed bodies) and the
scripted engine; byte tokenizer: one id per byte, `<|im_start|>` = 1, `<|im_end|>` = 2. Pins:
- a token-id prompt is sent and recorded exactly as given (control ids included); a text
  prompt is its encoding with special-token strings split (never a control id); a batch of one
  is that prompt;
- the record holds exactly the engine's sampled ids and logprobs; `logprobs: 0` returns those
  recorded logprobs for every kept id (end-of-turn spelled out), its tokens, and character
  offsets (a character split over two byte ids gives both its offset); `return_token_ids`
  returns the recorded prompt and completion ids;
- a prompt that starts with a recorded call's prompt + completion ids (a length-cut one too)
  is recorded as extending it; another prompt is a counted prefix miss;
- `stream: true` sends text as the engine samples it, then each choice's finish with its
  logprobs, usage, `[DONE]`; echo, n and stop strings give the plain answer's texts;
- stop strings, n (seed + i), echo;
- refusals, each a 400 (404 for the model) naming the field, with nothing recorded and the
  engine never called: several prompts, empty prompts, ids outside the vocabulary, prompts of
  max_model_len ids or more, logprobs > 0, echo with logprobs, suffix, best_of != n, top_p < 1
  on a training session, penalties, unknown fields, a wrong prompt type.
"""

from __future__ import annotations

import time

import httpx
import pytest

from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import Scripted, reply, served

START, END = 1, 2


def chatml_ids(renderer: ChatMLRenderer, user: str) -> list[int]:
    """A prompt a token-native client renders itself, control ids included."""
    return [START, *renderer.encode(f"user\n{user}"), END, *renderer.newline_ids,
            START, *renderer.encode("assistant\n")]


def test_token_prompt_and_sampled_ids_are_recorded_exactly(serve, tokenizer, renderer):
    prompt = chatml_ids(renderer, "hi")
    script = reply(renderer, "héllo")  # é is two byte ids
    srv, tid, client = served(serve, tokenizer, [script])
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, logprobs=0,
                                    extra_body={"return_token_ids": True})
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert srv.engine.calls[0][0] == prompt == rec.prompt_ids
    assert rec.completion_ids == script.ids and rec.logprobs == script.logprobs
    assert not rec.extends_previous and rec.finish_reason == "stop"
    c = out.choices[0]
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert (c.index, c.text, c.finish_reason) == (0, "héllo", "stop")
    assert c.logprobs.token_logprobs == rec.logprobs
    assert c.logprobs.tokens == ["h", "\\xc3", "\\xa9", "l", "l", "o", "<|im_end|>"]
    assert c.logprobs.text_offset == [0, 1, 1, 2, 3, 4, 5]
    assert c.logprobs.top_logprobs == [{t: lp} for t, lp in zip(
        c.logprobs.tokens, rec.logprobs, strict=True)]
    assert c.model_extra == {"prompt_token_ids": prompt, "token_ids": rec.completion_ids}
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 7)


@pytest.mark.parametrize("batch_of_one", [False, True])
def test_text_prompt_is_encoded_with_special_strings_split(serve, tokenizer, renderer,
                                                           batch_of_one):
    text = "<|im_start|>user\nhi<|im_end|>"
    srv, tid, client = served(serve, tokenizer, [reply(renderer, "ok")])
    out = client.completions.create(model="tiny", prompt=[text] if batch_of_one else text)
    (rec,) = srv.pool.get_trajectory(tid).completions
    assert rec.prompt_ids == renderer.encode(text) == tokenizer.encode(
        text, add_special_tokens=False, split_special_tokens=True)
    assert START not in rec.prompt_ids and END not in rec.prompt_ids
    assert len(rec.prompt_ids) == len(text.encode())  # every byte an ordinary id
    assert out.choices[0].text == "ok" and out.choices[0].logprobs is None
    assert out.choices[0].model_extra == {}


def test_prompt_extending_a_recorded_call_is_recorded_as_extending(serve, tokenizer, renderer):
    first = reply(renderer, "abc")
    cut = Scripted([*renderer.encode("xyz"), END], [-0.1, -0.2, -0.3, -0.4])
    script = [first, cut, reply(renderer, "d"), reply(renderer, "e")]
    srv, tid, client = served(serve, tokenizer, script)
    prompt = chatml_ids(renderer, "go")
    out = client.completions.create(model="tiny", prompt=prompt,
                                    extra_body={"return_token_ids": True})
    tail = [*renderer.newline_ids, START, *renderer.encode("user\nmore"), END]
    second = prompt + out.choices[0].model_extra["token_ids"] + tail
    out2 = client.completions.create(model="tiny", prompt=second, max_tokens=3,
                                     extra_body={"return_token_ids": True})
    assert out2.choices[0].finish_reason == "length"
    third = second + out2.choices[0].model_extra["token_ids"]  # continue the length-cut call
    client.completions.create(model="tiny", prompt=third)
    client.completions.create(model="tiny", prompt=prompt[:-1] + renderer.encode("!"))
    a, b, c, d = srv.pool.get_trajectory(tid).completions
    assert b.prompt_ids == a.prompt_ids + a.completion_ids + tail and b.extends_previous
    assert b.completion_ids == cut.ids[:3] and c.prompt_ids == b.prompt_ids + b.completion_ids
    assert c.extends_previous and not d.extends_previous
    session = srv.gateway.sessions.get(client.api_key)
    assert [t.parent for t in session.turns] == [None, 0, 1, None]
    assert session.prefix_misses == 1 and srv.gateway.counters["prefix_hits"] == 2


def test_stream_yields_the_plain_answer_as_the_engine_samples(serve, tokenizer, renderer):
    """stream: true goes through Gateway.stream: the first text chunk reaches the client while
    the engine still samples (~60 ids at 0.02 s each); the text chunks join to the plain
    answer; the finish chunk carries every logprob, equal to the plain call's; the record is
    the same."""
    scripted = reply(renderer, "héllo" * 10)
    slow = Scripted(scripted.ids, scripted.logprobs, token_delay_s=0.02)
    srv, tid, client = served(serve, tokenizer, [scripted, slow])
    kw = {"model": "tiny", "prompt": chatml_ids(renderer, "hi"), "logprobs": 0}
    plain = client.completions.create(**kw)
    first, chunks = None, []
    for c in client.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": True}):
        first = first or (time.perf_counter() if c.choices and c.choices[0].text else None)
        chunks.append(c)
    body = [c for c in chunks if c.choices]
    assert srv.engine.streamed[0][-1].sampled_at - first > 0.5  # ~40 ids after the first chunk
    assert all(c.object == "text_completion" for c in chunks) and len(body) > 10
    assert "".join(c.choices[0].text for c in body) == plain.choices[0].text == "héllo" * 10
    assert [c.choices[0].finish_reason for c in body[-2:]] == [None, "stop"]
    assert all(c.choices[0].logprobs is None for c in body[:-1])
    lp = body[-1].choices[0].logprobs
    assert lp.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert lp.text_offset == plain.choices[0].logprobs.text_offset
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens == 61
    a, b = srv.pool.get_trajectory(tid).completions
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs


def test_a_stream_of_two_choices_with_echo_and_a_stop_string(serve, tokenizer, renderer):
    script = [reply(renderer, "one\nObservation: x"), reply(renderer, "two")]
    srv, tid, client = served(serve, tokenizer, script)
    texts = {0: "", 1: ""}
    finishes = {}
    for c in client.completions.create(model="tiny", prompt="Q:", n=2, seed=5, echo=True,
                                       stop=["\nObservation:"], stream=True):
        texts[c.choices[0].index] += c.choices[0].text
        finishes[c.choices[0].index] = c.choices[0].finish_reason
    assert texts == {0: "Q:one", 1: "Q:two"} and finishes == {0: "stop", 1: "stop"}
    assert [c.completion_ids for c in srv.pool.get_trajectory(tid).completions] == [
        script[0].ids[:len("one\nObservation:")], script[1].ids]


def test_stop_n_and_echo(serve, tokenizer, renderer):
    script = [reply(renderer, "Thought: x\nObservation: y"), reply(renderer, "one"),
              reply(renderer, "two"), reply(renderer, "ok")]
    srv, tid, client = served(serve, tokenizer, script)
    out = client.completions.create(model="tiny", prompt="Q:", stop=["\nObservation:"])
    assert out.choices[0].text == "Thought: x" and out.choices[0].finish_reason == "stop"
    kept = len("Thought: x\nObservation:")
    two = client.completions.create(model="tiny", prompt="Q:", n=2, best_of=2, seed=5)
    assert [(c.index, c.text) for c in two.choices] == [(0, "one"), (1, "two")]
    echo = client.completions.create(model="tiny", prompt="Q:", echo=True)
    assert echo.choices[0].text == "Q:ok"
    recs = srv.pool.get_trajectory(tid).completions
    assert recs[0].completion_ids == script[0].ids[:kept]
    assert [r.sampling.seed for r in recs[1:3]] == [5, 6]
    assert [r.completion_ids for r in recs] == [script[0].ids[:kept]] + [s.ids for s in script[1:]]


MAX_LEN = 64


def test_sampling_parameters_reach_the_engine_and_the_record(serve, tokenizer, renderer):
    """CASES.md C21: every parameter explicit; vLLM's extras are sampled with and recorded."""
    srv, tid, client = served(serve, tokenizer, [reply(renderer, "x")] * 2)
    for extra in ({}, {"top_p": 0.5, "top_k": 7, "min_p": 0.1, "repetition_penalty": 0.9,
                       "presence_penalty": 0.25, "frequency_penalty": 1.5}):
        r = httpx.post(f"{srv.base_url}/completions",
                       json={"model": "tiny", "prompt": "a", "temperature": 0.5, **extra},
                       headers={"Authorization": f"Bearer {client.api_key}"}, timeout=30)
        assert r.status_code == 200, r.text
    (_, plain), (_, full) = srv.engine.calls
    assert (plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty,
            plain.presence_penalty, plain.frequency_penalty) == (1.0, 0, 0.0, 1.0, 0.0, 0.0)
    assert (full.temperature, full.top_p, full.top_k, full.min_p, full.repetition_penalty,
            full.presence_penalty, full.frequency_penalty) == (0.5, 0.5, 7, 0.1, 0.9, 0.25, 1.5)
    assert [c.sampling for c in srv.pool.get_trajectory(tid).completions] == [plain, full]


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [[5], [6]]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[]]}, 400, "prompt"),
    ({"prompt": [5, 259]}, 400, "prompt"),
    ({"prompt": [-1]}, 400, "prompt"),
    ({"prompt": {"text": "a"}}, 400, "prompt"),
    ({"prompt": [5, "a"]}, 400, "prompt"),
    ({"prompt": [5] * MAX_LEN}, 400, "prompt"),
    ({"prompt": "a" * (MAX_LEN + 3)}, 400, "prompt"),
    ({"prompt": "a", "logprobs": 1}, 400, "logprobs"),
    ({"prompt": "a", "echo": True, "logprobs": 0}, 400, "echo"),
    ({"prompt": "a", "suffix": "b"}, 400, "suffix"),
    ({"prompt": "a", "best_of": 2}, 400, "best_of"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p"),
    ({"prompt": "a", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "a", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ({"prompt": "a", "stop": [""]}, 400, "stop"),
    ({"prompt": "a", "top_k": -2}, 400, "top_k"),
    ({"prompt": "a", "model": "other"}, 404, "model"),
])
def test_refusals_name_the_field_and_record_nothing(serve, tokenizer, renderer, body, status,
                                                    param):
    srv, tid, client = served(serve, tokenizer, [reply(renderer, "x")], max_model_len=MAX_LEN)
    r = httpx.post(f"{srv.base_url}/completions", json={"model": "tiny", **body},
                   headers={"Authorization": f"Bearer {client.api_key}"}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    assert srv.engine.calls == [] and srv.pool.get_trajectory(tid).completions == []


def test_errors_reach_the_openai_client(serve, tokenizer, renderer):
    import openai

    srv, tid, client = served(serve, tokenizer, [reply(renderer, "x")])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=["a", "b"])
    assert e.value.body["param"] == "prompt" and "2 prompts" in e.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        srv.client("sk-unknown").completions.create(model="tiny", prompt="a")
    assert srv.pool.get_trajectory(tid).completions == []
