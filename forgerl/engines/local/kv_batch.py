"""The local engine's running batch: its rows (`_Request`) and their left-padded KV cache.

Data flow: a prefill makes a `_Batch` over a `_KVCache` of `_GrowingLayer`s; each decode step
appends one column in place; finished rows leave through `select`, newcomers join through
`merge`, and `row_kv` copies one row's KV out for the prefix cache. Each `_Request` carries one
stream() call's sampling state and streams its tokens to the caller's event loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from forgerl.engines.base import TokenEvent
from forgerl.engines.local.prefix_cache import KV
from forgerl.engines.local.routes import joined
from forgerl.engines.worker import push
from forgerl.types import FinishReason, GenerateOutput, Routes, SamplingParams


@dataclass
class _Request:
    """One stream() call as the worker sees it; completion fields grow one token per step.

    events: the caller's queue of TokenEvent, then GenerateOutput (or an exception); only `loop`
    touches it (the worker goes through `push`). cancelled: set on the caller's side when the
    consumer goes away; the worker drops the row at its next step (a bool store is atomic).
    routes: None for a dense model, else chunks of the routed experts (tokens, layers, top_k)
    uint8 of every token fed so far (`routes.RouteRecorder`). adapter: the LoRA adapter the row
    decodes under (None: the base), adapter_version: its version, stamped when the row is first
    admitted and kept to the end (`adapters.py`); a token's recorded version is then that one.
    """

    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator | None
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    cancelled: bool = False
    routes: list[torch.Tensor] | None = None
    draft_hidden: torch.Tensor | None = None  # (H,) last final hidden state (speculative.py)
    adapter: str | None = None
    adapter_version: int | None = None

    @property
    def ns(self) -> tuple[str, int] | None:
        """The prefix-cache namespace of this row's KV: (adapter, version), None for the base."""
        return None if self.adapter is None else (self.adapter, self.adapter_version)

    def record(self, token: int, logprob: float, version: int, sampled_at: float) -> None:
        """Append and stream one sampled token; set finish_reason when it stops the completion."""
        self.completion_ids.append(token)
        self.logprobs.append(logprob)
        if self.adapter_version is not None:
            version = self.adapter_version
        self.weight_versions.append(version)
        self.push(TokenEvent(token, logprob, version, sampled_at))
        if token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.completion_ids) >= self.params.max_tokens:
            self.finish_reason = "length"

    def resolve(self, reason: FinishReason | None = None) -> None:
        """Hand the output (or abort with the partial completion) to the caller's event loop."""
        out = GenerateOutput(
            list(self.completion_ids),
            list(self.logprobs),
            list(self.weight_versions),
            reason or self.finish_reason or "abort",
            routed_experts=None if not self.routes else Routes(
                joined(self.routes).numpy().tobytes(), *self.routes[0].shape[1:]),
        )
        self.push(out)

    def push(self, item: TokenEvent | GenerateOutput | Exception) -> None:
        """Queue `item` for the consumer (from the worker thread)."""
        if not push(self.loop, self.events, item):  # the caller's loop is closed: nobody listens
            self.cancelled = True


