"""The model side of the Tinker API: LoRA training runs and samplers on one frozen base model.

Every training client (`create_model`) is a LoRA adapter of `forgerl.lora.MultiLoRA` on the one
base model, with its own AdamW. `forward_backward` scores each datum's `target_tokens` under that
adapter and adds the gradient of Tinker's named loss (computed by ForgeRL's own losses,
`tinker_loss`) to the adapter's `.grad`; gradients accumulate until `optim_step`. A checkpoint is
a peft adapter folder (adapter_config.json + adapter_model.safetensors, plus optimizer.pt for
`save_weights`) under `root/<model_id>/{weights,sampler_weights}/<name>`, addressed as
`tinker://<model_id>/<kind>/<name>`. A sampler samples from such a snapshot, loaded as an adapter
of its own (an LRU of SAMPLER_SLOTS), or from the base model alone.

Not thread-safe: the app runs every call on one worker thread, in submission order.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from forgerl.lora import MultiLoRA
from forgerl.trainer.losses import cispo_loss, ppo_clip_loss

SAMPLER_SLOTS = 4
"""Sampler snapshots kept loaded as adapters at once; older ones are reloaded from disk."""
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
"""Tinker loss names served (Tinker's "dro", "gspo", "stable_reinforce", "custom" are not)."""


class TinkerError(ValueError):
    """A bad request (unknown model id or path, missing loss input, bad shapes): the client's
    fault, answered as a user error with this one-line message."""


@dataclass
class Datum:
    """One Tinker datum: the model input's token ids (N,) and its loss inputs, each (N,)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class _Run:
    model_id: str
    rank: int
    optimizer: torch.optim.AdamW
    steps: int = 0


def tinker_loss(loss_fn: str, logprobs: Tensor, inputs: Mapping[str, np.ndarray],
                config: Mapping[str, float] | None = None) -> Tensor:
    """Tinker's named loss of one datum, a SUM over its N tokens (Tinker's convention, no mean).

    logprobs: (N,) float32 log p_θ(target_tokens[t] | tokens[:t+1]) with gradient; inputs as
    Tinker's loss_fn_inputs: cross_entropy uses `weights` (default 1): -Σ w·logp;
    importance_sampling: -Σ r·A with r = exp(logp - logprobs_q); ppo: -Σ min(r·A, clip(r)·A);
    cispo: -Σ sg(clip(r))·A·logp; the clip is to [clip_low_threshold, clip_high_threshold]
    from `config` (default 0.8, 1.2). Computed by forgerl.trainer.losses with N = 1 (ForgeRL's
    eps_low = 1 - low, eps_high = high - 1). Raises TinkerError for an unknown name or a
    missing or misshaped input."""
    def need(name: str) -> Tensor:
        if name not in inputs:
            raise TinkerError(f"loss_fn {loss_fn!r} needs loss_fn_inputs[{name!r}]")
        value = torch.tensor(np.asarray(inputs[name], dtype=np.float32)).reshape(-1)
        if value.shape != logprobs.shape:
            raise TinkerError(f"loss_fn_inputs[{name!r}] has {value.numel()} values for "
                              f"{logprobs.numel()} target tokens")
        return value
    cfg = dict(config or {})
    low, high = 1.0 - cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2) - 1
    if loss_fn == "cross_entropy":
        w = need("weights") if "weights" in inputs else torch.ones_like(logprobs.detach())
        return cispo_loss(logprobs, logprobs.detach(), w, 1)[0]  # ratio 1: -Σ w·logp
    if loss_fn not in LOSSES:
        raise TinkerError(f"loss_fn {loss_fn!r} is not served; one of {', '.join(LOSSES)}")
    q, adv = need("logprobs"), need("advantages")
    if loss_fn == "importance_sampling":
        return ppo_clip_loss(logprobs, q, adv, 1, eps_low=math.inf, eps_high=math.inf)[0]
    if loss_fn == "ppo":
        return ppo_clip_loss(logprobs, q, adv, 1, eps_low=low, eps_high=high)[0]
    return cispo_loss(logprobs, q, adv, 1, eps_low=low, eps_high=high)[0]


class TinkerService:
    """LoRA runs and samplers on `model` (frozen; wrapped in place by MultiLoRA)."""

    def __init__(self, model: nn.Module, served_name: str, root: Path, eos_ids: Sequence[int],
                 max_model_len: int, lora_alpha: float = 32.0,
                 targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj")) -> None:
        self.model = model.eval()
        self.lora = MultiLoRA(model, targets)
        self.served_name, self.root = served_name, Path(root)
        self.eos_ids, self.max_model_len = tuple(eos_ids), max_model_len
        self.alpha, self.targets = lora_alpha, list(targets)
        self.runs: dict[str, _Run] = {}
        self._loaded: OrderedDict[str, str] = OrderedDict()  # snapshot key → adapter name
        self._saves: dict[str, int] = {}  # path → times saved here (a re-save is a new snapshot)
        self._ids = itertools.count()

    # ---- training runs -----------------------------------------------------------------------
    def create(self, rank: int, seed: int | None = None, model_id: str | None = None) -> str:
        """A new LoRA run of `rank` named `model_id` (None: a fresh name); returns the id."""
        if not 1 <= rank <= 1024:
            raise TinkerError(f"lora rank must be in [1, 1024], got {rank}")
        model_id = model_id or f"run{next(self._ids)}"
        if model_id in self.runs or "/" in model_id:
            raise TinkerError(f"model_id {model_id!r} exists or has a '/'")
        self.lora.add(model_id, rank, self.alpha, seed=seed or 0)
        opt = torch.optim.AdamW(self.lora.parameters(model_id), lr=1e-4)
        self.runs[model_id] = _Run(model_id, rank, opt)
        return model_id

    def run(self, model_id: str) -> _Run:
        if model_id not in self.runs:
            raise TinkerError(f"unknown model_id {model_id!r}")
        return self.runs[model_id]

    def forward_backward(self, model_id: str, data: Sequence[Datum], loss_fn: str,
                         config: Mapping[str, float] | None = None, backward: bool = True
                         ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Per-datum target logprobs (N,) float32 and {"loss:sum": Σ over datums}; with
        `backward`, the loss's gradient is added to the run's adapter gradients."""
        self.run(model_id)
        if not data:
            raise TinkerError("forward_backward needs at least one datum")
        all_targets = []
        for datum in data:  # a bad datum fails the call before any gradient is added
            all_targets.append(targets := self._targets(datum))
            self.check_ids([*datum.tokens, *targets])
            tinker_loss(loss_fn, torch.zeros(len(targets)), datum.inputs, config)
        outputs, total = [], 0.0
        for datum, targets in zip(data, all_targets, strict=True):
            with torch.set_grad_enabled(backward):
                logprobs = self._logprobs(model_id, datum.tokens, targets)
                loss = tinker_loss(loss_fn, logprobs, datum.inputs, config)
                if backward:
                    loss.backward()
            outputs.append(logprobs.detach().numpy().astype(np.float32))
            total += float(loss.detach())
        return outputs, {"loss:sum": total}

    def _targets(self, datum: Datum) -> list[int]:
        if "target_tokens" not in datum.inputs:
            raise TinkerError("every datum needs loss_fn_inputs['target_tokens']")
        targets = [int(t) for t in np.asarray(datum.inputs["target_tokens"]).reshape(-1)]
        if len(targets) != len(datum.tokens) or not datum.tokens:
            raise TinkerError(f"target_tokens has {len(targets)} ids for a model input of "
                              f"{len(datum.tokens)} tokens (they must be equal and > 0)")
        if len(targets) > self.max_model_len:
            raise TinkerError(f"datum of {len(targets)} tokens > max_model_len "
                              f"{self.max_model_len}")
        return targets

    def _logprobs(self, adapter: str | None, tokens: list[int], targets: list[int]) -> Tensor:
        """log p(targets[t] | tokens[:t+1]) (N,) float32 under `adapter` (None: the base)."""
        self.check_ids([*tokens, *targets])
        with self.lora.active(adapter):
            logits = self.model(input_ids=torch.tensor([tokens])).logits[0].float()  # (N, V)
        picked = logits.gather(-1, torch.tensor(targets).unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)

    def check_ids(self, ids: Sequence[int]) -> None:
        vocab = self.model.get_input_embeddings().num_embeddings
        if any(not 0 <= t < vocab for t in ids):
            raise TinkerError(f"token id out of the vocabulary [0, {vocab})")

    def optim_step(self, model_id: str, lr: float, beta1: float = 0.9, beta2: float = 0.95,
                   eps: float = 1e-12, weight_decay: float = 0.0, grad_clip_norm: float = 0.0
                   ) -> dict[str, float]:
        """One AdamW step of the run's adapter on its accumulated gradients, which are then
        zeroed; returns {"optim/grad_norm": the norm before clipping (clip when > 0)}."""
        run = self.run(model_id)
        params = self.lora.parameters(model_id)
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip_norm or math.inf)
        for group in run.optimizer.param_groups:
            group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.steps += 1
        return {"optim/grad_norm": float(norm)}

    # ---- checkpoints -------------------------------------------------------------------------
    def save(self, model_id: str, name: str | None, kind: str) -> str:
        """Write the run's adapter (and, for kind "weights", its optimizer) as a peft folder;
        returns its tinker:// path. name None: an ephemeral sampler name."""
        run = self.run(model_id)
        name = name or f"step{run.steps}-{next(self._ids)}"
        if not name or "/" in name or name.startswith("."):
            raise TinkerError(f"checkpoint name {name!r} must be non-empty, without '/'")
        folder = self.root / model_id / kind / name
        folder.mkdir(parents=True, exist_ok=True)
        save_file(self.lora.state_dict(model_id), str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": run.rank,
            "lora_alpha": self.alpha, "target_modules": self.targets, "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": self.served_name,
        }, indent=1))
        if kind == "weights":
            torch.save(run.optimizer.state_dict(), folder / "optimizer.pt")
        path = f"tinker://{model_id}/{kind}/{name}"
        self._saves[path] = self._saves.get(path, 0) + 1
        return path

    def snapshot(self, path: str) -> str:
        """A key of the weights now at `path`: it changes when `path` is saved again, so a
        sampler cache keyed by it never serves an overwritten snapshot's old weights."""
        return f"{path}#{self._saves.get(path, 0)}"

    def folder(self, path: str) -> Path:
        """The checkpoint folder of a tinker:// path; TinkerError when it is not one of ours."""
        parts = path.removeprefix("tinker://").split("/")
        folder = self.root.joinpath(*parts) if len(parts) == 3 else None
        if (not path.startswith("tinker://") or folder is None or ".." in parts
                or not (folder / "adapter_model.safetensors").is_file()):
            raise TinkerError(f"no checkpoint at {path!r}")
        return folder

    def load(self, path: str, optimizer: bool, model_id: str | None = None,
             new_id: str | None = None) -> str:
        """Load a checkpoint into run `model_id` (None: a new run `new_id` of the checkpoint's
        rank), with its optimizer state when `optimizer`; returns the model id."""
        folder = self.folder(path)
        rank = json.loads((folder / "adapter_config.json").read_text())["r"]
        if optimizer and not (folder / "optimizer.pt").is_file():  # before touching the run
            raise TinkerError(f"{path!r} has no optimizer state (a sampler checkpoint)")
        model_id = model_id or self.create(rank, model_id=new_id)
        if self.run(model_id).rank != rank:
            raise TinkerError(f"checkpoint rank {rank} != run rank {self.run(model_id).rank}")
        self.lora.load_state_dict(model_id, load_file(str(folder / "adapter_model.safetensors")))
        if optimizer:
            self.runs[model_id].optimizer.load_state_dict(torch.load(folder / "optimizer.pt"))
        return model_id

    def _sampler(self, path: str | None) -> str | None:
        """The adapter holding the sampler snapshot at `path` (None: the base model)."""
        if path is None:
            return None
        key = self.snapshot(path)
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        folder = self.folder(path)
        rank = json.loads((folder / "adapter_config.json").read_text())["r"]
        if len(self._loaded) >= SAMPLER_SLOTS:
            self.lora.remove(self._loaded.popitem(last=False)[1])
        name = f"sampler{next(self._ids)}"
        self.lora.add(name, rank, self.alpha)
        self.lora.load_state_dict(name, load_file(str(folder / "adapter_model.safetensors")))
        self._loaded[key] = name
        return name
