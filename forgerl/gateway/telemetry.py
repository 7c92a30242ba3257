"""What one HTTP request did, noted by any layer of the gateway while the request runs.

Data flow: the HTTP layer opens an entry for each request (`begin`); the protocol, policy and
core code add to it with `note(...)` (session, trace, protocol, token counts, fields ignored or
applied approximately, refusals); when the response ends the HTTP layer closes the entry and
writes it to the run's request log and counters. Outside a request `note` does nothing.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

_entry: ContextVar[dict[str, Any] | None] = ContextVar("forgerl_request_entry", default=None)


def begin() -> dict[str, Any]:
    """Open the entry of the request now running in this context; returns it (a plain dict)."""
    entry: dict[str, Any] = {}
    _entry.set(entry)
    return entry


def note(**fields: Any) -> None:
    """Set fields of the current request's entry (no-op outside a request). A list or dict
    value extends/updates what is already noted under its key instead of replacing it."""
    entry = _entry.get()
    if entry is None:
        return
    for key, value in fields.items():
        old = entry.get(key)
        if isinstance(old, list) and isinstance(value, list):
            old.extend(value)
        elif isinstance(old, dict) and isinstance(value, dict):
            old.update(value)
        else:
            entry[key] = value
