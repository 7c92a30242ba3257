"""LoRA adapters in the local engine: rows of different adapters decode in one batch.

Data flow: `LocalEngine.load_adapter(name, tensors, version, alpha)` puts an `AdapterLoad` into
the worker's inbox like a weight update; between two decode steps the worker adds it to the
engine's `forgerl.lora.MultiLoRA` (made at the first load, on the engine's copy of the model,
with the targets the tensors name) under the key `name@v<version>` and makes it the version new
requests of `name` get. A request (`stream(..., adapter=name)`) is stamped with that version when
it is first admitted and keeps it to its end: a later load under the same name does not touch a
row in flight, and a version no row and no name uses any more is dropped. Every forward runs
inside `MultiLoRA.active([each row's adapter version])`.

Prefix cache: a row's KV is kept and looked up in the namespace (adapter, version), so KV built
under another adapter or an older version is never reused (CASES.md C23); a new version drops
the old one's entries. Adapter rows skip the shared KV pool (it is keyed by base weights only).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from forgerl.engines.local.kv_batch import _Batch, _fail, _Request
from forgerl.engines.local.prefix_cache import PrefixCache
from forgerl.engines.worker import WeightUpdate
from forgerl.lora import PEFT_PREFIX, MultiLoRA


@dataclass(frozen=True)
class AdapterLoad:
    """An adapter version on its way to the worker (`tensors` None: remove the name)."""

    name: str
    tensors: Mapping[str, torch.Tensor] | None
    alpha: float = 1.0


def adapter_key(name: str, version: int) -> str:
    """The MultiLoRA name of adapter `name` at `version`."""
    return f"{name}@v{version}"


class EngineAdapters:
    """The adapter half of `ContinuousBatcher` (`LocalEngine` sets the attributes below)."""

    model: torch.nn.Module
    prefix_cache: PrefixCache
    stats: dict
    lora: MultiLoRA | None = None
    adapter_versions: dict[str, int]  # name → the version new requests get
    _batch: _Batch | None
    _waiting: deque[_Request]

    async def load_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], version: int,
                           alpha: float) -> None:
        """Load LoRA adapter `name` at `version` between decode steps; later requests with
        `adapter=name` decode under it, rows in flight keep the version they started with.

        tensors: peft's keys and shapes (`MultiLoRA.state_dict`: `…<module>.lora_A.weight`
        (rank, in), `…lora_B.weight` (out, rank), the `base_model.model.` prefix optional) for
        every targeted linear; every adapter of one engine targets the same linears. alpha:
        LoRA's alpha (scale alpha / rank). Tokens of an adapter row record `version` as their
        weight version (the base is frozen under LoRA). Raises ValueError (missing or unknown
        keys, shapes, other targets, a version the name already has loaded); the adapter's
        previous version then stays active."""
        await self._submit_update(AdapterLoad(name, dict(tensors), alpha), version)

    async def remove_adapter(self, name: str) -> None:
        """Forget adapter `name` (KeyError if unknown); rows in flight finish under it."""
        await self._submit_update(AdapterLoad(name, None), -1)

    def adapters_of(self, rows: list[_Request]) -> contextlib.AbstractContextManager:
        """`MultiLoRA.active` with each row's adapter version (a no-op for base-only rows)."""
        if self.lora is None or all(r.adapter is None for r in rows):
            return contextlib.nullcontext()
        return self.lora.active([None if r.adapter is None else
                                 adapter_key(r.adapter, r.adapter_version) for r in rows])

    def stamp(self, req: _Request) -> bool:
        """Give a newly admitted adapter row its adapter's current version; False (the request
        failed with a ValueError) when the adapter was removed since the request arrived."""
        if req.adapter is None or req.adapter_version is not None:
            return True
        if req.adapter not in self.adapter_versions:
            _fail([req], ValueError(f"LoRA adapter {req.adapter!r} was removed"))
            return False
        req.adapter_version = self.adapter_versions[req.adapter]
        return True

    def apply_adapter(self, update: WeightUpdate) -> None:
        """Load or remove an adapter (worker thread); on failure nothing changes."""
        load = update.weights
        try:
            if load.tensors is None:
                old = self.adapter_versions.pop(load.name)
                self.prefix_cache.drop((load.name, old))
            else:
                self._add_version(load, update.version)
        except Exception as exc:
            update.settle(exc, error=True)
            return
        self.collect()
        update.settle(None)

    def _add_version(self, load: AdapterLoad, version: int) -> None:
        modules = {k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for k in load.tensors}
        targets = {m.rsplit(".", 1)[-1] for m in modules}
        if self.lora is None:
            self.lora = MultiLoRA(self.model, sorted(targets))
        elif targets != set(self.lora.targets):
            raise ValueError(f"adapter {load.name!r} targets {sorted(targets)}, the engine's "
                             f"adapters {sorted(self.lora.targets)}")
        ranks = {v.shape[0] for k, v in load.tensors.items() if k.endswith("lora_A.weight")}
        if len(ranks) != 1:
            raise ValueError(f"adapter {load.name!r}: lora_A tensors give ranks {ranks}")
        key = adapter_key(load.name, version)
        self.lora.add(key, ranks.pop(), load.alpha)
        try:
            self.lora.load_state_dict(key, load.tensors)
        except Exception:
            self.lora.remove(key)
            raise
        old = self.adapter_versions.get(load.name)
        self.adapter_versions[load.name] = version
        self.stats["adapter_loads"] += 1
        if old is not None:
            self.prefix_cache.drop((load.name, old))

    def collect(self) -> None:
        """Drop adapter versions that neither a name nor a running or waiting row uses."""
        if self.lora is None or len(self.lora.names()) == len(self.adapter_versions):
            return
        live = {adapter_key(n, v) for n, v in self.adapter_versions.items()}
        rows = (self._batch.rows if self._batch else []) + list(self._waiting)
        live |= {adapter_key(r.adapter, r.adapter_version) for r in rows
                 if r.adapter_version is not None}
        for key in self.lora.names():
            if key not in live:
                self.lora.remove(key)
