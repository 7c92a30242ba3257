"""Prefix-tree merging of training samples (Forge §3.2): trie, DFS flattening, row packing.

Samples of one batch often share token prefixes: the G rollouts of a group share the prompt, the
turns of one trajectory extend each other, and a rewritten context branches from the old one.
`build_tree_batch` stores every shared prefix once: it builds a trie over the token ids of all
sequences, flattens it in DFS order and packs it into rows of at most `max_row_tokens` tokens.
Each token's position id is its depth (its index in every path through it) and it may attend
only to its ancestors and itself (`forgerl.trainer.attention`), so the logits at a node equal
those of every sequence through that node run alone. A loss on the merged rows therefore equals
the per-sample loss, and so do its gradients.

Predictions: sequence s, token t >= 1 is predicted by the logits at the node of s[t-1]; it is
listed exactly once (`sample_idx`, `token_idx`), in the one row that owns that node. Targets come
only from parent -> child edges on s's own path, never across a branch or a row boundary
(CASES.md C11). A tree larger than a row is split at subtree boundaries; a split-off subtree
carries a copy of its ancestor chain (not owned, so never predicted twice).

Pure Python and torch on CPU; the trainer moves rows to its device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeRow:
    """One packed row of the prefix tree (N tree tokens, K predictions).

    input_ids: (N,) long, tree tokens in DFS order.
    position_ids: (N,) long, depth in the tree (= position in each path through the token).
    parent: (N,) long, row index of the parent token, -1 for a root.
    pred_pos: (K,) long, row position whose logits predict `target_ids`.
    target_ids: (K,) long, the predicted token id.
    sample_idx: (K,) long, index of the input sequence the prediction belongs to.
    token_idx: (K,) long, index t >= 1 of the predicted token in that sequence.
    temperature: (K,) float32, > 0, the temperature the target was sampled at: its policy
        logprob is log_softmax(logits[pred_pos] / temperature)[target_ids].
    routes: None, or (N, layers, top_k) long, the recorded routed experts of each tree token
        (those of the first sample through its node that has a record of it), -1 where none
        (`routing_replay`).

    Predictions are sorted by (sample_idx, token_idx); several may share one pred_pos (samples
    through the same node), each listed with its own sample.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent: torch.Tensor
    pred_pos: torch.Tensor
    target_ids: torch.Tensor
    sample_idx: torch.Tensor
    token_idx: torch.Tensor
    temperature: torch.Tensor
    routes: torch.Tensor | None = None


@dataclass
class TreeBatch:
    """Rows of a merged batch plus token counts (compression = input / tree tokens)."""

    rows: list[TreeRow]
    num_input_tokens: int
    """Sum of sequence lengths before merging."""
    num_tree_tokens: int
    """Sum of row lengths after merging, counting repeated ancestors."""


