"""R3 routing replay: the trainer's forward routes each token to the experts the engine chose.

"Stabilizing MoE RL by aligning training and inference routers" (R3, 2025): the rollout engine
records the experts its routers selected for every token (`GenerateOutput.routed_experts`), the
data pool stores them, and the trainer replays the *selection* in every MoE layer, so engine and
trainer run the same experts even where float rounding (bf16 engine, batching, another kernel)
or a small weight difference flips a near-tie. The gate weights are recomputed from the
trainer's own router logits over the replayed experts (softmax over all experts, gathered at the
selected ones, renormalised when the family does: Mixtral always, Qwen2-MoE/OLMoE with
`norm_topk_prob`), so the router still gets gradients.

Data flow: `samples` joins a trajectory's turns' routes into one `Routes` per sample (each token
from the earliest turn that fed it); `prefix_tree.build_tree_batch` gives every tree token the
route of the first sample (lowest index) through its node (`TreeRow.routes`, -1 where no sample
has one); `replay_routes` installs forward hooks on the routers around a row's forward and
backward (activation checkpointing recomputes layers in the backward).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from forgerl.models import router_modules
from forgerl.types import Routes


def routes_tensor(routes: Routes) -> torch.Tensor:
    """(tokens, layers, top_k) int64 expert ids of `routes`."""
    ids = torch.frombuffer(bytearray(routes.data), dtype=torch.uint8) if routes.data else (
        torch.zeros(0, dtype=torch.uint8))
    return ids.view(len(routes), routes.layers, routes.top_k).long()


@contextlib.contextmanager
def replay_routes(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[int]:
    """Inside the block, every forward of `model` over N tokens (batch · sequence, one tree
    row: N = len(routes)) uses expert ids `routes[:, layer]` in each MoE layer; a token whose
    ids are -1 keeps its own top-k selection. Yields the number of tokens replayed (0 when
    `routes` is None or the model is dense, and nothing is changed).

    routes: (N, layers, top_k) int64. Raises ValueError when layers or top_k differ from the
    model's routers (routes recorded with another model)."""
    routers = router_modules(model) if routes is not None else []
    if not routers:
        yield 0
        return
    assert routes is not None
    if routes.shape[1:] != (len(routers), routers[0].top_k):
        raise ValueError(f"recorded routes (tokens, layers, top_k) = {tuple(routes.shape)} do "
                         f"not fit the model's {len(routers)} MoE layers of top-"
                         f"{routers[0].top_k}")
    device = next(model.parameters()).device
    routes = routes.to(device)
    hooks = [r.register_forward_hook(functools.partial(_replay, layer=routes[:, i]))
             for i, r in enumerate(routers)]
    try:
        yield int((routes[:, 0, 0] >= 0).sum())
    finally:
        for hook in hooks:
            hook.remove()


def _replay(module: torch.nn.Module, args: object, output: tuple, layer: torch.Tensor) -> tuple:
    """A router's (logits, weights, ids) with ids forced to `layer` (N, top_k) where recorded,
    and weights recomputed from the logits over those ids (the family's normalisation)."""
    logits, weights, ids = output
    if len(logits) != len(layer):
        raise ValueError(f"a forward over {len(logits)} tokens with routes of {len(layer)}")
    forced = torch.where(layer >= 0, layer, ids)
    chosen = torch.softmax(logits.float(), dim=-1).gather(1, forced)  # (N, top_k)
    if getattr(module, "norm_topk_prob", True):
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return logits, chosen.to(weights.dtype), forced
