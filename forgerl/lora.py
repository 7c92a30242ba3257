"""Many LoRA adapters on one frozen base causal LM (LoRA: Hu et al. 2021, arXiv:2106.09685).

`MultiLoRA(model)` hooks every nn.Linear whose module name ends with a target (attention
projections by default); each adapter `name` owns, per hooked linear, A (rank, in) and B
(out, rank). Under `active(...)` a hooked linear computes, for every batch row,

    y = base(x) + (alpha / rank) · (x @ Aᵀ) @ Bᵀ      (A, B, alpha, rank of that row's adapter)

with grouped matmuls: the rows of one adapter are gathered into one matmul and their deltas
added back at their rows (rows of the base alone, `None`, skip it). Outside `active` the model
is the base. The base's parameters are frozen (requires_grad False) and its module tree and
state_dict are unchanged (forward hooks, not module swaps), so weight sync of the base works as
before; the adapters' parameters live here, not in the model. Keys of `state_dict(name)` and
the files of `save` are peft's (`adapter_model.safetensors` + `adapter_config.json`), so
`peft.PeftModel.from_pretrained` loads what `save` writes and `load` reads what peft saves.

The active adapters are per thread: an engine thread and a trainer thread may share one model.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

PEFT_PREFIX = "base_model.model."
"""What peft puts before a module's name in a saved adapter's keys."""


@dataclass
class _Adapter:
    rank: int
    alpha: float
    A: dict[str, nn.Parameter] = field(default_factory=dict)  # module name → (rank, in)
    B: dict[str, nn.Parameter] = field(default_factory=dict)  # module name → (out, rank)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class MultiLoRA:
    """Many LoRA adapters on one frozen base causal LM; rows of one batch may use different
    adapters (grouped matmuls: the rows of each adapter in one matmul)."""

    def __init__(self, model: nn.Module,
                 targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> None:
        """Hook each nn.Linear of `model` whose name ends with one of `targets` (in place) and
        freeze every base parameter. Raises ValueError when no linear matches."""
        self.model, self.targets = model, tuple(targets)
        self.linears: dict[str, nn.Linear] = {
            name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and any(name.split(".")[-1] == t for t in self.targets)}
        if not self.linears:
            raise ValueError(f"MultiLoRA: no nn.Linear of the model is named one of {targets}")
        for p in model.parameters():
            p.requires_grad_(False)
        self._adapters: dict[str, _Adapter] = {}
        self._local = threading.local()
        self._hooks = [m.register_forward_hook(self._hook(name))
                       for name, m in self.linears.items()]

    # adapters -------------------------------------------------------------------------------

    def add(self, name: str, rank: int, alpha: float, seed: int = 0) -> None:
        """A new adapter: A kaiming-uniform (a = √5, peft's init) from `seed`, B = 0, so it
        starts as the base. Each A/B has its linear's dtype and device and requires grad.
        Raises ValueError for a taken name or rank < 1."""
        if name in self._adapters:
            raise ValueError(f"LoRA adapter {name!r} exists already")
        if rank < 1:
            raise ValueError(f"LoRA rank must be ≥ 1, got {rank}")
        gen = torch.Generator().manual_seed(seed)
        adapter = _Adapter(rank, float(alpha))
        for mod, lin in self.linears.items():
            a = torch.empty(rank, lin.in_features)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            w = lin.weight
            adapter.A[mod] = nn.Parameter(a.to(w.device, w.dtype))
            adapter.B[mod] = nn.Parameter(torch.zeros(lin.out_features, rank,
                                                      device=w.device, dtype=w.dtype))
        self._adapters[name] = adapter

    def remove(self, name: str) -> None:
        """Drop adapter `name` (KeyError naming it when absent)."""
        self._get(name)
        del self._adapters[name]

    def names(self) -> list[str]:
        """The adapters, in the order they were added."""
        return list(self._adapters)

    def parameters(self, name: str) -> list[nn.Parameter]:
        """Adapter `name`'s A and B of every hooked linear: what its optimizer owns."""
        adapter = self._get(name)
        return [p for mod in self.linears for p in (adapter.A[mod], adapter.B[mod])]

    def state_dict(self, name: str) -> dict[str, Tensor]:
        """Adapter `name` under peft's saved key names
        (`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`), detached."""
        adapter = self._get(name)
        out = {}
        for mod in self.linears:
            out[f"{PEFT_PREFIX}{mod}.lora_A.weight"] = adapter.A[mod].detach()
            out[f"{PEFT_PREFIX}{mod}.lora_B.weight"] = adapter.B[mod].detach()
        return out

    def load_state_dict(self, name: str, tensors: Mapping[str, Tensor]) -> None:
        """Copy `tensors` (keys as `state_dict` gives them, the `base_model.model.` prefix
        optional) into adapter `name`, in place. Raises ValueError, changing nothing, when a
        key is missing or unexpected or a shape differs."""
        adapter = self._get(name)
        given = {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()}
        want = {f"{mod}.lora_{ab}.weight": (adapter.A if ab == "A" else adapter.B)[mod]
                for mod in self.linears for ab in "AB"}
        if given.keys() != want.keys():
            missing, extra = sorted(want.keys() - given.keys()), sorted(given.keys() - want)
            raise ValueError(f"LoRA adapter {name!r}: missing keys {missing[:3]}, "
                             f"unexpected keys {extra[:3]}")
        for key, p in want.items():
            if given[key].shape != p.shape:
                raise ValueError(f"LoRA adapter {name!r}: {key} has shape "
                                 f"{tuple(given[key].shape)}, expected {tuple(p.shape)}")
        with torch.no_grad():
            for key, p in want.items():
                p.copy_(given[key])

    def save(self, name: str, path: str | Path, base_model: str | None = None) -> None:
        """Write adapter `name` to folder `path` in peft's format: adapter_model.safetensors and
        adapter_config.json (LoRA, CAUSAL_LM, r, lora_alpha, target_modules)."""
        adapter, path = self._get(name), Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous().cpu() for k, v in self.state_dict(name).items()}
        save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter.rank,
                  "lora_alpha": adapter.alpha, "target_modules": sorted(self.targets),
                  "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                  "base_model_name_or_path": base_model}
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))

    def load(self, name: str, path: str | Path, seed: int = 0) -> None:
        """Add adapter `name` from a peft adapter folder (rank and alpha from its config).
        Raises ValueError for a config that is not a plain LoRA of these targets."""
        path = Path(path)
        config = json.loads((path / "adapter_config.json").read_text())
        if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get(
                "use_rslora") or set(config.get("target_modules") or ()) != set(self.targets):
            raise ValueError(f"{path}: not a plain LoRA adapter of targets {self.targets}")
        self.add(name, int(config["r"]), float(config["lora_alpha"]), seed)
        try:
            self.load_state_dict(name, load_file(path / "adapter_model.safetensors"))
        except ValueError:
            self.remove(name)
            raise

    # forward --------------------------------------------------------------------------------

    @contextmanager
    def active(self, adapters: str | Sequence[str | None] | None) -> Iterator[None]:
        """Within the block (on this thread) the hooked linears add adapter `adapters` to every
        row, or `adapters[i]` to batch row i (None: the base alone). Raises KeyError for an
        unknown name; a forward whose batch size differs from len(adapters) raises ValueError."""
        plan: _Adapter | tuple[int, list[tuple[_Adapter, Tensor]]] | None
        if adapters is None or isinstance(adapters, str):
            plan = None if adapters is None else self._get(adapters)
        else:
            rows = list(adapters)
            groups: dict[str, list[int]] = {}
            for i, a in enumerate(rows):
                if a is not None:
                    groups.setdefault(a, []).append(i)
            plan = (len(rows), [(self._get(a), torch.tensor(ix)) for a, ix in groups.items()])
            if len(groups) == 1 and None not in rows:
                plan = self._get(rows[0])  # one adapter on every row: no gather
        previous = getattr(self._local, "plan", None)
        self._local.plan = plan
        try:
            yield
        finally:
            self._local.plan = previous

    def _hook(self, mod: str):
        def hook(_module: nn.Module, inputs: tuple[Tensor, ...], y: Tensor) -> Tensor | None:
            plan = getattr(self._local, "plan", None)
            if plan is None:
                return None
            x = inputs[0]
            if isinstance(plan, _Adapter):  # one adapter for the whole batch
                return y + (x @ plan.A[mod].t()) @ plan.B[mod].t() * plan.scale
            n, groups = plan
            if x.shape[0] != n:
                raise ValueError(f"MultiLoRA.active got {n} adapters for a batch of "
                                 f"{x.shape[0]} rows")
            for ad, ix in groups:
                ix = ix.to(x.device)
                delta = (x.index_select(0, ix) @ ad.A[mod].t()) @ ad.B[mod].t() * ad.scale
                y = y.index_add(0, ix, delta)
            return y
        return hook

    def _get(self, name: str) -> _Adapter:
        if name not in self._adapters:
            raise KeyError(f"no LoRA adapter {name!r} (have {sorted(self._adapters)})")
        return self._adapters[name]
