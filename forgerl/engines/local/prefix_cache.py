"""The local engine's prefix cache: an LRU map from token ids to one sequence's KV cache.

Data flow: after each prefill, and when a row finishes, the row's KV (prompt + completion so far,
unpadded) is inserted; a newcomer's prefill looks up the entry sharing its longest token prefix
and computes only the rest (`LocalEngine._prefill_wave`). A weight update clears it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (H, L, D)


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of two token-id tuples."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """LRU map from token ids to one sequence's KV cache, bounded by the total cached tokens.

    Each entry holds, per layer, keys and values (H, L, D) for its L = len(key) tokens, no
    padding. An entry whose key is a prefix of a newer one is dropped (the newer covers it).
    max_tokens == 0 disables the cache. Not thread-safe: only the engine's worker uses it.
    `routes`: a MoE entry's routed experts (L, layers, top_k) uint8, kept and dropped with it.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens, self.tokens = max_tokens, 0
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.routes: dict[tuple[int, ...], torch.Tensor] = {}

    def longest(self, ids: tuple[int, ...]) -> tuple[int, tuple[int, ...] | None]:
        """(n, key): the entry sharing the longest prefix with `ids`, n capped at len(ids) - 1
        so at least one token is left to prefill (its logits give the next token)."""
        best, best_key = 0, None
        for key in self.entries:
            n = common_prefix(key, ids)
            if n > best:
                best, best_key = n, key
        best = min(best, len(ids) - 1)
        return (best, best_key) if best > 0 else (0, None)

    def lookup(self, ids: tuple[int, ...]) -> tuple[int, KV | None]:
        """(n, KV of the first n tokens of `ids`) for the longest hit, marking it recently used;
        (0, None) on a miss."""
        n, key = self.longest(ids)
        if key is None:
            return 0, None
        self.entries.move_to_end(key)
        return n, [(k[:, :n], v[:, :n]) for k, v in self.entries[key]]

    def routes_of(self, kv: KV, n: int) -> torch.Tensor:
        """The routes of the first n tokens of the entry whose KV `lookup` returned as `kv`."""
        key = next(k for k, e in self.entries.items() if e[0][0].data_ptr() == kv[0][0].data_ptr())
        return self.routes[key][:n]

    def insert(self, ids: tuple[int, ...], kv: KV, routes: torch.Tensor | None = None) -> None:
        """Store `kv` (and a MoE row's `routes`) for `ids` (len(ids) == L); evict least
        recently used entries to fit."""
        n = len(ids)
        if not 0 < n <= self.max_tokens:
            return
        for key in list(self.entries):
            if len(key) >= n and key[:n] == ids:  # already covered by a longer entry
                self.entries.move_to_end(key)
                return
            if ids[: len(key)] == key:
                self._drop(key)
        self.entries[ids] = kv
        if routes is not None:
            self.routes[ids] = routes[:n]
        self.tokens += n
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self.entries)))

    def clear(self) -> None:
        """Forget every entry (after a weight update the cached KV are stale)."""
        self.entries.clear()
        self.routes.clear()
        self.tokens = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        del self.entries[key]
        self.routes.pop(key, None)
        self.tokens -= len(key)
