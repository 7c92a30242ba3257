"""The model families' own reply formats, round-tripped through the real app (issue 47 item 1).

For each family built by scripts/families.py (tests/families.py; Qwen3-Coder and DeepSeek-V3.1
are the qwen3 / deepseek-r1-qwen tokenizers with those families' own templates from the same
sdist), hypothesis generates an assistant message (content, reasoning, 0-3 tool calls with
nested JSON arguments), renders it with the family's own chat template (apply_chat_template of
[user, assistant] minus the prompt), and feeds those ids as the engine's completion through
the real app (ScriptedEngine, openai client, plain and streamed). The client must see the same
reasoning, content and calls (name, arguments as objects), and the stored completion ids must
be the fed ids. Where a template renders history unlike what the model generates, the
model-side text is written from the family's documented generation format (`VARIANTS`,
`model_text`): DeepSeek-R1's template drops reasoning from history and its prompt opens
`<think>\\n` (thinking on); Gemma 4 writes the thought channel only before tool calls.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from forgerl.gateway.renderers.templates import HFTemplateRenderer
from scripts.families import SDIST
from tests.families import ROOT, load
from tests.gateway.conftest import Scripted, ScriptedEngine

TEMPLATES = (Path(__file__).resolve().parents[2] / ".cache" / "sdist"
             / SDIST.replace("==", "-").replace("-", "_", 2) / "vendor/llama.cpp/models/templates")
THINK_ON = "{%- set enable_thinking = true -%}"
THINK_OFF = "{%- set enable_thinking = false -%}"
OFF = ("<think>\n</think>", "<|channel>thought\n<channel|>")
"""The empty reasoning a generation prompt writes when reasoning is turned off."""


@dataclass(frozen=True)
class Variant:
    """A family as the test serves it: base folder, template file (None: the folder's own),
    jinja prepended (a template default), max calls (0: no tool section), the tool parser and
    reasoning format detected, whether the template renders the reply's reasoning, and the
    model-side reasoning text when it does not ({r}: the reasoning)."""

    family: str
    template: str | None = None
    head: str = ""
    max_calls: int = 3
    parser: str = "hermes"
    reasoning: str | None = None
    think: str | None = None


VARIANTS = {  # in order of how many users train them
    "qwen3": Variant("qwen3", reasoning="think"),
    "qwen3-nothink": Variant("qwen3", head=THINK_OFF),
    "llama3.1": Variant("llama3.1", max_calls=1, parser="llama3_json"),
    "qwen3-coder": Variant("qwen3", "Qwen3-Coder.jinja", parser="qwen3_coder"),
    "deepseek-r1": Variant("deepseek-r1-qwen", head=THINK_ON, max_calls=0, parser="deepseek",
                           reasoning="think", think="{r}\n</think>\n\n"),
    "deepseek-r1-nothink": Variant("deepseek-r1-qwen", max_calls=0, parser="deepseek"),
    "deepseek-v3.1": Variant("deepseek-r1-qwen", "deepseek-ai-DeepSeek-V3.1.jinja", max_calls=0,
                             parser="deepseek"),
    "glm4.6": Variant("glm4.6", parser="glm45", reasoning="think"),
    "kimi-k2": Variant("kimi-k2", parser="kimi_k2"),
    "gemma4": Variant("gemma4", parser="gemma4"),
    "gemma4-thinking": Variant("gemma4", head=THINK_ON, parser="gemma4", reasoning="channel",
                               think="<|channel>thought\n{r}\n<channel|>"),
    "mistral-nemo": Variant("mistral-nemo", parser="mistral"),
    "qwen2.5": Variant("qwen2.5"),
    "phi3.5": Variant("phi3.5", max_calls=0),
}

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "filter": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}}}}
NAMES = ("get_weather", "search_docs", "run_code")
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} tool",
                                           "parameters": SCHEMA}} for n in NAMES]
USER = [{"role": "user", "content": "Help me."}]


@functools.cache
def tokenizer(name: str):
    v = VARIANTS[name]
    fam = load(v.family)
    if v.template is None and not v.head:
        return fam.tokenizer
    tok = AutoTokenizer.from_pretrained(ROOT / v.family)
    template = tok.chat_template
    if v.template is not None:
        if not (TEMPLATES / v.template).exists():
            pytest.skip(f"{v.template} not extracted: run `python scripts/families.py`")
        template = (TEMPLATES / v.template).read_text(encoding="utf-8")
    tok.chat_template = v.head + template
    return tok


def _common(a: str, b: str) -> int:
    """Length of the common prefix of a and b, backed off to a line or tag end."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    while n and n < min(len(a), len(b)) and a[n - 1] not in ">\n":
        n -= 1
    return n


def model_text(name: str, content: str, reasoning: str | None, calls: list[dict]) -> str:
    """The reply as the model writes it after the generation prompt: the template's rendering
    of the assistant turn minus the prompt (the header they share), with the reasoning written
    by `Variant.think` where the template drops it."""
    tok, v = tokenizer(name), VARIANTS[name]
    msg: dict = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    if reasoning is not None and v.think is None:
        msg["reasoning_content"] = reasoning
    tools = TOOLS if v.max_calls else None
    base = tok.apply_chat_template(USER, tools=tools, tokenize=False)
    prompt = tok.apply_chat_template(USER, tools=tools, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template([*USER, msg], tools=tools, tokenize=False)
    n = _common(base, full)  # Phi-3.5 ends a rendering that has no generation prompt with eos
    gp, seg = prompt[n:], full[n:]
    for off in OFF:  # the prompt's empty reasoning (turned off), which history does not write
        if gp.endswith(off) and not seg.startswith(gp):
            assert v.think is None
            gp = gp.removesuffix(off)
    k = _common(gp, seg)
    assert k == len(gp) or v.think is not None, gp[k:]  # else: R1's prompt opens `<think>\n`
    text = seg[k:]
    if v.think is not None:  # an empty block when there is none (R1 always closes it)
        text = v.think.format(r=reasoning or "") + text
    return text


def completion_ids(name: str, text: str) -> list[int]:
    """`text` as sampled ids, ending at the renderer's first stop id (inclusive)."""
    r = renderer(name)
    ids = tokenizer(name).encode(text, add_special_tokens=False)
    end = next((i for i, t in enumerate(ids) if t in r.stop_ids), len(ids) - 1)
    return ids[: end + 1]


@functools.cache
def renderer(name: str) -> HFTemplateRenderer:
    return HFTemplateRenderer(tokenizer(name))


WORD = st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=6)
TEXT = st.text("abcdefXYZ 0123456789.,!?'()-_+=é中", min_size=1, max_size=30).map(str.strip) \
    .filter(bool)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | TEXT,
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(WORD, c, max_size=3),
                    max_leaves=6)
