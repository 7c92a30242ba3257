"""Tree attention masks for prefix-tree rows: each token attends to its ancestors and itself only.

The only kernel-dependent part of the prefix tree. A row is in DFS order, so the subtree of
token j is the contiguous range [j, exit[j]); j is an ancestor-or-self of i iff
j <= i < exit[j]. From that interval test:

- `TREE_SDPA` (default wherever the model runs sdpa and FlexAttention is not used): per block
  of 128 queries, SDPA over only the keys that block may see (`tree_blocks`, `tree_sdpa`), so
  sibling branches cost nothing; no (N, N) mask is built.
- `sdpa` (the fallback for a family that slices the mask): a dense float additive mask
  (1, 1, N, N), shared by all layers.
- `eager`: the same as a float additive mask (0 or the dtype's minimum); eager attention adds
  the mask to the scores, so a boolean mask would be silently wrong there.
- `flex_attention` on CUDA: a compiled FlexAttention `BlockMask` from the same interval test,
  which skips fully masked blocks (FlexAttention has no backward on CPU).

transformers 5.x passes a 4D mask (tensor or BlockMask) through unchanged (`masking_utils.
_preprocess_mask_arguments` returns early for any 4D mask), so the mask built here is the one
the attention kernel sees; tests/trainer/test_prefix_tree.py checks the logits numerically.

The trainer picks the implementation per device (`tree_forward.checked_attn_implementation`: flex on
CUDA, else TREE_SDPA or the model's own eager) and sets it only around its own forwards and
backwards (`attn_implementation`; checkpointed layers recompute under it).
`tree_forward.check_tree_support` is the start-up gate: a model is trained only if its own
forward, fed a tree row, gives the logits of each path run alone
(tests/trainer/test_model_families.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from forgerl.trainer.prefix_tree import TreeRow

TREE_LAYER_TYPES = {"full_attention", "sliding_attention"}  # layers that take a 4D mask


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


def _sees(exit_: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The interval test, broadcast over `q` and `kv` (long positions): token kv is an
    ancestor of token q or q itself iff kv <= q < exit[kv]."""
    return (kv <= q) & (exit_[kv] > q)


def ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    """(N, N) bool, [i, j] True iff token j is an ancestor of token i or i itself."""
    idx = torch.arange(parent.numel())
    return _sees(subtree_exit(parent), idx[:, None], idx[None, :])


def _flex_block_mask(parent: torch.Tensor, device: torch.device) -> object:
    from torch.nn.attention.flex_attention import create_block_mask  # lazy: CUDA path only

    exit_ = subtree_exit(parent).to(device)
    n = parent.numel()

    def is_ancestor(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor):
        return _sees(exit_, q, kv)

    return create_block_mask(is_ancestor, None, None, n, n, device=device, _compile=True)


TREE_SDPA = "forgerl_tree_sdpa"
"""Block-sparse tree attention (`tree_sdpa`), registered with transformers' AttentionInterface."""
TREE_BLOCK_TOKENS = 128
"""Query tokens per block of `tree_blocks` (64 to 256 timed alike on the SmolLM2 row below)."""


class TreeBlocks(torch.Tensor):
    """A zero-storage (1, 1, N, N) placeholder mask that carries a row's query blocks for
    `tree_sdpa`: `blocks` lists (start, end, keys (K,) long, mask (end - start, K) float
    additive). transformers passes any 4D mask to the attention function unchanged."""

    blocks: list[tuple[int, int, torch.Tensor, torch.Tensor]]


