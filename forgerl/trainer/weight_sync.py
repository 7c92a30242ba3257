"""Weight sync, trainer → one rollout engine: full or delta, versioned and checksummed.

Data flow: the controller calls `WeightSync.sync(trainer.state_dict_for_sync(), trainer.step)`
after each optimizer step. `WeightSync` owns the choice and the bookkeeping; engines stay simple;
the formats (`WeightDelta`, `pack`, `DeltaEngine`) live in `forgerl.weights`:

- full: `engine.update_weights({name: tensor in the engine's dtype}, version)`, every tensor.
- delta: the sync object keeps `base`, a copy (in the engine's dtype) of exactly the weights the
  engine holds at `base_version`. It casts the new weights to that dtype, compares the bits
  (so -0.0 vs 0.0 and NaNs count as changes) and sends a `WeightDelta` (`make_delta`). Tied
  tensors (one storage under two names) are sent once.

A delta that the engine refuses (`DeltaMismatch`: another version, or a base or result checksum
that does not match; the engine keeps its old weights and version) makes the sync fall back to
a full sync, as it does for the first sync, engines without `apply_delta`, and a base lost to a
failed sync. A failed full sync raises (the engine keeps its old weights and version,
`LocalEngine.update_weights`).

Cost: delta mode holds one more copy of the model in the engine's dtype on the trainer's device
and spends a compare, a gather and checksums per sync. It pays when the engine's dtype hides
most updates (see the README's weight-sync benchmark). In-process the bytes are a memory copy,
so `[trainer] weight_sync` defaults to "full".

Transports: in-process the payload is passed by reference; over Ray (forgerl/cluster.py) it goes
through the object store (one put, many gets) or, for full syncs with `[cluster]
weight_transport = "broadcast"`, as one `pack`ed buffer in a torch.distributed broadcast (NCCL
on GPUs, gloo on CPU) over a process group of its own (`weight_group`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from forgerl.weights import DeltaEngine, DeltaMismatch, checksum, make_delta, unique_tensors

log = logging.getLogger("forgerl")


class WeightSync:
    """Pushes trainer weights to one engine, full or delta, and remembers what it holds.

    kind: "full" sends every tensor (cast to the engine's dtype when it declares one); "delta"
    sends a WeightDelta whenever the engine is a DeltaEngine with a weight_dtype (a Router: every
    instance one, of one dtype) and its base is known, else full.
    stats (of the last sync): kind ("full" | "delta"), bytes (payload, engine dtype), seconds
    (wall clock of the whole sync: cast, compare, transfer, apply), changed_fraction (elements
    whose engine-dtype bits changed; NaN after a full sync), fallbacks (deltas refused so far).
    """

    def __init__(self, engine: Any, kind: Literal["full", "delta"] = "full") -> None:
        self.engine, self.kind = engine, kind
        self.dtype: torch.dtype | None = getattr(engine, "weight_dtype", None)
        self.base: dict[str, Tensor] | None = None  # what the engine holds (delta mode)
        self.base_crcs: dict[str, int] = {}
        self.base_version = -1
        self.stats: dict[str, Any] = {"fallbacks": 0}

    async def sync(self, state_dict: Mapping[str, Tensor], version: int) -> dict[str, Any]:
        """Publish `state_dict` (name → tensor, any dtype/device) to the engine as `version`;
        returns `stats`. Raises what `engine.update_weights` raises (the engine then keeps its
        old weights and version, and the next sync is full)."""
        start = time.perf_counter()
        weights = unique_tensors(state_dict)
        delta_ok = (self.kind == "delta" and isinstance(self.engine, DeltaEngine)
                    and self.dtype is not None)
        if self.dtype is not None:
            weights = {k: v.detach().to(self.dtype, copy=delta_ok) for k, v in weights.items()}
        kind, nbytes, changed, crcs = "full", 0, math.nan, None
        if delta_ok and self.base is not None and self.base.keys() == weights.keys():
            delta, crcs = make_delta(self.base, self.base_crcs, weights, self.base_version)
            try:
                await self.engine.apply_delta(delta, version)
                kind, nbytes, changed = "delta", delta.nbytes, delta.changed / max(delta.numel, 1)
            except DeltaMismatch as exc:
                log.warning("weight sync: delta refused (%s); sending a full sync", exc)
                self.stats["fallbacks"] += 1
        if kind == "full":
            self.base = None  # a failing full sync leaves no base to trust
            await self.engine.update_weights(weights, version)
            nbytes = sum(v.numel() * v.element_size() for v in weights.values())
        if delta_ok:
            crcs = crcs or {k: checksum(v) for k, v in weights.items()}
            self.base, self.base_crcs, self.base_version = weights, crcs, version
        self.stats |= {"kind": kind, "bytes": nbytes, "seconds": time.perf_counter() - start,
                       "changed_fraction": changed}
        return dict(self.stats)
