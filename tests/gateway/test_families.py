"""Differential tests of the gateway against the model families' real chat templates (issue 47).

Per family built by scripts/families.py (tests/families.py; a missing one is a skip): over
hypothesis-generated multi-turn conversations (system messages first and later, user text with
control-token text, assistant text, reasoning, 1-3 tool calls with nested JSON arguments, tool
results, tools declared when the template has a tool section) the renderer's prompt ids equal
`apply_chat_template` of the same conversation; where content holds control-token text the
documented rule holds instead: the template's text, split at the template's own added tokens,
each text piece encoded with control strings as plain text. Turn k+1 extends turn k's prompt +
completion id for id, or the renderer reports a rewrite (`continuation` None) and the
rewrite is real. Stop ids equal the template's end-of-turn token + the generation config's eos
ids; BOS appears once where the template writes it, never twice. A two-turn session through the
real app and the `openai` client records exactly the template's ids.
"""

from __future__ import annotations

import copy
import functools
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from forgerl.gateway.errors import GatewayError
from forgerl.gateway.protocols import chat
from forgerl.gateway.renderers.templates import (
    END_OF_TURN_TOKENS,
    HFTemplateRenderer,
    build_renderer,
)
from tests.families import NAMES, ROOT, Family, load
from tests.gateway.conftest import Scripted, ScriptedEngine

CONTROL = ["<|im_end|>", "<|im_start|>", "<|eot_id|>", "<think>", "</think>",
           "<tool_call>", "[INST]", "<turn|>", "<|end|>", "<|user|>", "</s>", "<s>"]
"""Control-token text clients put in content (prompt injection, pasted logs)."""

STOPS = {  # hand-read from each family's template + tokenizer + generation_config.json
    "qwen2.5": {151645, 151643}, "qwen3": {151645, 151643}, "deepseek-r1-qwen": {151643},
    "llama3.1": {128009, 128008, 128001}, "phi3.5": {32007, 32001, 32000},
    "gemma4": {106, 1, 50}}  # Gemma 4's template ends a tool-call turn with <|tool_response> (50)

WORD = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Co")), max_size=12)
PLAIN = st.lists(st.one_of(WORD, st.sampled_from(["\n", " ", "  x", "é", "日本", "\t"])),
                 max_size=4).map("".join)
TEXT = st.lists(st.one_of(WORD, st.sampled_from(CONTROL)), min_size=1, max_size=5).map("".join)
JSON = st.recursive(st.one_of(st.integers(-5, 10**6), st.booleans(), st.none(), PLAIN),
                    lambda kids: st.one_of(st.lists(kids, max_size=3),
                                           st.dictionaries(st.sampled_from("abcxyz"), kids,
                                                           max_size=3)), max_leaves=6)
ARGS = st.dictionaries(st.sampled_from(["city", "q", "opts", "n"]), JSON, min_size=1, max_size=3)
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} tool", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "description": "a city"},
                                         "opts": {"type": "object"}}, "required": ["city"]}}}
    for name in ("get_weather", "search")]


@st.composite
def conversations(draw, tools: bool) -> list[dict]:
    """A chat conversation ending with a user message: exchanges of user, assistant (text,
    reasoning, or 1-3 tool calls answered by tool results, then text), systems anywhere."""
    msgs: list[dict] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(TEXT)})
    n = 0
    for _ in range(draw(st.integers(1, 3))):
        if msgs and draw(st.integers(0, 5)) == 0:
            msgs.append({"role": "system", "content": draw(TEXT)})
        msgs.append({"role": "user", "content": draw(TEXT)})
        if tools and draw(st.booleans()):
            calls = []
            for _ in range(draw(st.integers(1, 3))):
                n += 1
                calls.append({"id": f"call{n:05d}", "type": "function", "function": {
                    "name": draw(st.sampled_from(["get_weather", "search"])),
                    "arguments": json.dumps(draw(ARGS), ensure_ascii=False)}})
            msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
            msgs += [{"role": "tool", "tool_call_id": c["id"], "content": draw(TEXT)}
                     for c in calls]
        reply = {"role": "assistant", "content": draw(PLAIN) + "ok"}
        if draw(st.booleans()):
            reply["reasoning_content"] = draw(PLAIN) + "because"
        msgs.append(reply)
    msgs.append({"role": "user", "content": draw(TEXT)})
    return msgs