def tree_blocks(parent: torch.Tensor, dtype: torch.dtype, device: torch.device,
                block: int = TREE_BLOCK_TOKENS) -> TreeBlocks:
    """Query blocks of `block` (>= 1) consecutive tokens of a DFS-ordered row (`parent` (N,)
    long, -1 for roots, parent[i] < i), each with the only keys any of its queries may attend
    to: token j is needed by block [a, b) iff j < b and its subtree [j, exit[j]) reaches a;
    each block's mask is additive in `dtype` (0 or its minimum). A branch's block skips its
    siblings' tokens, which a dense mask computes and discards."""
    exit_ = subtree_exit(parent).to(device)
    n = parent.numel()
    idx = torch.arange(n, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    mask = zero.expand(1, 1, n, n).as_subclass(TreeBlocks)
    mask.blocks = []
    for a in range(0, n, block):
        b = min(a + block, n)
        keys = ((idx < b) & (exit_ > a)).nonzero().squeeze(1)  # (K,)
        allowed = _sees(exit_, idx[a:b, None], keys[None])  # (b - a, K)
        mask.blocks.append((a, b, keys, torch.where(allowed, zero, torch.finfo(dtype).min)))
    return mask


def tree_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: TreeBlocks, scaling: float | None = None,
              dropout: float = 0.0, **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers attention function over the blocks of `tree_blocks`: per query block, SDPA
    on the gathered keys it may attend to. query (1, H, N, D), key and value (1, H_kv, N, D)
    (grouped-query heads shared, not repeated); returns ((1, N, H, D), None). Exactly the dense
    tree-masked attention up to float rounding (tests/trainer/test_attention.py). Any other
    mask (None: causal) goes to transformers' sdpa; a placeholder that lost its blocks (a
    family that sliced or copied the mask) raises ValueError: it masks nothing. One row only
    (batch 1); `dropout` as the layer passes it (0 in eval mode); a soft-cap, attention sinks
    or a position bias raise ValueError (`checked_attn_implementation` then falls back to
    dense sdpa)."""
    if any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "position_bias")):
        raise ValueError("tree attention has no soft-cap, attention sinks or position bias")
    blocks = getattr(attention_mask, "blocks", None)
    if blocks is None:
        if isinstance(attention_mask, TreeBlocks):
            raise ValueError("the tree mask reached attention without its blocks")
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    outs = []
    for a, b, keys, mask in blocks:
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key.index_select(2, keys), value.index_select(2, keys),
            attn_mask=mask[None, None], dropout_p=dropout, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1]))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(TREE_SDPA, tree_sdpa)


def tree_attention_mask(model: torch.nn.Module, row: TreeRow) -> object:
    """The attention mask for `row` in the form `model`'s attention implementation needs.

    Returns a BlockMask under `flex_attention` on CUDA, the `tree_blocks` of the row under
    `TREE_SDPA`; otherwise a dense (1, 1, N, N) tensor on
    the model's device: float additive (0 or the dtype's minimum, model dtype) for `eager` and
    `sdpa`, bool for others. Under sdpa the float mask is one tensor shared by every layer's
    backward; a bool one is converted, and the copy saved, by each layer (CPU flash attention:
    4·N² bytes per layer, 30 GiB for SmolLM2 at 16k tokens).
    """
    param = next(model.parameters())
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == "flex_attention" and param.device.type == "cuda":
        return _flex_block_mask(row.parent, param.device)
    if impl == TREE_SDPA:
        return tree_blocks(row.parent, param.dtype, param.device, TREE_BLOCK_TOKENS)
    mask = ancestor_mask(row.parent).to(param.device)[None, None]  # (1, 1, N, N)
    if impl in ("eager", "sdpa"):  # sdpa on CPU saves its own float copy of a bool mask per layer
        zero = torch.zeros((), dtype=param.dtype, device=param.device)
        return torch.where(mask, zero, torch.finfo(param.dtype).min)
    return mask


def preferred_attn_implementation(model: torch.nn.Module, device: torch.device | str) -> str:
    """Attention implementation for tree rows: FlexAttention on CUDA when the family supports
    it; otherwise `TREE_SDPA` where the model runs sdpa (or flex, which has no CPU backward),
    else the model's own (eager for families without sdpa such as Gemma2)."""
    if torch.device(device).type == "cuda" and getattr(model, "_supports_flex_attn", False):
        return "flex_attention"
    impl = model.config._attn_implementation
    return TREE_SDPA if impl in ("sdpa", "flex_attention") else impl


@contextlib.contextmanager
def attn_implementation(model: torch.nn.Module, impl: str) -> Iterator[None]:
    """Run `model` with attention implementation `impl` inside the block, then restore it.

    The trainer's tree rows need `impl` (flex on CUDA); the engine deep-copies the same model
    object at start-up and must keep the implementation it was loaded with.
    """
    old = model.config._attn_implementation
    model.config._attn_implementation = impl
    try:
        yield
    finally:
        model.config._attn_implementation = old
