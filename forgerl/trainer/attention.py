"""Tree attention masks for prefix-tree rows: each token attends to its ancestors and itself only.

The only kernel-dependent part of the prefix tree. A row is in DFS order, so the subtree of
token j is the contiguous range [j, exit[j]); j is an ancestor-or-self of i iff
j <= i < exit[j]. From that interval test:

- `sdpa` (CPU default, tested): a dense boolean mask (1, 1, N, N), True = attend.
- `eager`: the same as a float additive mask (0 or the dtype's minimum); eager attention adds
  the mask to the scores, so a boolean mask would be silently wrong there.
- `flex_attention` on CUDA: a compiled FlexAttention `BlockMask` from the same interval test,
  which skips fully masked blocks (FlexAttention has no backward on CPU, so CPU stays dense).

transformers 5.x passes a 4D mask (tensor or BlockMask) through unchanged (`masking_utils.
_preprocess_mask_arguments` returns early for any 4D mask), so the mask built here is the one
the attention kernel sees; tests/trainer/test_prefix_tree.py checks the logits numerically.
"""

from __future__ import annotations

import torch

from forgerl.trainer.prefix_tree import TreeRow


def subtree_exit(parent: torch.Tensor) -> torch.Tensor:
    """(N,) long exit index of each token's subtree in a DFS-ordered row: subtree(j) = [j, exit[j]).

    `parent` is (N,) long with -1 for roots and parent[i] < i. O(N) sweep from the end.
    """
    parents = parent.tolist()
    size = [1] * len(parents)
    for i in range(len(parents) - 1, -1, -1):
        if parents[i] >= 0:
            size[parents[i]] += size[i]
    return torch.arange(len(parents)) + torch.tensor(size, dtype=torch.long)


def ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    """(N, N) bool, [i, j] True iff token j is an ancestor of token i or i itself."""
    exit_ = subtree_exit(parent)
    idx = torch.arange(parent.numel())
    return (idx[None, :] <= idx[:, None]) & (exit_[None, :] > idx[:, None])


def _flex_block_mask(parent: torch.Tensor, device: torch.device) -> object:
    from torch.nn.attention.flex_attention import create_block_mask

    exit_ = subtree_exit(parent).to(device)
    n = parent.numel()

    def is_ancestor(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor):
        return (kv <= q) & (exit_[kv] > q)

    return create_block_mask(is_ancestor, None, None, n, n, device=device, _compile=True)


def tree_attention_mask(model: torch.nn.Module, row: TreeRow) -> object:
    """The attention mask for `row` in the form `model`'s attention implementation needs.

    Returns a BlockMask under `flex_attention` on CUDA; otherwise a dense (1, 1, N, N) tensor on
    the model's device: bool for `sdpa` and others, float additive (model dtype) for `eager`.
    """
    param = next(model.parameters())
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == "flex_attention" and param.device.type == "cuda":
        return _flex_block_mask(row.parent, param.device)
    mask = ancestor_mask(row.parent).to(param.device)[None, None]  # (1, 1, N, N)
    if impl == "eager":
        zero = torch.zeros((), dtype=param.dtype, device=param.device)
        return torch.where(mask, zero, torch.finfo(param.dtype).min)
    return mask


def preferred_attn_implementation(device: torch.device | str) -> str:
    """Attention implementation to load the policy with for tree rows: flex on CUDA, else sdpa."""
    return "flex_attention" if torch.device(device).type == "cuda" else "sdpa"
