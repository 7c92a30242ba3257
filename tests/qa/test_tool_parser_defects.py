"""QA defect in the Hermes tool-call parser (CASES.md C05, general invariant: a valid call is
still returned when another block in the same reply is malformed).

A first `<tool_call>` block that is never closed, followed by a valid closed block, makes the
non-greedy block regex span from the first opening tag to the only closing tag; the whole span
fails to parse as JSON and the valid call `{"id": 8}` is lost (observed: 0 tool calls).
Correct: one tool call, lookup with arguments {"id": 8}; the unclosed block stays as text.
"""

from __future__ import annotations

import json

from forgerl.gateway.tool_parsers import parse_tool_calls


def test_unclosed_block_does_not_swallow_the_next_valid_call():
    text = (
        '<tool_call>\n{"name": "lookup", "arguments": {"id": 7}}\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"id": 8}}\n</tool_call>'
    )
    parsed = parse_tool_calls(text, {"lookup"})
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"id": 8}]
    assert parsed.content is not None and '{"id": 7}' in parsed.content
