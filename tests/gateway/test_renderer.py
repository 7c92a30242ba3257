"""The ChatML renderer: messages (+ tools) -> token ids.

Pins: plain conversations equal `apply_chat_template` with a ChatML template on the byte
tokenizer, token for token; the default system turn is inserted only when none is given; the tool
section lists one JSON signature per line; assistant tool calls and grouped tool responses render
in the Hermes/Qwen2.5 layout; a rendering is the concatenation of its turns (what TITO relies on).
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forgerl.gateway.protocols import chat
from forgerl.gateway.renderers.renderer import ChatMLRenderer

from .conftest import CHATML, render

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "héllo 😀 <b>"},
    {"role": "assistant", "content": "hi\n\nthere"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}],
    },
]


def flat(messages):
    """Messages with list contents joined (the plain template only takes strings)."""
    join = lambda c: c if isinstance(c, str) else "".join(p["text"] for p in c)  # noqa: E731
    return [dict(m, content=join(m["content"])) for m in messages]


@pytest.fixture
def chatml_tokenizer(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML
    return tok


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_plain_messages_equal_chat_template(chatml_tokenizer, gen, n):
    msgs = CONVERSATION[:n]
    expected = chatml_tokenizer.apply_chat_template(flat(msgs), add_generation_prompt=gen)
    ids = render(ChatMLRenderer(chatml_tokenizer), msgs, add_generation_prompt=gen)
    assert ids == list(expected["input_ids"])
    assert (
        ids[-11:] == [1, *chatml_tokenizer.encode("assistant\n")] if gen else ids[-2:] == [2, 201]
    )


def test_default_system_inserted_only_when_missing(tokenizer):
    r = ChatMLRenderer(tokenizer, default_system="You are SmolLM.")
    user = [{"role": "user", "content": "hi"}]
    text = tokenizer.decode(render(r, user))
    assert text == (
        "<|im_start|>system\nYou are SmolLM.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    own = [{"role": "system", "content": "Mine."}, *user]
    assert tokenizer.decode(render(r, own)).startswith("<|im_start|>system\nMine.<|im_end|>\n")
    assert render(ChatMLRenderer(tokenizer), user)[:2] == [1, tokenizer.encode("u")[0]]


TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "description": "a+b"}},
]


def test_tool_section_and_tool_turns(tokenizer):
    r = ChatMLRenderer(tokenizer)
    msgs = [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "Let me see.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"id": 7}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "add", "arguments": {"a": 1}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "seven"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "1"}]},
    ]
    text = tokenizer.decode(render(r, msgs, TOOLS))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nSys.\n\n# Tools\n")
    block = system.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in block.split("\n")] == [t["function"] for t in TOOLS]
    assert (
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n' in system
    )
    assert text.split("<|im_end|>\n", 2)[2] == (
        "<|im_start|>assistant\nLet me see.\n"
        '<tool_call>\n{"name": "lookup", "arguments": {"id": 7}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nseven\n</tool_response>\n"
        "<tool_response>\n1\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # tools without a system message get a system turn holding only the tool section
    alone = tokenizer.decode(render(r, msgs[1:2], TOOLS))
    assert alone.startswith("<|im_start|>system\n# Tools\n")


def test_rendering_is_concatenation_of_turns(tokenizer):
    r = ChatMLRenderer(tokenizer, default_system="d")
    msgs = [*CONVERSATION[1:], {"role": "assistant", "content": "x"}]
    full = render(r, msgs, TOOLS)
    head = render(r, msgs[:2], TOOLS, add_generation_prompt=False)
    assert full == head + r.render_turns(chat.messages(msgs)[2:]) + r.generation_prompt_ids
    assert r.end_of_turn_id == 2 and r.start_of_turn_id == 1 and r.newline_ids == [201]


SMOLLM2 = Path(os.environ.get("FORGERL_CACHE") or Path.home() / ".cache" / "forgerl")
SMOLLM2 = SMOLLM2 / "smollm2-135m-instruct"


@pytest.mark.smollm2
def test_smollm2_tokenizer_matches_its_own_template():
    if not SMOLLM2.exists():
        pytest.skip(f"SmolLM2 cache {SMOLLM2} absent (run the set-up script)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2)  # the tokenizer only; no weights are loaded
    msgs = [*CONVERSATION[:3], {"role": "user", "content": "ok"}]
    expected = tok.apply_chat_template(msgs, add_generation_prompt=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert render(ChatMLRenderer(tok), msgs) == expected


@pytest.mark.smollm2
@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["#" * 80, "\n" + " " * 80, "=" * 65, " the", "é", "😀", "ab",
                                 "\u0301", "ﬁ", "<|im_end|>", "\t"]), max_size=60)
       | st.text(max_size=400))
def test_min_tokens_never_exceeds_the_real_count(pieces):
    """`Renderer.min_tokens` (the gateway refuses a message over max_model_len without
    tokenizing it) is a lower bound of the real token count on SmolLM2's tokenizer, also for
    its longest tokens ("#" x 80, newline + 80 spaces), combining and folded characters."""
    if not SMOLLM2.exists():
        pytest.skip(f"SmolLM2 cache {SMOLLM2} absent (run the set-up script)")
    r = _smollm2_renderer()
    assert r.max_token_chars == 81
    text = pieces if isinstance(pieces, str) else "".join(pieces)
    assert r.min_tokens([text]) <= len(r.encode(text))
    assert r.min_tokens([text, text]) <= 2 * len(r.encode(text))
    assert r.min_tokens(["#" * 80 * 400]) == 197  # 400 tokens in fact


@functools.cache
def _smollm2_renderer() -> ChatMLRenderer:
    from transformers import AutoTokenizer

    return ChatMLRenderer(AutoTokenizer.from_pretrained(SMOLLM2))


@pytest.mark.smollm2
@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_token_bytes_join_to_the_text(text):
    """`Renderer.token_bytes` (an OpenAI logprob's `bytes`) gives each token's own bytes, so
    the tokens of any text, emoji and split characters included, join to its UTF-8 bytes; on
    SmolLM2's byte-level BPE and on the byte tokenizer, where "é" is two tokens [0xC3], [0xA9].
    (SmolLM2 drops bytes its vocabulary lacks, such as 0xF1 of U+40000: no text to join to.)"""
    if not SMOLLM2.exists():
        pytest.skip(f"SmolLM2 cache {SMOLLM2} absent (run the set-up script)")
    from forgerl.models import build_byte_tokenizer

    for r in (_smollm2_renderer(), ChatMLRenderer(build_byte_tokenizer())):
        text_ids = r.encode(text)
        if r.decode(text_ids) == text:  # SmolLM2's vocabulary lacks a few bytes (0xF1)
            assert b"".join(r.token_bytes(i) for i in text_ids) == text.encode()
        assert r.token_bytes(r.end_of_turn_id) == b"<|im_end|>"
    byte = ChatMLRenderer(build_byte_tokenizer())
    assert [byte.token_bytes(i) for i in byte.encode("é")] == [b"\xc3", b"\xa9"]
