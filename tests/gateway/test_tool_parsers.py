"""Hermes tool-call parsing: text -> tool calls (the internal `ToolCall`), never raising.

Pins CASES.md C05 at the parser level: two blocks give two calls in order; a block with broken
JSON or an undeclared tool stays as text and is reported while the valid call is kept; an
unclosed block (truncated reply, C09) stays as text.
"""

from __future__ import annotations

import json

from forgerl.gateway.tool_parsers import parse_tool_calls

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
