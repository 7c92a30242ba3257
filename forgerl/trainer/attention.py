"""Tree attention masks for prefix-tree rows: each token attends to its ancestors and itself only.

The only kernel-dependent part of the prefix tree. A row is in DFS order, so the subtree of
token j is the contiguous range [j, exit[j]); j is an ancestor-or-self of i iff
j <= i < exit[j]. From that interval test:

- `sdpa` (CPU default, tested): a dense float additive mask (1, 1, N, N), shared by all layers.
- `eager`: the same as a float additive mask (0 or the dtype's minimum); eager attention adds
  the mask to the scores, so a boolean mask would be silently wrong there.
- `flex_attention` on CUDA: a compiled FlexAttention `BlockMask` from the same interval test,
  which skips fully masked blocks (FlexAttention has no backward on CPU, so CPU stays dense).

transformers 5.x passes a 4D mask (tensor or BlockMask) through unchanged (`masking_utils.
_preprocess_mask_arguments` returns early for any 4D mask), so the mask built here is the one
the attention kernel sees; tests/trainer/test_prefix_tree.py checks the logits numerically.

The trainer picks the implementation per device (`preferred_attn_implementation`: flex on
CUDA, the model's own sdpa/eager on CPU) and sets it only around its own forwards
(`attn_implementation`). `check_tree_support` is the start-up gate: a model is trained only if
its own forward, fed a tree row, gives the logits of each path run alone
(tests/trainer/test_model_families.py).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch

from forgerl.trainer.prefix_tree import TreeRow, build_tree_batch, forward_logprobs

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
    the model's device: float additive (0 or the dtype's minimum, model dtype) for `eager` and
    `sdpa`, bool for others. Under sdpa the float mask is one tensor shared by every layer's
    backward; a bool one is converted, and the copy saved, by each layer (CPU flash attention:
    4·N² bytes per layer, 30 GiB for SmolLM2 at 16k tokens).
    """
    param = next(model.parameters())
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == "flex_attention" and param.device.type == "cuda":
        return _flex_block_mask(row.parent, param.device)
    mask = ancestor_mask(row.parent).to(param.device)[None, None]  # (1, 1, N, N)
    if impl in ("eager", "sdpa"):  # sdpa on CPU saves its own float copy of a bool mask per layer
        zero = torch.zeros((), dtype=param.dtype, device=param.device)
        return torch.where(mask, zero, torch.finfo(param.dtype).min)
    return mask


def preferred_attn_implementation(model: torch.nn.Module, device: torch.device | str) -> str:
    """Attention implementation for tree rows: FlexAttention on CUDA when the family supports
    it; otherwise the model's own (sdpa, or eager for families without sdpa such as Gemma2),
    with sdpa in place of flex on CPU (FlexAttention has no CPU backward)."""
    if torch.device(device).type == "cuda" and getattr(model, "_supports_flex_attn", False):
        return "flex_attention"
    impl = model.config._attn_implementation
    return "sdpa" if impl == "flex_attention" else impl


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


def check_tree_support(model: torch.nn.Module, max_row_tokens: int) -> None:
    """Refuse a model whose own forward cannot give prefix-tree logprobs (one-line ValueError).

    Rules, checked in order: (1) the forward takes `logits_to_keep`, so `forward_logprobs` gets
    the model's own logits with its family's transform (logit scaling, soft-capping);
    (2) every layer is an attention layer that takes a 4D mask (`config.layer_types` within
    TREE_LAYER_TYPES: no recurrent/SSM layers); (3) a sliding window, if used, is at least
    `max_row_tokens` (a tree path is at most a row long, so the window never cuts it);
    (4) a probe: two 16-token sequences sharing 8 tokens, merged into one row, give the
    logprobs of each run alone through the plain causal forward, within 1e-4 (fp32) or 0.1
    (16-bit weights). The probe runs without gradients in eval mode (no dropout).
    """
    config = model.config
    name = f"model type {getattr(config, 'model_type', type(model).__name__)!r}"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"{name} is not supported: its forward takes no logits_to_keep, so "
            "trainer logprobs cannot come from the model's own forward"
        )
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - TREE_LAYER_TYPES:
        raise ValueError(
            f"{name} is not supported: layer types {sorted(kinds - TREE_LAYER_TYPES)}"
            " cannot take a prefix-tree attention mask"
        )
    window = getattr(config, "sliding_window", None)
    if (
        window is not None
        and (not kinds or "sliding_attention" in kinds)
        and max_row_tokens > window
    ):
        raise ValueError(
            f"{name}: sliding window {window} < trainer.max_row_tokens "
            f"{max_row_tokens} (the tree mask ignores the window); set "
            f"trainer.max_row_tokens <= {window}"
        )
    diff = _probe_difference(model, name)
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 0.1
    if not diff <= tol:
        raise ValueError(
            f"{name} is not supported: its prefix-tree logprobs differ from its "
            f"own forward by {diff:.3g} (> {tol}): attention or positions ignore "
            "the tree mask"
        )


@torch.no_grad()
def supports_chunked_logprobs(model: torch.nn.Module) -> bool:
    """Whether chunked logprobs (`forward_logprobs` with chunk_tokens > 0, from the decoder's
    hidden states and `prefix_tree.head_logits`) equal the model's own forward's on the probe
    row of `check_tree_support`, within 1e-5 (fp32) or 0.1 (16-bit weights) relative to the
    largest |logprob| (float rounding grows with it: SmolLM2 differs by 1.05e-5 at 21 nats,
    which an absolute 1e-5 wrongly refused); False for a
    family whose forward transforms its logits in a way `head_logits` does not reproduce, or
    whose decoder cannot be called alone. Runs in eval mode without gradients."""
    try:
        with _eval_mode(model):
            (row,) = build_tree_batch(_probe_sequences(model), 32).rows
            plain = forward_logprobs(model, row)
            diff = (forward_logprobs(model, row, 5) - plain).abs().max()
    except Exception:  # any failure of the decoder-only path means "not supported"
        return False
    tol = 1e-5 if next(model.parameters()).dtype == torch.float32 else 0.1
    return bool(diff <= tol * max(1.0, plain.abs().max().item()))


def _probe_sequences(model: torch.nn.Module) -> list[list[int]]:
    """Two 16-token sequences sharing their first 8 tokens, within the model's vocabulary."""
    vocab = model.get_input_embeddings().num_embeddings
    shared = [(7 * i + 3) % vocab for i in range(8)]
    return [
        shared + [(11 * i + 5) % vocab for i in range(8)],
        shared + [(13 * i + 1) % vocab for i in range(8)],
    ]


@torch.no_grad()
def _probe_difference(model: torch.nn.Module, name: str) -> float:
    """Max |tree - alone| logprob over a 2-branch probe row (see `check_tree_support`)."""
    seqs = _probe_sequences(model)
    device = next(model.parameters()).device
    try:
        with _eval_mode(model):
            (row,) = build_tree_batch(seqs, 32).rows
            tree = forward_logprobs(model, row)  # (K,) sorted by (sample, token)
            alone = []
            for seq in seqs:
                ids = torch.tensor([seq], device=device)
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)  # (16, V)
                alone.append(logp[:-1].gather(1, ids[0, 1:, None])[:, 0])
            return (tree - torch.cat(alone)).abs().max().item()
    except Exception as exc:
        reason = repr(exc)[:200]
        raise ValueError(
            f"{name} is not supported: a prefix-tree forward fails ({reason})"
        ) from exc


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` in eval mode (no dropout) inside the block, then restore its mode."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)
