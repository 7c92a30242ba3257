"""Sampled ids -> the reply a client sees: end at stop strings, parse tool calls (pure).

Data flow: the gateway core (record.py, `build_choices`) gets a choice's sampled ids from the
engine and calls `cut_at_stop` and then `finish_reply` here; the kept ids are recorded, the
reply is handed to the protocol. The engines stop only on token ids, so a stop string is applied
after decoding: the sampled ids are kept up to and including the token that completes the
earliest stop string, and the ids decoded past it are dropped from the record. That is what an
engine that stops on the string records (the stopping rule depends only on the prefix, so the
kept ids have the same distribution), and it keeps turn k+1's prompt an extension of what the
agent saw at turn k. Every kept id stays in the loss, including those of the stop string itself.

Streaming (`Gateway.stream`): `IncrementalDecoder` turns each sampled id into the text it makes
decodable, and `ReplyStream` applies the same stop, close and tool-call rules to that text as it
grows, so the client gets each delta once it is certain and the engine is stopped as soon as a
stop string completes; the record is then cut by `cut_at_stop`, exactly as without streaming.
`HeldReply` holds back a reply whose tool-call format has no closing string (llama3_json,
mistral) and parses it once, when it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from forgerl.gateway.conversation import Message, ToolCall
from forgerl.gateway.renderers.tool_parsers import (
    Declared,
    ParsedReply,
    ToolParser,
    parse_tool_calls,
)


@dataclass(frozen=True)
class Cut:
    """Where a choice ends.

    keep: how many sampled ids stay (the record's completion ids are `ids[:keep]`).
    text: the reply text the client sees: the prefill plus the kept ids decoded, ending before
        a client stop string or right after a `closes` string (end-of-turn id not decoded).
    stopped: a stop or close string ended the choice (finish_reason "stop").
    """

    keep: int
    text: str
    stopped: bool


def cut_at_stop(
    decode: Callable[[list[int]], str],
    ids: list[int],
    end_of_turn_id: int,
    prefix: str = "",
    stops: Sequence[str] = (),
    closes: Sequence[str] = (),
) -> Cut:
    """Cut a choice at the first stop string the model wrote.

    Args:
        decode: ids -> text (special tokens dropped).
        ids: the sampled completion ids (length C; may end with the end-of-turn id).
        prefix: reply text prefilled before the sampled ids (not sampled: never matched alone).
        stops: client stop strings; the text ends before the match.
        closes: strings that end the choice and stay in the text (the close of a tool call when
            a reply may hold only one).

    Returns the `Cut`; with no match, all C ids and the whole text. The match that completes
    first (smallest end offset) wins. Cost: one full decode, plus O(log C) prefix decodes when
    a string matched.
    """
    body = ids[:-1] if ids and ids[-1] == end_of_turn_id else ids
    full = prefix + decode(body)
    best = first_stop(full, 0, len(prefix), stops, closes)
    if best is None:
        return Cut(len(ids), full, False)
    end, start, keeps = best
    target = full[start:end]
    lo, hi = 1, len(body)  # smallest k whose decoded prefix already holds the whole match
    while lo < hi:
        mid = (lo + hi) // 2
        if (prefix + decode(body[:mid]))[start:end] == target:
            hi = mid
        else:
            lo = mid + 1
    return Cut(lo, full[:end] if keeps else full[:start], True)


def cut_text(text: str, prefix: str = "", stops: Sequence[str] = (),
             closes: Sequence[str] = ()) -> Cut:
    """`cut_at_stop` for a reply the engine gave as text without ids (GenerateOutput.text):
    the same text cut, keep 0 (no id is recorded)."""
    full = prefix + text
    best = first_stop(full, 0, len(prefix), stops, closes)
    if best is None:
        return Cut(0, full, False)
    end, start, keeps = best
    return Cut(0, full[:end] if keeps else full[:start], True)


def finish_reply(
    cut: Cut, engine_finish: str, declared: Declared,
    parse: Callable[[str, Declared], ParsedReply] = parse_tool_calls,
) -> tuple[Message, str, list[str]]:
    """The assistant message, the finish reason and the tool-call parse errors of a choice.

    declared: the rendered tools' names (tool calls are parsed only when tools were rendered);
    None: no tools, the text is the content. parse: the renderer's tool-call parser (default
    Hermes). finish: "tool_calls" when calls were parsed and the choice ended by itself or at a
    stop string, "stop" at a stop string, else the engine's ("stop" / "length"). Parse errors
    of a choice cut by max_tokens are not reported (C09).
    """
    finish = "stop" if cut.stopped else engine_finish
    if declared is None:
        return Message("assistant", cut.text), finish, []
    parsed = parse(cut.text, declared)
    if parsed.tool_calls and finish == "stop":
        finish = "tool_calls"
    errors = parsed.errors if finish != "length" else []
    return Message("assistant", parsed.content or "", tuple(parsed.tool_calls)), finish, errors


def first_stop(
    text: str, since: int, prefix_len: int, stops: Sequence[str], closes: Sequence[str]
) -> tuple[int, int, bool] | None:
    """The stop or close match of `text` that ends first: (end, start, text keeps match).

    Only matches that end in sampled text (after `prefix_len` characters) and after `since` are
    looked for (a stream passes the length it had already searched). None: no match.
    """
    best: tuple[int, int, bool] | None = None
    for strings, keeps in ((stops, False), (closes, True)):
        for s in strings:
            start = text.find(s, max(0, prefix_len - len(s) + 1, since - len(s) + 1))
            if start >= 0 and (best is None or start + len(s) < best[0]):
                best = (start + len(s), start, keeps)
    return best


class IncrementalDecoder:
    """Sampled ids -> text deltas, each as soon as it decodes to whole characters.

    A delta is the decoding of a short window of ids minus the decoding of its first part (so a
    tokenizer that drops a leading space at the start of a decode still spaces words right); a
    window ending in U+FFFD (bytes of a character still to come) is held back until the next id
    completes it, or `flush`. The deltas of a completion join to `decode(ids)`. Cost per id:
    two decodes of a few ids.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self._prefix = self._read = 0  # ids[_prefix:_read] decoded already; ids[:_read] emitted

    def push(self, token_id: int) -> str:
        """Add one sampled id; the text it makes decodable ("" while bytes are held back)."""
        self.ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """The text of held-back ids (U+FFFD for bytes that never completed a character)."""
        return self._delta(final=True) if self._read < len(self.ids) else ""

    def _delta(self, final: bool) -> str:
        done = self.decode(self.ids[self._prefix : self._read])
        text = self.decode(self.ids[self._prefix :])
        if len(text) > len(done) and (final or not text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(done) :]
        return ""


