"""Tool-call parsing (hermes, llama3_json, mistral): text -> tool calls, never raising.

Pins CASES.md C05 at the parser level: two blocks give two calls in order; a block with broken
JSON or an undeclared tool stays as text and is reported while the valid call is kept; an
unclosed block (truncated reply, C09) stays as text; so does a sampled call that json.loads
cannot take (an integer of 5,000 digits, 3,000 nested arrays), which raised out of the parser.
"""

from __future__ import annotations

import json

import pytest

from forgerl.gateway.renderers.replies import HeldReply, ReplyStream
from forgerl.gateway.renderers.tool_parsers import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    detect_parser,
    parse_llama3_json,
    parse_mistral,
    parse_tool_calls,
)

A = '<tool_call>\n{"name": "lookup", "arguments": {"id": 7}}\n</tool_call>'
B = '<tool_call>\n{"name": "lookup", "arguments": {"id": 8}}\n</tool_call>'


def args(reply):
    return [json.loads(c.arguments) for c in reply.tool_calls]


def test_two_calls_in_order():
    r = parse_tool_calls(f"Checking.\n{A}\n{B}", {"lookup"})
    assert args(r) == [{"id": 7}, {"id": 8}] and r.errors == []
    assert r.content == "Checking."
    ids = [c.id for c in r.tool_calls]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids) and ids[0] != ids[1]
    assert [c.name for c in r.tool_calls] == ["lookup", "lookup"]
    assert parse_tool_calls(f"{A}{B}", None).content is None


def test_broken_json_is_kept_as_text():
    bad = '<tool_call>\n{"name": "lookup", "arguments": {"id": 8}\n</tool_call>'
    r = parse_tool_calls(f"{A}\n{bad}", {"lookup"})
    assert args(r) == [{"id": 7}] and r.content == bad
    assert len(r.errors) == 1 and "invalid JSON" in r.errors[0]


def test_undeclared_tool_is_kept_as_text():
    other = B.replace("lookup", "rm_rf")
    r = parse_tool_calls(f"{A}\n{other}", {"lookup"})
    assert args(r) == [{"id": 7}] and r.content == other
    assert r.errors == ["tool 'rm_rf' was not declared in the request"]
    assert len(parse_tool_calls(f"{A}\n{other}", None).tool_calls) == 2


def test_odd_blocks_never_raise():
    cases = {
        "<tool_call>[1, 2]</tool_call>": "not an object",
        '<tool_call>{"name": 3}</tool_call>': "not an object",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>': "not a JSON object",
        '<tool_call>{"name": "f", "arguments": "nope"}</tool_call>': "not a JSON object",
        # a sampled reply json.loads cannot take (they raised out of the parser: a 500)
        f'<tool_call>{{"name": "f", "arguments": {{"a": {"9" * 5000}}}}}</tool_call>':
            "Exceeds the limit (4300 digits)",
        f'<tool_call>{{"name": "f", "arguments": {"[" * 3000 + "]" * 3000}}}</tool_call>':
            "maximum recursion depth",
        f'<tool_call>{{"name": "f", "arguments": "{{\\"a\\": {"9" * 5000}}}"}}</tool_call>':
            "not a JSON object",
    }
    for text, err in cases.items():
        r = parse_tool_calls(text, None)
        assert r.tool_calls == [] and r.content == text and err in r.errors[0]
    r = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert args(r) == [{"x": 1}]
    r = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert args(r) == [{}]


def test_unclosed_block_stays_text():
    text = 'ok <tool_call>\n{"name": "lookup", "argu'
    r = parse_tool_calls(text, {"lookup"})
    assert r.tool_calls == [] and r.content == text and "unclosed" in r.errors[0]
    plain = parse_tool_calls("  just text ", {"lookup"})
    assert (plain.content, plain.tool_calls, plain.errors) == ("  just text ", [], [])
def test_unclosed_block_does_not_swallow_the_next_valid_call():
    """C05's invariant: the valid call survives an unclosed block before it (kept as text)."""
    text = (
        '<tool_call>\n{"name": "lookup", "arguments": {"id": 7}}\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"id": 8}}\n</tool_call>'
    )
    parsed = parse_tool_calls(text, {"lookup"})
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [{"id": 8}]
    assert parsed.content is not None and '{"id": 7}' in parsed.content
    assert parsed.errors == ["unclosed <tool_call> (reply truncated?)"]


# Llama 3.x JSON calls and Mistral [TOOL_CALLS] lists: same contract (never raises; a bad call
# stays as text and is reported; zero arguments are {}), and `HeldReply` streams give the same
# content and calls as one parse of the whole text.

