"""Many LoRA adapters on one frozen base causal LM (the seam of issue 50, part 2).

Stand-in written by the tinker branch against the agreed interface until the multilora
branch's grouped implementation lands (that one replaces this file): y = base(x) +
(alpha/rank) · (x @ Aᵀ) @ Bᵀ with each batch row's own adapter, peft's key names and init
(A kaiming-uniform, B = 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn


class _LoRALinear(nn.Module):
    """A frozen nn.Linear plus per-adapter low-rank updates; `adapters` is the active choice:
    None (base only), a name, or a list with one name (or None) per batch row."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.scale: dict[str, float] = {}
        self.adapters: str | list[str | None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        active = self.adapters
        if active is None:
            return y
        if isinstance(active, str):
            return y + self._delta(active, x)
        if len(active) != x.shape[0]:
            raise ValueError(f"{len(active)} adapters for a batch of {x.shape[0]} rows")
        for name in dict.fromkeys(a for a in active if a is not None):
            rows = torch.tensor([i for i, a in enumerate(active) if a == name], device=x.device)
            y = y.index_add(0, rows, self._delta(name, x.index_select(0, rows)))
        return y

    def _delta(self, name: str, x: Tensor) -> Tensor:
        return (x @ self.lora_A[name].T) @ self.lora_B[name].T * self.scale[name]


class MultiLoRA:
    """Many LoRA adapters on one frozen base causal LM; rows of one batch may use different
    adapters (the rows of each adapter in one matmul)."""

    def __init__(self, model: nn.Module,
                 targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> None:
        self.model = model
        for p in model.parameters():
            p.requires_grad_(False)
        self.layers: dict[str, _LoRALinear] = {}
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and child_name in targets:
                    wrapped = _LoRALinear(child)
                    setattr(module, child_name, wrapped)
                    self.layers[f"{name}.{child_name}" if name else child_name] = wrapped
        if not self.layers:
            raise ValueError(f"no nn.Linear named one of {list(targets)} in the model")

    def add(self, name: str, rank: int, alpha: float, seed: int = 0) -> None:
        """A new adapter: A kaiming-uniform (a = √5, peft's init), B = 0, scale alpha / rank."""
        if name in self.names():
            raise ValueError(f"adapter {name!r} exists")
        gen = torch.Generator().manual_seed(seed)
        for layer in self.layers.values():
            w = layer.base.weight
            a = torch.empty(rank, w.shape[1], dtype=w.dtype)
            bound = math.sqrt(6 / ((1 + 5) * w.shape[1]))  # kaiming_uniform_(a=√5)
            a.uniform_(-bound, bound, generator=gen)
            layer.lora_A[name] = nn.Parameter(a.to(w.device))
            layer.lora_B[name] = nn.Parameter(torch.zeros(w.shape[0], rank, dtype=w.dtype,
                                                          device=w.device))
            layer.scale[name] = alpha / rank

    def remove(self, name: str) -> None:
        for layer in self.layers.values():
            del layer.lora_A[name], layer.lora_B[name], layer.scale[name]

    def names(self) -> list[str]:
        first = next(iter(self.layers.values()))
        return list(first.lora_A.keys())

    def parameters(self, name: str) -> list[nn.Parameter]:
        return [p for layer in self.layers.values()
                for p in (layer.lora_A[name], layer.lora_B[name])]

    def state_dict(self, name: str) -> dict[str, Tensor]:
        """peft's keys: base_model.model.<module>.lora_A.weight / lora_B.weight."""
        out = {}
        for path, layer in self.layers.items():
            out[f"base_model.model.{path}.lora_A.weight"] = layer.lora_A[name].detach().clone()
            out[f"base_model.model.{path}.lora_B.weight"] = layer.lora_B[name].detach().clone()
        return out

    def load_state_dict(self, name: str, tensors: Mapping[str, Tensor]) -> None:
        with torch.no_grad():
            for path, layer in self.layers.items():
                layer.lora_A[name].copy_(tensors[f"base_model.model.{path}.lora_A.weight"])
                layer.lora_B[name].copy_(tensors[f"base_model.model.{path}.lora_B.weight"])

    @contextmanager
    def active(self, adapters: str | Sequence[str | None] | None) -> Iterator[None]:
        """One adapter for the whole batch, or one per batch row (None = the base alone)."""
        choice = adapters if adapters is None or isinstance(adapters, str) else list(adapters)
        for layer in self.layers.values():
            layer.adapters = choice
        try:
            yield
        finally:
            for layer in self.layers.values():
                layer.adapters = None