class ReplyStream:
    """Decoded text -> content deltas and tool calls, each as soon as it is certain.

    The streaming twin of `cut_at_stop` + `finish_reply` (same stop, close, prefix and tool
    rules): text that could still be the start of a stop string or (when tools are parsed) of
    the parser's open string is held back; a block (`<tool_call>`..., a section of several calls
    in kimi_k2 / deepseek) is held until it closes, then comes out as its `ToolCall`s when it
    parses (`parse`) and as text when it does not (or never closes). When tools are
    parsed, whitespace at the end of the content is held back and dropped once a call is found,
    as the non-streamed reply strips it (and line breaks that start content after a call).
    `stopped` turns True when a stop or close string completes: everything after it is dropped
    and the caller stops the engine.

    The content deltas join to the non-streamed reply's content for any chunking of the same
    text.
    """

    def __init__(self, prefix: str, stops: Sequence[str], closes: Sequence[str],
                 declared: Declared, open_string: str, close_string: str,
                 parse: Callable[[str, Declared], ParsedReply] = parse_tool_calls):
        self.text, self.prefix_len, self.done, self.parse = prefix, len(prefix), 0, parse
        self.stops, self.closes, self.declared = tuple(stops), tuple(closes), declared
        self.open, self.close = (open_string if declared is not None else ""), close_string
        self.holds = self.stops + ((self.open,) if self.open else ())
        self.stopped = False
        self.content = ""  # the content sent so far
        self.calls: list[ToolCall] = []
        self._ws = ""  # whitespace held back (tools parsed)

    def feed(self, delta: str) -> list[str | ToolCall]:
        """Add decoded text; the content pieces and tool calls now certain, in order."""
        searched = len(self.text)
        self.text += delta
        match = first_stop(self.text, searched, self.prefix_len, self.stops, self.closes)
        if match is not None:
            end, start, keeps = match
            self.stopped = True
            return self._settle(max(end if keeps else start, self.done), final=True)
        return self._settle(len(self.text) - self._partial(), final=False)

    def finish(self) -> list[str | ToolCall]:
        """The generation ended (not at a stop string): settle all that is held back."""
        return [] if self.stopped else self._settle(len(self.text), final=True)

    def _partial(self) -> int:
        """Length of the longest suffix of the text that a held string could start with."""
        longest = 0
        for s in self.holds:
            for k in range(min(len(s) - 1, len(self.text) - self.done), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _settle(self, limit: int, final: bool) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        text, opener = self.text, self.open
        while self.done < limit:
            j = text.find(opener, self.done, limit) if opener else -1
            if j < 0:
                self._content(out, text[self.done : limit])
                self.done = limit
                break
            self._content(out, text[self.done : j])
            self.done = j
            body = j + len(opener)
            close, again = text.find(self.close, body, limit), text.find(opener, body, limit)
            if again >= 0 and (close < 0 or again < close):  # a block opened inside: text
                self._content(out, text[j:again])
                self.done = again
                continue
            if close < 0:  # still open: held, or text when the reply ends here
                if final:
                    self._content(out, text[j:limit])
                    self.done = limit
                break
            block = text[j : close + len(self.close)]
            parsed = self.parse(block, self.declared)
            if parsed.tool_calls:
                self.calls += parsed.tool_calls
                out += parsed.tool_calls
            else:
                self._content(out, block)
            self.done = close + len(self.close)
        if final and self._ws and not self.calls:
            out.append(self._ws)
            self.content += self._ws
        if final:
            self._ws = ""
        return out

    def _content(self, out: list[str | ToolCall], piece: str) -> None:
        if not piece:
            return
        if self.declared is not None:
            piece = self._ws + piece
            if not self.content and self.calls:
                piece = piece.lstrip("\r\n")
            body = piece.rstrip()
            piece, self._ws = body, piece[len(body) :]
            if not piece:
                return
        out.append(piece)
        self.content += piece


class HeldReply:
    """The stream state of a reply whose tool calls have no closing string (llama3_json,
    mistral): `text` (a `ReplyStream` parsing no tools) applies stop and close strings as the
    text grows; the content and calls come out once, when the reply ends, parsed exactly as the
    non-streamed reply. Same interface as `ReplyStream` (feed, finish, stopped, content, calls).
    """

    def __init__(self, text: ReplyStream, parser: ToolParser, declared: Declared):
        self.text, self.parser, self.declared = text, parser, declared
        self.content, self.calls, self._held, self._done = "", [], "", False

    @property
    def stopped(self) -> bool:
        return self.text.stopped

    def feed(self, delta: str) -> list[str | ToolCall]:
        """Add decoded text; nothing comes out until the reply ends (or a stop string)."""
        self._held += "".join(str(p) for p in self.text.feed(delta))
        return self._release() if self.text.stopped else []

    def finish(self) -> list[str | ToolCall]:
        """The generation ended: the parsed content (one piece) and calls."""
        self._held += "".join(str(p) for p in self.text.finish())
        return self._release()

    def _release(self) -> list[str | ToolCall]:
        if self._done:
            return []
        self._done = True
        parsed = self.parser.parse(self._held, self.declared)
        self.content, self.calls = parsed.content or "", list(parsed.tool_calls)
        return [*([self.content] if self.content else []), *self.calls]
