"""The local engine's prefix cache: an LRU map from token ids to one sequence's KV cache.

Data flow: after each prefill, and when a row finishes, the row's KV (prompt + completion so far,
unpadded) is inserted; a newcomer's prefill looks up the entry sharing its longest token prefix
and computes only the rest (`LocalEngine._prefill_wave`). A weight update clears it. KV built
under a LoRA adapter lives in that adapter version's namespace `ns` (`engines/local/adapters.py`):
a lookup only ever hits entries of its own namespace (CASES.md C23).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

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


@dataclass(frozen=True)
class _Tag:
    """The first element of a namespaced entry's key; equal to no token id."""

    ns: object


def _key(ids: tuple[int, ...], ns: object) -> tuple:
    return ids if ns is None else (_Tag(ns), *ids)


class PrefixCache:
    """LRU map from token ids to one sequence's KV cache, bounded by the total cached tokens.

    Each entry holds, per layer, keys and values (H, L, D) for its L = len(key) tokens, no
    padding. An entry whose key is a prefix of a newer one is dropped (the newer covers it).
    max_tokens == 0 disables the cache. Not thread-safe: only the engine's worker uses it.
    `routes`: a MoE entry's routed experts (L, layers, top_k) uint8, kept and dropped with it.
    `ns` (hashable, None for the base): entries of one namespace never serve another's lookups.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens, self.tokens = max_tokens, 0
        self.entries: OrderedDict[tuple[int, ...], KV] = OrderedDict()
        self.routes: dict[tuple[int, ...], torch.Tensor] = {}

    def longest(self, ids: tuple[int, ...], ns: object = None) -> tuple[int, tuple | None]:
        """(n, key): the entry of namespace `ns` sharing the longest prefix with `ids`, n capped
        at len(ids) - 1 so at least one token is left to prefill (its logits give the next
        token)."""
        best, best_key, query, tag = 0, None, _key(ids, ns), ns is not None
        for key in self.entries:
            n = common_prefix(key, query)
            if n > best:
                best, best_key = n, key
        best = min(best - tag, len(ids) - 1) if best_key is not None else 0
        return (best, best_key) if best > 0 else (0, None)

    def lookup(self, ids: tuple[int, ...], ns: object = None) -> tuple[int, KV | None]:
        """(n, KV of the first n tokens of `ids`) for the longest hit in namespace `ns`, marking
        it recently used; (0, None) on a miss."""
        n, key = self.longest(ids, ns)
        if key is None:
            return 0, None
        self.entries.move_to_end(key)
        return n, [(k[:, :n], v[:, :n]) for k, v in self.entries[key]]

    def routes_of(self, kv: KV, n: int) -> torch.Tensor:
        """The routes of the first n tokens of the entry whose KV `lookup` returned as `kv`."""
        key = next(k for k, e in self.entries.items() if e[0][0].data_ptr() == kv[0][0].data_ptr())
        return self.routes[key][:n]

    def insert(self, ids: tuple[int, ...], kv: KV, routes: torch.Tensor | None = None,
               ns: object = None) -> None:
        """Store `kv` (and a MoE row's `routes`) for `ids` (len(ids) == L) in namespace `ns`;
        evict least recently used entries to fit."""
        n = len(ids)
        if not 0 < n <= self.max_tokens:
            return
        ids = _key(ids, ns)
        for key in list(self.entries):
            if len(key) >= len(ids) and key[:len(ids)] == ids:  # covered by a longer entry
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

    def drop(self, ns: object) -> None:
        """Forget every entry of namespace `ns` (an adapter version no request will use)."""
        for key in [k for k in self.entries if k and k[0] == _Tag(ns)]:
            self._drop(key)

    def _drop(self, key: tuple) -> None:
        del self.entries[key]
        self.routes.pop(key, None)
        self.tokens -= len(key) - isinstance(key[0], _Tag)