LLAMA = '{"name": "lookup", "parameters": {"id": 7}}'


def test_llama3_json_calls():
    r = parse_llama3_json(LLAMA, {"lookup"})
    assert args(r) == [{"id": 7}] and r.content is None and r.errors == []
    r = parse_llama3_json('Let me look.<|python_tag|>{"name": "lookup", "arguments": {"id": 8}}')
    assert args(r) == [{"id": 8}] and r.content == "Let me look."
    assert args(parse_llama3_json('{"name": "lookup"}')) == [{}]  # zero arguments
    assert args(parse_llama3_json('{"name": "lookup", "parameters": null}')) == [{}]
    plain = parse_llama3_json("It is sunny.", {"lookup"})
    assert (plain.content, plain.tool_calls, plain.errors) == ("It is sunny.", [], [])


def test_llama3_json_bad_calls_stay_text():
    for text, err in ((LLAMA[:-1], "invalid JSON"), (LLAMA.replace("lookup", "rm"), "not declared"),
                      ('{"answer": 42}', "not an object with a string 'name'"),
                      ('{"name": "lookup", "arguments": ' + "[" * 3000 + "]" * 3000 + "}",
                       "maximum recursion depth")):
        r = parse_llama3_json(text, {"lookup"})
        assert r.tool_calls == [] and r.content == text and err in r.errors[0]


def test_mistral_calls():
    two = ('[TOOL_CALLS][{"name": "lookup", "arguments": {"id": 7}, "id": "abcDEF123"}, '
           '{"name": "lookup", "arguments": {"id": 8}}]')
    r = parse_mistral(f"On it. {two}", {"lookup"})
    assert args(r) == [{"id": 7}, {"id": 8}] and r.content == "On it." and r.errors == []
    ids = [c.id for c in r.tool_calls]
    assert ids[0] == "abcDEF123" and len(ids[1]) == 9 and ids[1].isalnum()
    assert args(parse_mistral('[TOOL_CALLS][{"name": "lookup"}]')) == [{}]  # zero arguments
    assert parse_mistral("No calls.").content == "No calls."


def test_mistral_bad_calls():
    for broken in ('[TOOL_CALLS][{"name": "lookup", "arguments": {"id": 7}',
                   '[TOOL_CALLS][{"name": "lookup", "arguments": {"id": ' + "7" * 5000 + "}}]"):
        r = parse_mistral(broken, {"lookup"})
        assert r.tool_calls == [] and r.content == broken and "invalid JSON" in r.errors[0]
    mixed = ('[TOOL_CALLS][{"name": "lookup", "arguments": {"id": 7}}, '
             '{"name": "rm", "arguments": {}}]')
    r = parse_mistral(mixed, {"lookup"})
    assert args(r) == [{"id": 7}] and r.errors == ["tool 'rm' was not declared in the request"]
    r = parse_mistral(mixed, {"other"})
    assert r.tool_calls == [] and r.content == mixed and len(r.errors) == 2


def test_detect_parser_and_prefixes():
    assert detect_parser("{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert detect_parser("<tool_call>{{ tool_call | tojson }}</tool_call>") is HERMES
    assert detect_parser('"parameters": {{ args }}') is LLAMA3_JSON
    assert detect_parser("{{ '<|python_tag|>' }}") is LLAMA3_JSON
    assert detect_parser("plain chat") is HERMES
    assert HERMES.call_prefix("f") == '<tool_call>\n{"name": "f", "arguments": {'
    assert LLAMA3_JSON.call_prefix("f") == '{"name": "f", "parameters": {'
    assert MISTRAL.call_prefix(None) is None and MISTRAL.close is None


@pytest.mark.parametrize("parser", [LLAMA3_JSON, MISTRAL])
def test_held_stream_equals_one_parse(parser):
    text = (LLAMA if parser is LLAMA3_JSON else
            'Ok [TOOL_CALLS][{"name": "lookup", "arguments": {"id": 7}}] STOP ignored')
    whole = parser.parse(text.split(" STOP")[0], {"lookup"})
    for size in (1, 3, 50):
        held = HeldReply(ReplyStream("", ("STOP",), (), None, "", ""), parser, {"lookup"})
        pieces = []
        for k in range(0, len(text), size):
            pieces += held.feed(text[k : k + size])
            if held.stopped:
                break
        pieces += held.finish()
        assert held.content == (whole.content or "") and held.calls[0].arguments == (
            whole.tool_calls[0].arguments)
        assert [p for p in pieces if isinstance(p, str)] == ([whole.content] if whole.content
                                                             else [])
