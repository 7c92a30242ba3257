"""The thread ↔ asyncio shell shared by the in-process engines (`LocalEngine`, `VllmEngine`).

Data flow: an engine's state (model, KV cache, running batch) belongs to one daemon thread. Callers
on an asyncio event loop put requests and weight updates into `_inbox` and await an
`asyncio.Queue` or future; the thread takes inbox items between two steps (`_serve`) and answers
through `loop.call_soon_threadsafe` (`push`, `WeightUpdate.settle`), so a result reaches its
caller one event-loop wake-up after the thread produced it. `close()` puts the stop marker (None)
and waits for the thread; items that raced with it are handed back by `_leftovers`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


def push(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, item: object) -> bool:
    """Queue `item` on `events` from the worker thread; False when `loop` is closed (nobody is
    listening any more)."""
    try:
        loop.call_soon_threadsafe(events.put_nowait, item)
    except RuntimeError:
        return False
    return True


@dataclass
class WeightUpdate:
    """A weight update on its way to the worker thread: `weights` (the engine's own payload),
    `version` to publish, and the caller's `future` on `loop`, settled by the thread."""

    weights: Any
    version: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def settle(self, result: object = None, error: bool = False) -> None:
        """Set the future's result (or exception when `error`) from the worker thread; a no-op
        if it is done (the caller went away) or its loop is closed."""

        def _set() -> None:
            if not self.future.done():
                if error:
                    self.future.set_exception(result)  # type: ignore[arg-type]
                else:
                    self.future.set_result(result)

        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_set)


class ThreadWorker:
    """Base of an engine whose state one daemon thread owns.

    The subclass implements `_run` (the thread's body: usually setup, then `_serve`, then
    aborting what is left) and `_take` (one inbox item, on the thread), and sets
    `_closed_message`, the RuntimeError text after close().
    """

    _closed_message = "engine is closed"

    def _start_worker(self, name: str, *args: object) -> None:
        """Start the thread on `self._run(*args)`."""
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=args, name=name, daemon=True)
        self._thread.start()

    def _run(self, *args: object) -> None:
        raise NotImplementedError

    def _take(self, item: Any) -> None:
        raise NotImplementedError

    async def _submit_update(self, weights: object, version: int) -> None:
        """Hand a weight update to the thread and wait until it is applied (or raises there);
        RuntimeError after close()."""
        if self._closed:
            raise RuntimeError(self._closed_message)
        loop = asyncio.get_running_loop()
        update = WeightUpdate(weights, version, loop.create_future(), loop)
        self._inbox.put(update)
        await update.future

    def _serve(self, busy: Callable[[], bool], step: Callable[[], None],
               idle: Callable[[], None] | None = None) -> None:
        """The thread's loop until the stop marker: take inbox items (blocking, after `idle()`,
        while not `busy()`), then run one `step()` if there is work."""
        while True:
            block = not busy()
            if block and idle is not None:
                idle()
            if not self._drain(block):
                return
            if busy():
                step()

    def _drain(self, block: bool) -> bool:
        """Hand inbox items to `_take` until the inbox is empty (waiting for the first one when
        `block`); False at the stop marker."""
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            self._take(item)

    def _leftovers(self) -> Iterator[Any]:
        """Items put after the stop marker (raced with close()): nothing will serve them."""
        while not self._inbox.empty():
            item = self._inbox.get()
            if item is not None:
                yield item

    async def close(self) -> None:
        """Stop the thread; in-flight and queued requests finish with "abort". Idempotent."""
        if not self._closed:
            self._closed = True
            self._inbox.put(None)
        await asyncio.to_thread(self._thread.join)
