"""Streaming replies are chunking-invariant (CASES.md C06, C14; pure, no HTTP).

`IncrementalDecoder` deltas join to `decode(ids)` and never end inside a UTF-8 character;
`ReplyStream` fed any chunking of a reply's text gives the content, tool calls and stop point
that the non-streamed `cut_at_stop` + `finish_reply` give for the whole text, and holds back
text that could still become a stop string or a `<tool_call>` opener.
"""

from __future__ import annotations

import random

import pytest

from forgerl.gateway.renderers.renderer import CALL_CLOSE, CALL_OPEN, ChatMLRenderer
from forgerl.gateway.renderers.replies import (
    IncrementalDecoder,
    ReplyStream,
    cut_at_stop,
    finish_reply,
)

TEXTS = [
    "plain text, nothing else",
    'Let me look.\n<tool_call>{"name": "lookup", "arguments": {"id": 7}}</tool_call>\n',
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> All done.',
    '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "lookup", '
    '"arguments": {"id": 7}}</tool_call>',
    "a <tool_call>broken</tool_call> b <tool_call> unclosed <tool_call>{\"name\": \"lookup\"}"
    "</tool_call> tail <tool_",
    "stop here: STOP and never this <tool_call>",
    '\r\n\r\nHi<tool_call>{"name": "get_time"}</tool_call>',
    '\n<tool_call>{"name": "get_time"}</tool_call>\n All\n<tool_call>{"name": "get_time"}'
    '</tool_call> \t\n',
    '  <tool_call>{"name": "get_time"}</tool_call>\r\n\u00a0x ',
    '\n<tool_call>{"name": "nope"}</tool_call><tool_call>{"name": "get_time"}</tool_call>',
    "ends with a partial ST",
]


def split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12))))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def streamed(pieces, stops, closes, declared):
    s = ReplyStream("", stops, closes, declared, CALL_OPEN, CALL_CLOSE)
    out = []
    for p in pieces:
        out += s.feed(p)
        if s.stopped:
            break
    out += s.finish()
    return s, out


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("stops", "closes", "tools"), [
    ((), (), True), (("STOP",), (), True), ((), (CALL_CLOSE,), True), (("ST", "x"), (), False),
])
def test_any_chunking_gives_the_plain_reply(tokenizer, text, stops, closes, tools):
    r = ChatMLRenderer(tokenizer)
    declared = {"lookup", "get_time"} if tools else None
    ids = r.encode(text)
    cut = cut_at_stop(r.decode, ids, r.end_of_turn_id, "", stops, closes)
    plain, _, _ = finish_reply(cut, "stop", declared)
    rng = random.Random(0)
    for _ in range(30):
        s, out = streamed(split(text, rng), stops, closes, declared)
        assert s.stopped == cut.stopped
        assert "".join(p for p in out if isinstance(p, str)) == s.content == plain.content
        assert [(c.name, c.arguments) for c in s.calls] == [
            (c.name, c.arguments) for c in plain.tool_calls]


def test_possible_openers_and_stops_are_held_back():
    s = ReplyStream("", ("END",), (), {"f"}, CALL_OPEN, CALL_CLOSE)
    assert s.feed("text <tool") == ["text"]  # " <tool" could still open a call
    assert s.feed("box") == [" <toolbox"]
    assert s.feed(" E") == []  # " E" could be " " + the start of END
    assert s.feed("ND more") == [" "]  # no call came: the held space is content
    assert s.stopped and s.content == "text <toolbox "


def test_decoder_holds_bytes_until_the_character_is_whole(tokenizer):
    r = ChatMLRenderer(tokenizer)
    text = "é日🙂a"
    ids = r.encode(text)
    d = IncrementalDecoder(r.decode)
    deltas = [d.push(i) for i in ids]
    assert [x for x in deltas if x] == list(text) and "".join(deltas) == text
    assert deltas[:2] == ["", "é"] and d.flush() == ""
    d2 = IncrementalDecoder(r.decode)
    assert d2.push(ids[2]) == "" and d2.flush() == r.decode(ids[2:3])  # never completed
