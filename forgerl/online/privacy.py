"""What of production traffic may be stored: consent, and the PII scrub before storage.

`PrivatePool` is the data pool the online gateway records into; it wraps the SQLite pool and
is the one place a call's record passes before it is stored:

- A session without consent has a trajectory id known only to this process (`open`); its calls
  are answered, and nothing of them is written (no ids, no text, no event, no reward). Its
  feedback only counts in the in-memory metrics (`OnlineService.feedback`).
- A consented call is decoded (prompt ids, completion ids, the request notes) and passed to the
  scrubber; when the scrub changes any of that text, the whole call is dropped (never stored,
  counted in `counters["scrub_dropped_calls"]`). Re-tokenising the scrubbed text is not done:
  the recorded behaviour logprobs belong to the sampled ids, so a re-tokenised completion could
  not be importance-corrected, and its ids would still decode to the personal data. A later
  turn that extends a dropped one carries the same text in its prompt, so it is dropped too.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from forgerl.datapool.sql import SQLPool
from forgerl.types import Completion

Scrubber = Callable[[str], str]
"""Text in, text with personal data replaced out; must return its input unchanged when there
is nothing to scrub (a changed text drops the call)."""

EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
CARD = re.compile(r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)")
PHONE = re.compile(r"(?<![\w+])\+?\(?\d(?:[ ().-]{0,2}\d){8,14}(?!\w)")


def regex_scrub(text: str) -> str:
    """The default scrubber: e-mail addresses → "[email]", card numbers (13-19 digits, spaces or
    dashes between) → "[card]", phone numbers (9-15 digits, optional +, spaces, dots, dashes,
    parentheses; fewer digits are left alone, so dates like 2026-12-06 stay) → "[phone]"."""
    return PHONE.sub("[phone]", CARD.sub("[card]", EMAIL.sub("[email]", text)))


class PrivatePool:
    """A `DataPool` over `pool` that stores nothing of unconsented sessions and drops consented
    calls the scrubber changes (module docstring). Other methods pass through to `pool`.

    decode: token ids → text (the renderer's decode). scrub: None = no scrubbing.
    counters: unconsented_calls, scrub_dropped_calls (calls answered but not stored).
    """

    def __init__(self, pool: SQLPool, decode: Callable[[list[int]], str],
                 scrub: Scrubber | None = regex_scrub) -> None:
        self.pool, self.decode, self.scrub = pool, decode, scrub
        self.unconsented: dict[str, float | None] = {}
        """Unconsented trajectory id → its feedback (None until given); in memory only."""
        self.counters: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def open(self, consent: bool, task_index: int) -> str:
        """A new running trajectory: in the pool (task `task_index`, queued first) when
        `consent`, else an id of this process only (prefix "nc-")."""
        if not consent:
            trajectory_id = f"nc-{uuid.uuid4().hex}"
            self.unconsented[trajectory_id] = None
            return trajectory_id
        self.pool.add_task(task_index, {"online": True})
        return self.pool.create_trajectory(task_index, 0)

    def changed(self, completion: Completion) -> bool:
        """Whether the scrubber changes the call's prompt + completion (one text: personal data
        the prompt begins and the completion ends, "jane@exam" + "ple.com", is caught too) or
        its request notes."""
        if self.scrub is None:
            return False
        texts = (self.decode([*completion.prompt_ids, *completion.completion_ids]),
                 json.dumps(completion.request, ensure_ascii=False))
        return any(self.scrub(t) != t for t in texts)

    def record_calls(self, calls: list[tuple[str, list[Completion], list[list[str]]]]
                     ) -> list[list[int] | Exception]:
        """`SQLitePool.record_calls` for the consented, unscrubbed calls; the others get no turn
        indices (answered, not stored)."""
        out: list[list[int] | Exception] = [[] for _ in calls]
        keep = []
        for i, (trajectory_id, completions, _) in enumerate(calls):
            if trajectory_id in self.unconsented:
                self.counters["unconsented_calls"] += 1
            elif any(self.changed(c) for c in completions):
                self.counters["scrub_dropped_calls"] += 1
            else:
                keep.append(i)
        for i, result in zip(keep, self.pool.record_calls([calls[i] for i in keep]),
                             strict=True):
            out[i] = result
        return out

    def add_completion(self, trajectory_id: str, completion: Completion) -> int:
        """One call's completion, as `record_calls` (-1: not stored)."""
        [turns] = self.record_calls([(trajectory_id, [completion], [[]])])
        if isinstance(turns, Exception):
            raise turns
        return turns[0] if turns else -1

    def add_event(self, trajectory_id: str, *args: Any, **kwargs: Any) -> int:
        """`DataPool.add_event`, except for an unconsented trajectory (nothing stored; -1)."""
        if trajectory_id in self.unconsented:
            return -1
        return self.pool.add_event(trajectory_id, *args, **kwargs)

    def finish_trajectory(self, trajectory_id: str, *args: Any, **kwargs: Any) -> None:
        """`DataPool.finish_trajectory`, except for an unconsented trajectory (nothing stored)."""
        if trajectory_id not in self.unconsented:
            self.pool.finish_trajectory(trajectory_id, *args, **kwargs)