ARGS = st.fixed_dictionaries({}, optional={
    "city": TEXT, "days": st.integers(-5, 400), "metric": st.booleans(),
    "filter": st.dictionaries(WORD, JSON, max_size=3), "tags": st.lists(TEXT, max_size=3)})


@st.composite
def replies(draw, name: str) -> tuple[str, str | None, list[dict]]:
    """(content, reasoning, tool calls) the family can write."""
    v = VARIANTS[name]
    n = draw(st.integers(0, v.max_calls))
    calls = [{"type": "function", "id": f"c{k}{draw(st.text('abcdefgh', min_size=7, max_size=7))}",
              "function": {"name": draw(st.sampled_from(NAMES)), "arguments": draw(ARGS)}}
             for k in range(n)]
    if v.parser == "kimi_k2":
        for k, c in enumerate(calls):
            c["id"] = f"functions.{c['function']['name']}:{k}"
    if v.parser == "gemma4" and v.reasoning is None and not calls:
        pass
    # the template writes the call alone (Mistral's drops an assistant's content beside calls)
    plain_only = calls and v.parser in ("llama3_json", "mistral")
    content = "" if plain_only else draw(TEXT if not calls else st.just("") | TEXT)
    reasoning = draw(st.none() | TEXT) if v.reasoning else None
    if v.parser == "gemma4" and reasoning is not None and not calls and v.think is None:
        reasoning = None
    return content, reasoning, calls


def streamed(client, **kw) -> tuple[str, str, list[tuple[str, dict, str]]]:
    content, reasoning, calls = "", "", {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for c in d.tool_calls or []:
            calls.setdefault(c.index, [c.function.name, "", c.id])[1] += c.function.arguments
    return content, reasoning, [(n, json.loads(a), i) for n, a, i in calls.values()]


def expected_ids(name: str, calls: list[dict]) -> list[str] | None:
    parser = VARIANTS[name].parser
    if parser == "kimi_k2":
        return [c["id"] for c in calls]
    if parser == "mistral":
        return [c["id"] for c in calls]
    return None


MISTRAL_OPEN = pytest.mark.xfail(strict=False, reason=(
    "open: after earlier examples a reply '0</s>' came back with empty content; the same reply "
    "alone passes (not yet explained, see the parsers branch's closing note)"))
MARKS: dict = {}
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
"""Each example is two HTTP calls: a failure is reported as drawn (shrinking took minutes)."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS.get(n, ())) for n in VARIANTS])
def test_family_replies_round_trip(serve, name):
    """Plain and streamed chat replies of generated assistant messages: reasoning, content,
    calls as written; recorded ids equal the fed ids; minted call ids unique."""
    r = renderer(name)
    v = VARIANTS[name]
    assert r.parser.name == v.parser and getattr(r.reasoning, "name", None) == v.reasoning
    srv = serve(ScriptedEngine([], max_model_len=8192), r.tokenizer, renderer=r, max_tokens=4096)
    minted: list[str] = []

    @settings(max_examples=12, deadline=None, database=None, phases=NO_SHRINK,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(replies(name))
    def check(reply):
        content, reasoning, calls = reply
        ids = completion_ids(name, model_text(name, content, reasoning, calls))
        srv.engine.script[:] = [Scripted(ids, [-0.5] * len(ids))] * 2
        tid, key = srv.session()
        client = srv.client(key)
        kw = {"model": "tiny", "messages": USER, **({"tools": TOOLS} if v.max_calls else {})}
        msg = client.chat.completions.create(**kw).choices[0].message
        got = [(c.function.name, json.loads(c.function.arguments), c.id)
               for c in msg.tool_calls or []]
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert [(n, a) for n, a, _ in got] == want
        assert (msg.content or "") == content
        assert (msg.model_extra or {}).get("reasoning_content") == reasoning
        s_content, s_reasoning, s_calls = streamed(client, **kw)
        assert (s_content, s_reasoning or None, [(n, a) for n, a, _ in s_calls]) == (
            content, reasoning, want)
        if (sampled := expected_ids(name, calls)) is not None:
            assert [i for *_, i in got] == [i for *_, i in s_calls] == sampled
        else:
            minted.extend(i for *_, i in got + s_calls)
        stored = srv.pool.get_trajectory(tid).completions
        assert [c.completion_ids for c in stored] == [ids, ids]

    check()
    assert len(minted) == len(set(minted))