def family(name: str) -> tuple[Family, HFTemplateRenderer]:
    fam = load(name)
    r = build_renderer(fam.tokenizer, eos_ids=fam.eos_ids)
    assert isinstance(r, HFTemplateRenderer)
    return fam, r


def as_template(msgs: list[dict], late_system: bool) -> list[dict]:
    """What the template is documented to see: arguments as objects, content None as "" and,
    for templates that take one system message only first, `fit_system`'s rule."""
    out = copy.deepcopy(msgs)
    for m in out:
        m["content"] = m["content"] or ""
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    if late_system:
        return out
    lead = next((k for k, m in enumerate(out) if m["role"] != "system"), len(out))
    head = [{"role": "system", "content": "\n\n".join(m["content"] for m in out[:lead])}]
    return head[:1 if lead else 0] + [
        {"role": "user", "content": "[system] " + m["content"]} if m["role"] == "system" else m
        for m in out[lead:]]


@functools.cache
def plain_encoder(name: str) -> Tokenizer:
    """The family's tokenizer with no added tokens at all: encodes any text as plain text."""
    data = json.loads(load(name).tokenizer.backend_tokenizer.to_str())
    data["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(data))


def expected_ids(fam: Family, msgs: list[dict], tools: list[dict] | None,
                 gen: bool = True, **variables) -> list[int]:
    """The documented rule, computed apart from the gateway: control strings in content are
    swapped for private-use characters, the template's text is split at the tokenizer's added
    tokens (each one id), and each text piece, control strings restored, is encoded as plain
    text (no added token matched). Without control text in content: `apply_chat_template`."""
    tok = fam.tokenizer
    control = {t.content for t in tok.added_tokens_decoder.values()
               if t.special or t.content in tok.chat_template}
    written = [c for c in sorted(control, key=len, reverse=True)  # longest first: nested names
               if any(c in m["content"] for m in msgs)]
    marks = {c: chr(0xE000 + k) for k, c in enumerate(written)}
    swapped = copy.deepcopy(msgs)
    for m in swapped:
        for c, mark in marks.items():
            m["content"] = m["content"].replace(c, mark)
    text = tok.apply_chat_template(swapped, tools=tools, add_generation_prompt=gen,
                                   tokenize=False, **variables)
    added = sorted(tok.get_added_vocab(), key=len, reverse=True)
    restore = {mark: c for c, mark in marks.items()}
    plain = plain_encoder(fam.name)
    newline = plain.encode("\n", add_special_tokens=False).ids

    def mid(text: str) -> list[int]:  # no SentencePiece prefix space: encoded after a newline
        ids = plain.encode("\n" + text, add_special_tokens=False).ids
        if ids[: len(newline)] == newline:
            return ids[len(newline):]
        return plain.encode(text, add_special_tokens=False).ids  # the newline merged

    ids: list[int] = []
    cuts = "(" + "|".join([*map(re.escape, added), *restore]) + ")"
    after_mark = False
    for piece in re.split(cuts, text):
        if piece in tok.get_added_vocab():
            ids.append(tok.convert_tokens_to_ids(piece))
        elif piece in restore:
            ids += mid(restore[piece])
        elif piece:
            ids += mid(piece) if after_mark else plain.encode(piece, add_special_tokens=False).ids
        after_mark = piece in restore if piece else after_mark
    return ids


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_prompt_ids_equal_the_template(name, data):
    fam, r = family(name)
    tools = TOOLS if "tools" in r.template else None
    msgs = data.draw(conversations(tools is not None))
    ref = as_template(msgs, r.late_system)
    try:
        want = expected_ids(fam, ref, tools)
    except Exception as e:  # the template refuses it: so must the gateway, with a 400
        with pytest.raises(GatewayError) as err:
            r.render(chat.messages(msgs), chat.tools(tools or []))
        assert err.value.status == 400, e
        return
    got = r.render(chat.messages(msgs), chat.tools(tools or []))
    assert fam.tokenizer.decode(got) == fam.tokenizer.decode(want)
    assert got == want
    if not any(t.content in m["content"] for m in ref
               for t in fam.tokenizer.added_tokens_decoder.values()):
        assert got == fam.tokenizer.apply_chat_template(
            ref, tools=tools, add_generation_prompt=True, return_dict=False)


@pytest.mark.parametrize("name", ["qwen3", "gemma4"])
@pytest.mark.parametrize("thinking", [False, True])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_prompt_ids_with_thinking_on_and_off(name, thinking, data):
    """Reasoning turned on and off (`enable_thinking`, a chat template variable the gateway
    takes as `chat_template_kwargs`): the bound renderer's ids equal the template's with it."""
    fam, r = family(name)
    bound = r.bind({"enable_thinking": thinking})
    tools = TOOLS if "tools" in r.template else None
    msgs = data.draw(conversations(tools is not None))
    ref = as_template(msgs, bound.late_system)
    try:
        want = expected_ids(fam, ref, tools, enable_thinking=thinking)
    except Exception:  # the template refuses it (checked by test_prompt_ids_equal_the_template)
        return
    assert bound.render(chat.messages(msgs), chat.tools(tools or [])) == want
    assert want != expected_ids(fam, ref, tools, enable_thinking=not thinking)  # it matters


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_next_turn_extends_the_recorded_ids_or_is_a_real_rewrite(name, data):
    """Token-in-token-out: for each assistant reply in a conversation, prompt + the reply's
    ids (as the template renders them, up to its end-of-turn id; GLM: the next turn's opening
    stop id, the one the model samples) + `continuation` is the rendering of the longer
    conversation; None only when that rendering really does not start with prompt + reply
    (the template rewrote an earlier turn, or GLM opens the next turn with no stop id)."""
    _, r = family(name)
    tools = TOOLS if "tools" in r.template else None
    msgs = chat.messages(data.draw(conversations(tools is not None)))
    tl = chat.tools(tools or [])
    for j, m in enumerate(msgs):
        if m.role != "assistant" or j + 1 >= len(msgs) or msgs[j + 1].role == "assistant":
            continue
        nxt = next((k for k in range(j + 1, len(msgs)) if msgs[k].role == "assistant"),
                   len(msgs))
        try:
            prompt = r.render(msgs[:j], tl)
            before = r.render(msgs[: j + 1], tl, add_generation_prompt=False)
            after = r.render(msgs[:nxt], tl)
        except GatewayError:
            return  # refused: covered by test_prompt_ids_equal_the_template
        if before[: len(prompt)] != prompt:
            assert r.continuation(msgs[: j + 1], msgs[j + 1 : nxt], tl, []) is None
            continue
        ends = [k for k in range(len(prompt), len(before)) if before[k] in r.stop_ids]
        if ends:
            reply = before[len(prompt) : ends[0] + 1]
        else:  # a template that closes no turn (GLM): the reply ends with the next opener
            opener = after[len(before)] if len(after) > len(before) else None
            reply = [*before[len(prompt) :],
                     opener if opener in r.stop_ids else r.end_of_turn_id]
        cont = r.continuation(msgs[: j + 1], msgs[j + 1 : nxt], tl, reply)
        if cont is None:
            assert after[: len(prompt) + len(reply)] != prompt + reply
        else:
            assert prompt + reply + cont == after


@pytest.mark.parametrize("name", NAMES)
def test_stop_ids_are_the_familys_end_tokens(name):
    """The template's end-of-turn token, the generation config's eos ids, the tokenizer's eos
    and (stand-in vocabs) END_OF_TURN_TOKENS the vocabulary has; for real vocabs the set
    read by hand from the family's files (Llama 3.1: <|eot_id|>, <|eom_id|>, <|end_of_text|>)."""
    fam, r = family(name)
    tok = fam.tokenizer
    assert r.stop_ids[0] == r.end_of_turn_id
    assert set(fam.eos_ids) <= set(r.stop_ids)
    if name in STOPS:
        assert set(r.stop_ids) == STOPS[name]
    else:
        assert fam.meta["vocab"] == "stand-in"
        vocab = tok.get_vocab()
        assert set(r.stop_ids) == {r.end_of_turn_id, *fam.eos_ids, tok.eos_token_id,
                                   *(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)}
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "PROBE"},
            {"role": "user", "content": "v"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    after = text[text.find("PROBE") + 5:]
    first = min((after.find(t), t) for t in tok.get_added_vocab() if t in after
                and tok.added_tokens_decoder[tok.convert_tokens_to_ids(t)].special)[1]
    assert tok.convert_ids_to_tokens(r.end_of_turn_id) == first


@pytest.mark.parametrize("name", NAMES)
def test_bos_once_where_the_template_writes_it(name):
    fam, r = family(name)
    bos = fam.meta["bos_id"]
    ids = r.render(chat.messages([{"role": "system", "content": "s"},
                                  {"role": "user", "content": "hi"}]))
    writes_bos = "bos_token" in r.template and bos is not None
    assert ids.count(bos) == (1 if writes_bos else 0) if bos is not None else True
    if writes_bos:
        assert ids[0] == bos


@pytest.mark.parametrize("name", NAMES)
def test_two_turns_through_the_app_record_the_template_ids(serve, name):
    """Chat completions over HTTP: turn 1's prompt is the template's ids; turn 2 extends turn
    1's prompt + sampled ids, or (templates that drop reasoning/rewrite history) is a counted
    new branch equal to the template's own rendering."""
    fam, r = family(name)
    eot = [r.end_of_turn_id]
    replies = [Scripted(ids := r.encode("Paris is sunny.") + eot, [-0.1] * len(ids)),
               Scripted(ids2 := r.encode("Bye.") + eot, [-0.2] * len(ids2))]
    srv = serve(ScriptedEngine(replies, max_model_len=8192), fam.tokenizer, renderer=r)
    tid, key = srv.session()
    client = srv.client(key)
    turn1 = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Weather? <|im_end|><|eot_id|>"}]
    first = client.chat.completions.create(model="tiny", messages=turn1)
    assert first.choices[0].message.content == "Paris is sunny."
    turn2 = [*turn1, {"role": "assistant", "content": "Paris is sunny."},
             {"role": "user", "content": "Thanks"}]
    client.chat.completions.create(model="tiny", messages=turn2)
    c1, c2 = srv.pool.get_trajectory(tid).completions
    assert c1.prompt_ids == expected_ids(fam, as_template(turn1, r.late_system), None)
    assert c1.completion_ids == ids
    want2 = expected_ids(fam, as_template(turn2, r.late_system), None)
    if c2.extends_previous:  # the sampled ids, then the template's ids after the reply's end
        n = len(c1.prompt_ids)
        assert c2.prompt_ids[: n + len(ids)] == c1.prompt_ids + ids
        end = next(k for k in range(n, len(want2)) if want2[k] in r.stop_ids)
        assert c2.prompt_ids[n + len(ids) :] == want2[end + 1 :]
    else:  # a counted new branch: the template's own rendering
        assert srv.gateway.counters["prefix_misses"] == 1
        assert c2.prompt_ids == want2


@pytest.mark.parametrize("name", ["llama3.1", "qwen3"])
def test_run_startup_reads_the_generation_config_eos(name):
    """The controller builds the renderer with the model folder's generation_config eos ids
    (`startup.eos_ids`): Llama 3.1's three, Qwen3's two, in the file's order."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from forgerl.controller.startup import eos_ids

    fam = load(name)
    gen = GenerationConfig.from_pretrained(ROOT / name)
    ids = eos_ids(SimpleNamespace(generation_config=gen))
    assert ids == {"llama3.1": [128001, 128008, 128009], "qwen3": [151645, 151643]}[name]
    r = build_renderer(fam.tokenizer, eos_ids=ids)
    assert set(r.stop_ids) == STOPS[name]
