"""Reply text -> reasoning and content: the reasoning parser of a model family (pure).

Data flow: the gateway decodes a choice's sampled ids (replies.py cuts them at stop strings)
and, when the renderer's template has a reasoning format (`Renderer.reasoning`), splits the
reasoning off here before the tool-call parse; the protocol returns it as its reasoning field
(chat `reasoning_content`, a Responses `reasoning` item, an Anthropic `thinking` block). The
recorded completion ids never depend on the split: it only changes what the client sees.

    think     <think>\\nREASONING\\n</think>\\n\\nCONTENT   Qwen3, DeepSeek-R1, GLM-4.5/4.6, QwQ
    channel   <|channel>thought\\nREASONING\\n<channel|>CONTENT   Gemma 4

A reply opens reasoning when it starts (after whitespace) with the open string, or at once when
the generation prompt already ends with it (`ReasoningFormat.opened`, DeepSeek-R1 distills
prompt `<think>\\n`); it closes at the first close string. A prompt that ends with the close
string turned reasoning off (Qwen3 `enable_thinking=False` writes an empty think block, Gemma 4
an empty channel): the renderer then has no reasoning format and the whole reply is content.
Reasoning is stripped of line breaks at both ends and is None when empty; content drops the
line breaks right after the close string. A reply cut inside its reasoning (max_tokens, a stop
string) is all reasoning, with empty content. `ThinkStream` gives the same split while a reply
streams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from forgerl.gateway.conversation import ToolCall
from forgerl.gateway.renderers.replies import HeldReply, ReplyStream, first_stop


@dataclass(frozen=True)
class ReasoningFormat:
    """The strings around a family's reasoning; opened: the generation prompt ends with `open`
    (the reply starts inside its reasoning)."""

    name: str
    open: str
    close: str
    opened: bool = False


THINK = ReasoningFormat("think", "<think>", "</think>")
CHANNEL = ReasoningFormat("channel", "<|channel>thought", "<channel|>")


def detect_reasoning(template: str) -> ReasoningFormat | None:
    """The reasoning format a chat template writes (Gemma 4's thought channel, `<think>`), or
    None when it has none."""
    for fmt in (CHANNEL, THINK):
        if fmt.open in template and fmt.close in template:
            return fmt
    return None


def prompted(fmt: ReasoningFormat | None, prompt_text: str) -> ReasoningFormat | None:
    """`fmt` as a generation prompt (decoded, special tokens kept) leaves it: None when the
    prompt ends with the close string (reasoning turned off), opened when with the open one."""
    tail = prompt_text.rstrip()
    if fmt is None or tail.endswith(fmt.close):
        return None
    return dataclasses.replace(fmt, opened=tail.endswith(fmt.open))


def split_reasoning(text: str, fmt: ReasoningFormat | None) -> tuple[str | None, str]:
    """(reasoning or None, content) of a reply's text (see the module docstring)."""
    if fmt is None:
        return None, text
    body = text
    if not fmt.opened:
        lead = text.lstrip()
        if not lead.startswith(fmt.open):
            return None, text
        body = lead[len(fmt.open) :]
    reasoning, closed, content = body.partition(fmt.close)
    return reasoning.strip("\n") or None, content.lstrip("\n") if closed else ""


@dataclass(frozen=True)
class Reasoning:
    """A streamed reasoning delta (text)."""

    text: str


class ThinkStream:
    """The streaming twin of `split_reasoning` in front of a choice's content stream `inner`
    (a `ReplyStream` or `HeldReply`): reasoning text goes out as `Reasoning` pieces as soon as
    it cannot be the start of the close string or of a stop string (line breaks at its end are
    held, and dropped at the close); the text after the close goes to `inner`. A stop string
    that completes inside the reasoning stops the choice there. Same interface as `inner`
    (feed, finish, stopped, content, calls) plus `reasoning` (None until reasoning opened).
    """

    def __init__(self, inner: ReplyStream | HeldReply, fmt: ReasoningFormat,
                 stops: Sequence[str]):
        self.inner, self.fmt, self.stops = inner, fmt, tuple(stops)
        self.phase = "think" if fmt.opened else "start"
        self.reasoning: str | None = "" if fmt.opened else None
        self.buf, self._ws, self._lead, self._after, self._stopped = "", "", True, False, False

    @property
    def stopped(self) -> bool:
        return self._stopped or self.inner.stopped

    @property
    def content(self) -> str:
        return self.inner.content

    @property
    def calls(self) -> list[ToolCall]:
        return self.inner.calls

    def feed(self, delta: str) -> list[str | ToolCall | Reasoning]:
        """Add decoded text; the reasoning, content pieces and tool calls now certain."""
        if self.phase == "content":
            return self._content(delta)
        self.buf += delta
        if self.phase == "start":
            lead, opener = self.buf.lstrip(), self.fmt.open
            if len(lead) < len(opener) and opener.startswith(lead):
                return []  # may still open reasoning
            if not lead.startswith(opener):
                self.phase, text, self.buf = "content", self.buf, ""
                return self._content(text)
            self.phase, self.buf, self.reasoning = "think", lead[len(opener) :], ""
        return self._think(final=False)

    def finish(self) -> list[str | ToolCall | Reasoning]:
        """The generation ended (not at a stop string): settle all that is held back."""
        if self.stopped:
            return []
        out: list[str | ToolCall | Reasoning] = []
        if self.phase == "start":
            self.phase, text, self.buf = "content", self.buf, ""
            out += self._content(text)
        elif self.phase == "think":
            out += self._think(final=True)
        return out + ([] if self.stopped else self.inner.finish())

    def _think(self, final: bool) -> list[str | ToolCall | Reasoning]:
        buf, close = self.buf, self.fmt.close
        end = buf.find(close)
        stop = first_stop(buf, 0, 0, self.stops, ())
        if stop is not None and (end < 0 or stop[0] <= end + len(close)):
            self._stopped = True
            return self._reason(buf[: stop[1]], final=True)
        if end >= 0:
            self.phase, self.buf, self._after = "content", "", True
            return self._reason(buf[:end], final=True) + self._content(buf[end + len(close) :])
        if final:
            return self._reason(buf, final=True)
        hold = 0
        for s in (close, *self.stops):
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.buf = buf[len(buf) - hold :]
        return self._reason(buf[: len(buf) - hold], final=False)

    def _reason(self, piece: str, final: bool) -> list[str | ToolCall | Reasoning]:
        if self._lead:
            piece = piece.lstrip("\n")
            self._lead = not piece
        piece = self._ws + piece
        body = piece.rstrip("\n")
        self._ws = "" if final else piece[len(body) :]
        if not body:
            return []
        self.reasoning = (self.reasoning or "") + body
        return [Reasoning(body)]

    def _content(self, text: str) -> list[str | ToolCall | Reasoning]:
        if self._after:
            text = text.lstrip("\n")
            self._after = not text
        return list(self.inner.feed(text)) if text else []


StreamState = ReplyStream | HeldReply | ThinkStream
"""The stream state of one choice (dispatch.reply_stream)."""
