"""The local engine's routed-expert recorder for MoE models (R3 routing replay).

Data flow: `LocalEngine` makes a `RouteRecorder` over its copy of a MoE model (none for a dense
one); forward hooks on the routers (`models.router_modules`) keep each forward's expert ids;
after a prefill (`prefilled`) or a decode step (`decoded`) the batcher hands them to the rows
they belong to (`_Request.routes`, chunks of (tokens, layers, top_k) uint8). A prefix reused from
the prefix cache brings the routes stored beside its KV (`reused`), so a row's routes always
cover every token it fed, in order; `_Request.resolve` puts them on the GenerateOutput.
"""

from __future__ import annotations

import torch

from forgerl.engines.local.prefix_cache import PrefixCache
from forgerl.models import router_modules


class RouteRecorder:
    """Forward hooks on every router of `model` keeping the expert ids (N, top_k) of the current
    forward, layer by layer. Raises ValueError for a model with more than 256 experts (ids are
    stored as uint8) or none at all."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers = router_modules(model)
        experts = max((getattr(m, "num_experts", 0) for m in routers), default=0)
        if not routers or experts > 256:
            raise ValueError(f"routes are recorded for 1 to 256 experts, the model has {experts}")
        self.layers, self.top_k = len(routers), int(routers[0].top_k)
        self._ids: list[torch.Tensor] = []
        for router in routers:
            router.register_forward_hook(self._keep)

    def _keep(self, module: torch.nn.Module, args: object, output: tuple) -> None:
        self._ids.append(output[2])

    def start(self) -> None:
        """Forget ids of an earlier forward (one that raised)."""
        self._ids = []

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """The ids of the forward just run over (batch, seq) tokens: (batch, seq, layers,
        top_k) uint8 on the CPU."""
        ids = torch.stack(self._ids[-self.layers:], dim=1)  # (batch · seq, layers, top_k)
        self._ids = []
        return ids.to("cpu", torch.uint8).view(batch, seq, self.layers, self.top_k)

    @staticmethod
    def reused(rows: list, hits: list, cache: PrefixCache) -> None:
        """Start each row's routes with those of its reused cached prefix (n tokens; none on a
        miss): a prefill rebuilds the row's KV, so its older routes are replaced."""
        for req, (n, kv) in zip(rows, hits, strict=True):
            req.routes = [cache.routes_of(kv, n)] if n else []

    def prefilled(self, rows: list, new: list[int], shape: torch.Size) -> None:
        """Append the routes of each row's `new[i]` prefilled tokens (the last columns of its
        left-padded (B, S) input)."""
        ids = self.take(*shape)
        for i, (req, m) in enumerate(zip(rows, new, strict=True)):
            req.routes.append(ids[i, shape[1] - m:])

    def decoded(self, rows: list) -> None:
        """Append the route of the token each row fed in this decode step."""
        ids = self.take(len(rows), 1)
        for i, req in enumerate(rows):
            req.routes.append(ids[i])


def joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    """One (tokens, layers, top_k) tensor of a row's route chunks, kept as its only chunk."""
    if len(chunks) > 1:
        chunks[:] = [torch.cat(chunks)]
    return chunks[0]
