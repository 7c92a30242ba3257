"""Sampled ids -> the reply a client sees: end at stop strings, parse tool calls (pure).

Data flow: `Gateway.complete` (core.py) gets a choice's sampled ids from the engine and calls
`cut_at_stop` and then `finish_reply` here; the kept ids are recorded, the reply is handed to the
protocol. The engines stop only on token ids, so a stop string is applied after decoding: the
sampled ids are kept up to and including the token that completes the earliest stop string, and
the ids decoded past it are dropped from the record. That is what an engine that stops on the
string records (the stopping rule depends only on the prefix, so the kept ids have the same
distribution), and it keeps turn k+1's prompt an extension of what the agent saw at turn k.
Every kept id stays in the loss, including those of the stop string itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from forgerl.gateway.conversation import Message
from forgerl.gateway.tool_parsers import parse_tool_calls


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
    best: tuple[int, int, bool] | None = None  # (end offset, start offset, text keeps match)
    for strings, keeps in ((stops, False), (closes, True)):
        for s in strings:
            start = full.find(s, max(0, len(prefix) - len(s) + 1))  # must end in sampled text
            if start >= 0 and (best is None or start + len(s) < best[0]):
                best = (start + len(s), start, keeps)
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


def finish_reply(
    cut: Cut, engine_finish: str, declared: set[str] | None
) -> tuple[Message, str, list[str]]:
    """The assistant message, the finish reason and the tool-call parse errors of a choice.

    declared: the rendered tools' names (tool calls are parsed only when tools were rendered);
    None: no tools, the text is the content. finish: "tool_calls" when calls were parsed and
    the choice ended by itself or at a stop string, "stop" at a stop string, else the engine's
    ("stop" / "length"). Parse errors of a choice cut by max_tokens are not reported (C09).
    """
    finish = "stop" if cut.stopped else engine_finish
    if declared is None:
        return Message("assistant", cut.text), finish, []
    parsed = parse_tool_calls(cut.text, declared)
    if parsed.tool_calls and finish == "stop":
        finish = "tool_calls"
    errors = parsed.errors if finish != "length" else []
    return Message("assistant", parsed.content or "", tuple(parsed.tool_calls)), finish, errors
