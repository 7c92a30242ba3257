"""The policy's forward over a packed prefix-tree row, and the start-up checks that a model
family gives the same logprobs through it as through its own causal forward.

`forward_logprobs` turns a `prefix_tree.TreeRow` into the per-prediction logprobs the loss
needs, with the mask of `attention.tree_attention_mask`; `check_tree_support` refuses a family
whose forward cannot be trusted on tree rows (one-line ValueError), and
`checked_attn_implementation` picks the attention implementation the trainer uses.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from forgerl.trainer.attention import (
    TREE_LAYER_TYPES,
    TREE_SDPA,
    attn_implementation,
    preferred_attn_implementation,
    tree_attention_mask,
)
from forgerl.trainer.prefix_tree import TreeRow, build_tree_batch


def forward_logprobs(model: torch.nn.Module, row: TreeRow, chunk_tokens: int = 0) -> torch.Tensor:
    """`forward_logprobs_entropy`'s logprobs alone."""
    return forward_logprobs_entropy(model, row, chunk_tokens)[0]


def forward_logprobs_entropy(model: torch.nn.Module, row: TreeRow, chunk_tokens: int = 0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(policy logprobs, entropies) of a row's predictions; entropies: (K,) fp32, detached,
    prediction k's H = -Σ_v p_v log p_v (nats, >= 0) of the same distribution
    log_softmax(logits[pred_pos[k]] / temperature[k]) its logprob is taken from (the sampling
    distribution), computed from the logits of the forward below in chunks of at most
    ENTROPY_CHUNK (or chunk_tokens) rows, so no second full (U, V) tensor is made.

    Policy logprobs of a row's predictions: one forward over the row (differentiable).

    Returns (K,) fp32 on the model's device: prediction k's
    log_softmax(logits[pred_pos[k]] / temperature[k])[target_ids[k]], the distribution the
    engine sampled target k from (`engines.local.sampler.sampling_logprobs`). The logits are the
    model's own forward's (`logits_to_keep` = the distinct pred_pos), so any logit transform
    of the family (Cohere `logit_scale`, Granite `logits_scaling`, Gemma2 soft-capping) is
    applied exactly as when sampling; `check_tree_support` refuses models for which
    that does not hold. The decoder runs over all N row tokens with the ancestor mask and depth
    position ids; the lm_head runs only at the distinct pred_pos (full-row logits would be
    N x vocab) and log_softmax at the distinct (pred_pos, temperature) pairs.

    chunk_tokens > 0 takes the decoder's final hidden states instead and runs lm_head, the
    family's logit transform (`head_logits`), temperature, log_softmax and gather over chunks
    of that many distinct pairs, each under `torch.utils.checkpoint` (the backward recomputes
    the chunk's logits), so at most one chunk's (chunk_tokens, V) logits live at a time instead
    of (U, V) logits, log-probs and their gradients. Same values and gradients as
    chunk_tokens = 0 up to float rounding; `supports_chunked_logprobs` says whether a
    family's transform is reproduced (the trainer falls back to 0 when not).
    """
    device = next(model.parameters()).device
    if row.pred_pos.numel() == 0:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return empty, empty
    pos, temp = row.pred_pos.to(device), row.temperature.to(device)
    pairs, pair_of = torch.unique(
        torch.stack([pos.double(), temp.double()], 1), dim=0, return_inverse=True
    )  # (U, 2): distinct (pred_pos, T)
    if chunk_tokens > 0:
        return _chunked_logprobs(model, row, pairs, pair_of, chunk_tokens)
    positions, pos_of = torch.unique(pairs[:, 0].long(), return_inverse=True)  # (P,)
    logits = (
        model(
            input_ids=row.input_ids.to(device)[None],
            position_ids=row.position_ids.to(device)[None],
            attention_mask=tree_attention_mask(model, row),
            use_cache=False,
            logits_to_keep=positions,
        )
        .logits[0]
        .float()
    )  # (P, V)
    scaled = logits[pos_of] / pairs[:, 1:].float()  # (U, V); float32 T, as the engine divides
    logprobs = torch.log_softmax(scaled, dim=-1)
    entropy = torch.cat([entropy_of(logprobs[lo:lo + ENTROPY_CHUNK])
                         for lo in range(0, len(logprobs), ENTROPY_CHUNK)])  # (U,)
    return logprobs[pair_of, row.target_ids.to(device)], entropy[pair_of]


ENTROPY_CHUNK = 256
"""Rows of (pairs, vocab) log-probs turned into entropies at a time (one (256, V) temporary)."""


@torch.no_grad()
def entropy_of(logprobs: torch.Tensor) -> torch.Tensor:
    """(C,) entropies -Σ_v p_v log p_v of (C, V) log-probs, clamped at 0 (rounding); a -inf
    log-prob (p = 0) contributes 0, not 0 · -inf = NaN."""
    lp = logprobs.detach().float()
    plogp = lp.exp() * lp.clamp(min=torch.finfo(lp.dtype).min)  # (C, V), <= 0
    return (-plogp.sum(-1)).clamp(min=0.0)


def head_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """(C, V) logits, in the model's dtype, from (C, H) final hidden states: the output embedding
    plus the logit transforms transformers families apply after it (Cohere `logit_scale`,
    Granite `logits_scaling`, Gemma2/3 `final_logit_softcapping`). A family with another
    transform gives other logits than its own forward: `supports_chunked_logprobs`."""
    logits = model.get_output_embeddings()(hidden)
    config = model.config
    if getattr(model, "logit_scale", None) is not None:
        logits = logits * model.logit_scale
    if getattr(config, "logits_scaling", None) is not None:
        logits = logits / config.logits_scaling
    if (cap := getattr(config, "final_logit_softcapping", None)) is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _chunk_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, temp: torch.Tensor, local: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """((k,) logprobs of `targets` at rows `local`, (C,) entropies) of one chunk's (C, H)
    hidden states."""
    scaled = head_logits(model, hidden).float() / temp[:, None]  # (C, V)
    logprobs = torch.log_softmax(scaled, dim=-1)
    return logprobs[local, targets], entropy_of(logprobs)


def _chunked_logprobs(
    model: torch.nn.Module, row: TreeRow, pairs: torch.Tensor, pair_of: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward_logprobs` over chunks of `chunk` distinct (pred_pos, T) pairs (`pairs` (U, 2)
    float64 sorted, `pair_of` (K,) the pair of each prediction)."""
    device = pairs.device
    hidden = model.get_decoder()(
        input_ids=row.input_ids.to(device)[None],
        position_ids=row.position_ids.to(device)[None],
        attention_mask=tree_attention_mask(model, row),
        use_cache=False,
    ).last_hidden_state[0]  # (N, H)
    at, temp = hidden[pairs[:, 0].long()], pairs[:, 1].float()  # (U, H), (U,)
    order = torch.argsort(pair_of, stable=True)  # predictions grouped by pair: (K,)
    targets, grouped = row.target_ids.to(device)[order], pair_of[order]
    ends = torch.cumsum(torch.bincount(pair_of, minlength=len(pairs)), 0).tolist()
    parts, entropies = [], []
    for lo in range(0, len(pairs), chunk):
        hi = min(lo + chunk, len(pairs))
        a, b = ends[lo - 1] if lo else 0, ends[hi - 1]
        logprobs, entropy = checkpoint(_chunk_logprobs, model, at[lo:hi], temp[lo:hi],
                                       grouped[a:b] - lo, targets[a:b], use_reentrant=False)
        parts.append(logprobs)
        entropies.append(entropy)
    # back to prediction order: (K,), (K,)
    return torch.cat(parts)[torch.argsort(order)], torch.cat(entropies)[pair_of]


def checked_attn_implementation(model: torch.nn.Module, device: torch.device | str,
                                max_row_tokens: int) -> str:
    """`preferred_attn_implementation` once `check_tree_support` passes under it; a family
    whose layers do not hand `TREE_SDPA` its blocks intact falls back to dense sdpa. Raises
    `check_tree_support`'s ValueError when the model cannot be trained on tree rows at all."""
    impl = preferred_attn_implementation(model, device)
    if impl == TREE_SDPA:
        try:
            with attn_implementation(model, impl):
                check_tree_support(model, max_row_tokens)
            return impl
        except ValueError:
            impl = "sdpa"
    with attn_implementation(model, impl):
        check_tree_support(model, max_row_tokens)
    return impl


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
    hidden states and `head_logits`) equal the model's own forward's on the probe
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