def _fail(rows: list[_Request], exc: Exception) -> None:
    """Raise `exc` in the callers of `rows` (from the worker thread)."""
    for req in rows:
        req.push(exc)


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zero-pad `x` on the left along `dim` up to `length`."""
    missing = length - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values, (B, H, L, D), are views `buf[:B, :, start:end]` into
    buffers (B', H, C, D) with free columns after `end`, so a decode step writes its column in
    place instead of copying the layer's whole cache (DynamicLayer's torch.cat: 15 MB per
    SmolLM2 layer at 16 rows x 600 tokens, in all 30 layers, every step). `keep` drops rows and
    leading columns in place too; a buffer is reallocated, with SPARE free columns, only when it
    is full, when the batch grew, or when the tensors were replaced from outside."""

    SPARE = 64

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, n, d = key_states.shape
        length = self.keys.shape[-2] if self.keys.numel() else 0
        if (self._owned() and b == len(self.keys)
                and self._start + length + n <= self._bufs[0].shape[2]):
            start = self._start
        else:
            self._bufs = tuple(key_states.new_empty(b, h, length + n + self.SPARE, d) for _ in "kv")
            if length:
                self._bufs[0][:, :, :length], self._bufs[1][:, :, :length] = self.keys, self.values
            start = 0
        for buf, x in zip(self._bufs, (key_states, value_states), strict=True):
            buf[:b, :, start + length:start + length + n] = x
        return self._show(b, start, start + length + n)

    def keep(self, rows: list[int], drop: int) -> None:
        """Keep rows `rows` (ascending) and drop the first `drop` columns, moving rows within
        the buffers (no allocation); tensors replaced from outside are gathered instead."""
        if not self._owned():
            idx = torch.tensor(rows, dtype=torch.long, device=self.keys.device)
            self.keys = self.keys[:, :, drop:].index_select(0, idx)
            self.values = self.values[:, :, drop:].index_select(0, idx)
            return
        start, end = self._start + drop, self._start + self.keys.shape[2]
        for buf in self._bufs:
            for j, i in enumerate(rows):
                if i != j:  # i > j: row j is free already
                    buf[j, :, start:end] = buf[i, :, start:end]
        self._show(len(rows), start, end)

    def _owned(self) -> bool:
        """Whether `keys` is still this layer's own view (not replaced from outside)."""
        return "_view" in vars(self) and self.keys is self._view

    def _show(self, rows: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._start = start
        self.keys, self.values = (buf[:rows, :, start:end] for buf in self._bufs)
        self._view = self.keys
        return self.keys, self.values


class _KVCache(DynamicCache):
    """A DynamicCache of `_GrowingLayer`s (one per decoder layer, made at its first update),
    filled from `past` (per layer (keys, values), each (B, H, L, D)) when given."""

    def __init__(self, past: KV | None = None) -> None:
        Cache.__init__(self, layer_class_to_replicate=_GrowingLayer)
        for i, (keys, values) in enumerate(past or []):
            self.update(keys, values, i)


class _Batch:
    """Running rows with their left-padded KV cache.

    mask: (B, L) int64, 1 where the cache holds a real token. positions: (B,) int64, the
    position id of each row's pending token (= its count of real cached tokens). next_ids: (B,)
    int64, the last sampled token per row, fed at the next decode step.
    """

    def __init__(
        self,
        rows: list[_Request],
        cache: DynamicCache,
        mask: torch.Tensor,
        positions: torch.Tensor,
        next_ids: torch.Tensor,
    ) -> None:
        self.rows, self.cache, self.mask = rows, cache, mask
        self.positions, self.next_ids = positions, next_ids

    def select(self, keep: list[int]) -> None:
        """Keep only rows `keep` (ascending) and trim cache columns that are padding in every
        kept row."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.rows = [self.rows[i] for i in keep]
        self.mask, self.positions = self.mask[idx], self.positions[idx]
        self.next_ids = self.next_ids[idx]
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        self.mask = self.mask[:, start:]
        for layer in self.cache.layers:
            layer.keep(keep, start)

    def row_kv(self, i: int) -> KV:
        """Row i's cached KV without padding: per layer (keys, values), each (H, L_i, D), new
        tensors (the batch's buffers are reused in place)."""
        cols = self.mask[i].nonzero().squeeze(1)
        return [
            (layer.keys[i].index_select(1, cols), layer.values[i].index_select(1, cols))
            for layer in self.cache.layers
        ]

    def merge(self, other: _Batch) -> None:
        """Append `other`'s rows, left-padding both caches to a common length."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, length, 1), _left_pad(other.mask, length, 1)])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat(
                [_left_pad(mine.keys, length, 2), _left_pad(theirs.keys, length, 2)]
            )
            mine.values = torch.cat(
                [_left_pad(mine.values, length, 2), _left_pad(theirs.values, length, 2)]
            )
        self.rows = self.rows + other.rows
        self.positions = torch.cat([self.positions, other.positions])
        self.next_ids = torch.cat([self.next_ids, other.next_ids])