class _Trie:
    """Flat trie: node n has token `token[n]`, parent `parent[n]` (-1 = root), depth `depth[n]`."""

    def __init__(self) -> None:
        self.token: list[int] = []
        self.parent: list[int] = []
        self.depth: list[int] = []
        self.children: list[dict[int, int]] = []
        self.root_index: dict[int, int] = {}  # token -> shared root node
        self.roots: list[int] = []

    def _new(self, token: int, parent: int) -> int:
        self.token.append(token)
        self.parent.append(parent)
        self.depth.append(0 if parent < 0 else self.depth[parent] + 1)
        self.children.append({})
        return len(self.token) - 1

    def insert(self, seq: list[int], share: bool) -> list[int]:
        """Add `seq`; return its node path. `share=False` gives it a private chain."""
        path: list[int] = []
        parent = -1
        for tok in seq:
            level = self.root_index if parent < 0 else self.children[parent]
            node = level.get(tok) if share else None
            if node is None:
                node = self._new(tok, parent)
                level[tok] = node  # a private chain's nodes have one child each: no clash
                if parent < 0:
                    self.roots.append(node)
            path.append(node)
            parent = node
        return path

    def subtree_sizes(self) -> list[int]:
        # Children always have larger ids than their parents, so one reverse sweep suffices.
        size = [1] * len(self.token)
        for n in range(len(self.token) - 1, -1, -1):
            if self.parent[n] >= 0:
                size[self.parent[n]] += size[n]
        return size

    def ancestors(self, node: int) -> list[int]:
        """Node ids from the root down to the parent of `node`."""
        out: list[int] = []
        while self.parent[node] >= 0:
            node = self.parent[node]
            out.append(node)
        return out[::-1]

    def dfs(self, node: int) -> list[int]:
        """Node ids of the subtree of `node` in DFS (pre-)order."""
        out: list[int] = []
        stack = [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(reversed(self.children[n].values()))
        return out


def _pieces(trie: _Trie, size: list[int], root: int, cap: int) -> list[list[int]]:
    """Split the tree under `root` into pieces of at most `cap` tokens, at subtree boundaries.

    A piece is the ancestor chain of some node v, then v, then whole child subtrees of v, in DFS
    order: a single tree rooted at `root`. The children of an over-full node are packed greedily
    into pieces that each repeat its chain; a child too big for a fresh piece is split in turn
    (an explicit stack, since a long shared prompt is a chain thousands of nodes deep).
    """
    pieces: list[list[int]] = []
    stack = [root]
    while stack:
        node = stack.pop()
        depth = trie.depth[node]
        if depth + size[node] <= cap:
            pieces.append(trie.ancestors(node) + trie.dfs(node))
            continue
        groups: list[list[int]] = []
        current: list[int] = []
        deferred: list[int] = []
        for child in trie.children[node].values():
            if depth + 1 + len(current) + size[child] <= cap:
                current.extend(trie.dfs(child))
            elif depth + 1 + size[child] <= cap:  # current is non-empty here
                groups.append(current)
                current = trie.dfs(child)
            else:
                deferred.append(child)
        if current:
            groups.append(current)
        prefix = [*trie.ancestors(node), node]
        pieces.extend(prefix + group for group in groups)
        stack.extend(reversed(deferred))
    return pieces


def _first_fit(pieces: list[list[int]], cap: int) -> list[list[int]]:
    """Pack pieces into rows of at most `cap` tokens, first-fit in input order (so sequences
    keep their order when nothing is shared)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for piece in pieces:
        for r, room in enumerate(free):
            if len(piece) <= room:
                rows[r].extend(piece)
                free[r] -= len(piece)
                break
        else:
            rows.append(list(piece))
            free.append(cap - len(piece))
    return rows


def build_tree_batch(
    sequences: list[list[int]],
    max_row_tokens: int,
    needed: list[list[bool]] | None = None,
    merge: bool = True,
    temperatures: list[list[float]] | None = None,
    routes: list[torch.Tensor | None] | None = None,
) -> TreeBatch:
    """Merge `sequences` into a prefix tree and pack it into rows of <= `max_row_tokens` tokens.

    Args:
        sequences: token ids of each sample (prompt + completions of one trajectory branch).
        max_row_tokens: row capacity N_max; each row attends within itself only.
        needed: needed[s][t] says whether (s, t) is predicted (t = 0 is never predicted);
            None = every t >= 1. Typically the loss mask of completion tokens.
        merge: False packs each sequence as its own path with no sharing (plain packing).
        temperatures: temperatures[s][t] > 0 is the sampling temperature of token t of
            sequence s (per token, since samples through one node may have been sampled at
            different temperatures); None = 1.0 everywhere. Carried to `TreeRow.temperature`.
        routes: routes[s] is None or (T_s, layers, top_k) long, the recorded routed experts of
            the first T_s <= len(sequences[s]) tokens of sequence s; a node takes those of the
            first sequence (lowest s) through it that has them (`TreeRow.routes`).

    Returns:
        TreeBatch whose rows together list every needed (s, t) exactly once, in a row holding the
        whole path s[:t], so the logits at `pred_pos` see exactly s[:t].

    Raises:
        ValueError: a sequence is longer than `max_row_tokens`, `needed` or `temperatures` has
            the wrong shape, or a needed token's temperature is not > 0.
    """
    lengths = [len(s) for s in sequences]
    if needed is not None and [len(m) for m in needed] != lengths:
        raise ValueError("needed must have one flag per token of each sequence")
    if temperatures is not None and [len(t) for t in temperatures] != lengths:
        raise ValueError("temperatures must have one value per token of each sequence")
    trie = _Trie()
    paths: list[list[int]] = []
    for s, seq in enumerate(sequences):
        if len(seq) > max_row_tokens:
            raise ValueError(
                f"sequence {s} has {len(seq)} tokens, more than max_row_tokens={max_row_tokens}"
            )
        paths.append(trie.insert(list(seq), share=merge))
    size = trie.subtree_sizes()
    pieces = [p for root in trie.roots for p in _pieces(trie, size, root, max_row_tokens)]
    node_rows = _first_fit(pieces, max_row_tokens)

    owner: dict[int, tuple[int, int]] = {}  # node -> (row, position) of its first occurrence
    for r, nodes in enumerate(node_rows):
        for i, n in enumerate(nodes):
            owner.setdefault(n, (r, i))
    preds: list[list[tuple[int, int, int, int, float]]] = [[] for _ in node_rows]
    for s, (seq, path) in enumerate(zip(sequences, paths, strict=True)):
        for t in range(1, len(seq)):
            if needed is None or needed[s][t]:
                temp = 1.0 if temperatures is None else float(temperatures[s][t])
                if not temp > 0:
                    raise ValueError(f"sequence {s} token {t}: temperature {temp} is not > 0")
                r, i = owner[path[t - 1]]
                preds[r].append((s, t, i, seq[t], temp))
    rows = [_make_row(trie, nodes, p) for nodes, p in zip(node_rows, preds, strict=True)]
    if routes is not None and any(r is not None for r in routes):
        _route_rows(rows, node_rows, paths, routes)
    return TreeBatch(
        rows=rows,
        num_input_tokens=sum(len(s) for s in sequences),
        num_tree_tokens=sum(len(n) for n in node_rows),
    )


def _route_rows(rows: list[TreeRow], node_rows: list[list[int]], paths: list[list[int]],
                routes: list[torch.Tensor | None]) -> None:
    """Set each row's `routes`: per node, the record of the first sequence through it."""
    flat = torch.cat([r for r in routes if r is not None])  # (Σ T_s, layers, top_k)
    source: dict[int, int] = {}  # node -> index into flat
    offset = 0
    for path, r in zip(paths, routes, strict=True):
        if r is not None:
            for t, node in enumerate(path[: len(r)]):
                source.setdefault(node, offset + t)
            offset += len(r)
    for row, nodes in zip(rows, node_rows, strict=True):
        at = torch.tensor([source.get(n, -1) for n in nodes], dtype=torch.long)
        row.routes = torch.where((at >= 0)[:, None, None], flat[at.clamp(min=0)], -1)


def _make_row(
    trie: _Trie, nodes: list[int], preds: list[tuple[int, int, int, int, float]]
) -> TreeRow:
    """Tensors of one row; a node's parent is the latest earlier copy of its trie parent."""
    last: dict[int, int] = {}
    parent: list[int] = []
    for i, n in enumerate(nodes):
        p = trie.parent[n]
        parent.append(last[p] if p >= 0 else -1)
        last[n] = i
    preds = sorted(preds)

    def col(k: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor([p[k] for p in preds], dtype=dtype)

    return TreeRow(
        input_ids=torch.tensor([trie.token[n] for n in nodes], dtype=torch.long),
        position_ids=torch.tensor([trie.depth[n] for n in nodes], dtype=torch.long),
        parent=torch.tensor(parent, dtype=torch.long),
        pred_pos=col(2),
        target_ids=col(3),
        sample_idx=col(0),
        token_idx=col(1),
        temperature=col(4, torch.float32),
    )
