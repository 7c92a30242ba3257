"""The local engine's kernels: oneDNN-packed linears (CPU fp32) and grouped-query decode SDPA.

Data flow: `LocalEngine` calls `pack_linears` on its copy of the model (and again after every
weight update) when `packed_weights` is on, and switches the copy's attention from transformers'
"sdpa" to `ENGINE_SDPA`, registered here with transformers' AttentionInterface at import.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def pack_linears(model: torch.nn.Module) -> bool:
    """Give each nn.Linear of a CPU float32 `model` a oneDNN-packed copy of its weight
    (`torch.ops.mkldnn._reorder_linear_weight`) and a forward that uses it; call it again after
    every change of the weights (the packed copies do not follow the parameters). Returns False,
    changing nothing, for other devices and dtypes or a torch without oneDNN. A linear's weight
    is (out, in) float32; its forward still maps (..., in) float32 to (..., out), x · Wᵀ + b.

    Why: MKL's sgemm is slow for the few rows of a decode step. Costs a second copy of the
    linear weights and one packing per weight change. Outputs equal nn.Linear's up to float
    rounding (another summation order)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not linears or not torch.backends.mkldnn.is_available() or any(
            m.weight.device.type != "cpu" or m.weight.dtype != torch.float32 for m in linears):
        return False
    packed = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 16) for m in linears]
    for m, w in zip(linears, packed, strict=True):  # all built before any is replaced
        m.forward = functools.partial(torch.ops.mkldnn._linear_pointwise, W=w,
                                      B=m.bias, attr="none", scalars=[], algorithm="")
    return True


ENGINE_SDPA = "forgerl_engine_sdpa"
"""transformers' sdpa with one-token queries folded onto their key/value heads (`engine_sdpa`)."""


def engine_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: torch.Tensor | None,
                scaling: float | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, except a decode step without a mask (no row of
    the batch padded): query (B, H, 1, D) is viewed as (B, H_kv, H / H_kv, D), the query heads
    of one key/value head as that head's queries, and attends over key and value
    (B, H_kv, L, D) as they are. Returns ((B, 1, H, D), None), the same attention up to float
    rounding. transformers folds only when a mask is given and otherwise sends `enable_gqa`,
    which CPU SDPA runs slower in bf16 at one query token. A lone row is never padded."""
    groups = getattr(module, "num_key_value_groups", 1)
    extras = ("softcap", "s_aux", "position_bias")  # transformers' sdpa handles (or refuses)
    if query.shape[2] != 1 or attention_mask is not None or groups == 1 or kwargs.get(
            "dropout") or any(kwargs.get(k) is not None for k in extras):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, **kwargs)
    b, h, _, d = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, h // groups, groups, d), key, value, scale=scaling)
    return out.reshape(b, 1, h, d), None


AttentionInterface.register(ENGINE_SDPA, engine_sdpa)
AttentionMaskInterface.register(ENGINE_SDPA, sdpa_mask)  # else transformers passes no mask at all
