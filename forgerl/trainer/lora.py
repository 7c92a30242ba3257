"""LoRA training of the policy ([model] lora): one adapter on the frozen base, synced merged.

    load_policy ─► PolicyAdapter.wrap (MultiLoRA, one adapter "policy", base frozen)
    Trainer.attach_lora ─► AdamW over the adapter's A and B only; forwards under `active()`
    weight sync ─► `merged()`: W + (alpha / rank) · B @ A of each hooked Linear, nothing else
    checkpoint ─► the adapter in peft's format (`save`/`load`) beside optimizer.pt

The engine keeps a plain copy of the base and takes the merged weights of the hooked Linears
(`LocalEngine.update_weights` accepts a subset of the model's tensors), so it decodes at the
base model's speed; its version stamp clears the prefix cache at each sync as for full weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from forgerl.config import ConfigError, LoraConfig
from forgerl.lora import PEFT_PREFIX, MultiLoRA

ADAPTER = "policy"
"""The adapter's name in the MultiLoRA."""


def check_targets(model: nn.Module, targets: Sequence[str], field: str = "model.lora.targets",
                  head: bool = False) -> None:
    """Raise ConfigError naming `field` when `targets` is empty or a target names no nn.Linear
    of `model` (a module name's last part), or (unless `head`) names its output head (whose
    weight the chunked logprobs read directly and which may be tied to the input embeddings)."""
    linears = {name.split(".")[-1]: m for name, m in model.named_modules()
               if isinstance(m, nn.Linear)}
    for target in targets or [""]:  # none: as a target naming nothing
        if target not in linears:
            raise ConfigError(f"{field}: {target!r} names no Linear layer of this "
                              f"model (its Linear layers: {', '.join(sorted(linears))})")
        if linears[target] is model.get_output_embeddings() and not head:
            raise ConfigError(f"{field}: {target!r} is the output head, which LoRA "
                              "training does not adapt")


class PolicyAdapter:
    """The one LoRA adapter a `forgerl train` run trains on `lora.model` (its base frozen).

    config: its rank, alpha and targets. base: the [model] path, written into the saved
    adapter_config.json."""

    def __init__(self, lora: MultiLoRA, config: LoraConfig, base: str | None = None) -> None:
        self.lora, self.config, self.base = lora, config, base

    @classmethod
    def wrap(cls, model: nn.Module, config: LoraConfig, seed: int = 0,
             base: str | None = None) -> PolicyAdapter:
        """Hook `model`'s target Linears (in place, base frozen) and add the adapter on their
        device (A from `seed`, B = 0: the policy starts as the base). Raises as `check_targets`."""
        check_targets(model, config.targets)
        lora = MultiLoRA(model, config.targets)
        lora.add(ADAPTER, config.rank, config.alpha, seed)
        return cls(lora, config, base)

    def parameters(self) -> list[nn.Parameter]:
        """The adapter's A and B of every hooked Linear (what the optimizer owns)."""
        return self.lora.parameters(ADAPTER)

    def active(self) -> AbstractContextManager[None]:
        """Within it, forwards of the model on this thread run with the adapter."""
        return self.lora.active(ADAPTER)

    @torch.no_grad()
    def merged(self) -> dict[str, Tensor]:
        """{"<linear>.weight": W + (alpha / rank) · B @ A} for every hooked Linear, in the
        weight's dtype and device: the policy's weights that differ from the base's."""
        ab = self.lora.state_dict(ADAPTER)
        scale = self.config.alpha / self.config.rank
        return {f"{name}.weight": torch.addmm(lin.weight, ab[f"{PEFT_PREFIX}{name}.lora_B.weight"],
                                              ab[f"{PEFT_PREFIX}{name}.lora_A.weight"],
                                              alpha=scale)
                for name, lin in self.lora.linears.items()}

    def save(self, folder: str | Path) -> None:
        """Write the adapter to `folder` in peft's format (adapter_config.json,
        adapter_model.safetensors): `peft.PeftModel.from_pretrained(base, folder)` loads it."""
        self.lora.save(ADAPTER, folder, self.base)

    def load(self, folder: str | Path) -> None:
        """Copy the adapter saved in `folder` (`save`) into this one, in place (the optimizer
        keeps its parameters). Raises ValueError for another rank, alpha or targets."""
        saved = json.loads((Path(folder) / "adapter_config.json").read_text())
        c = self.config
        got = (saved.get("r"), saved.get("lora_alpha"), sorted(saved.get("target_modules") or []))
        if got != (c.rank, c.alpha, sorted(c.targets)):
            raise ValueError(f"the adapter in {folder} has rank {got[0]}, alpha {got[1]}, "
                             f"targets {got[2]}; model.lora has rank {c.rank}, alpha {c.alpha}, "
                             f"targets {sorted(c.targets)}")
        self.lora.load_state_dict(ADAPTER, load_file(Path(folder) / "adapter_model.safetensors"))
