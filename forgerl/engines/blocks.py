"""Chained block hashes of token ids: the names of KV prefixes shared by the router's prefix
index (forgerl/gateway/routing.py) and the engines' global KV pool (forgerl/engines/kv_pool.py).

Python hashes tuples of ints the same way in every process (PYTHONHASHSEED salts only str and
bytes), so two processes name a prefix alike.
"""

from __future__ import annotations

from collections.abc import Sequence

BLOCK = 16  # tokens per block


def block_hashes(ids: Sequence[int]) -> list[int]:
    """Chained hashes of the full BLOCK-token blocks of `ids`: h_k = hash((h_{k-1}, block_k)), so
    h_k names the whole prefix ids[: (k + 1) · BLOCK] (a node of a block trie). A partial last
    block is left out."""
    out, h = [], 0
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(ids[start : start + BLOCK])))
        out.append(h)
    return out
