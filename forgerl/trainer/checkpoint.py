"""Training checkpoints: model weights, optimizer state, step and caller state, saved atomically.

Layout: `RUN_DIR/checkpoints/step_00000012/` holds the model (`save_pretrained`, safetensors),
`optimizer.pt` (torch optimizer state_dict) and `trainer_state.json` ({"step", "extra"}; extra
carries e.g. the scheduler cursor so buffered rollouts are not lost on resume, CASES.md C12)
and, with a speculative-decoding drafter, `drafter.pt` (its weights and AdamW state). A LoRA
run ([model] lora) saves its adapter in peft's format (adapter_config.json,
adapter_model.safetensors) instead of the model, and `optimizer.pt` is the adapter's AdamW.
A checkpoint is written into a temporary folder and renamed into place, so a crash mid-save
never leaves a partial checkpoint; only then are older checkpoints removed (the last complete
one always survives).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where used: `checkpoint_step` alone stays light
    import torch
    from transformers import PreTrainedModel

    from forgerl.trainer.lora import PolicyAdapter

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
DRAFTER_FILE = "drafter.pt"
ADAPTER_FILE = "adapter_config.json"
_PREFIX = "step_"


def save_checkpoint(
    run_dir: str | Path,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    step: int,
    extra: dict[str, Any],
    keep: int = 1,
    states: tuple[dict, dict] | None = None,
    drafter: dict | None = None,
    adapter: PolicyAdapter | None = None,
) -> Path:
    """Write checkpoint `step` under `run_dir/checkpoints/` and return its folder.

    `model` must offer `save_pretrained` (HF). `extra` must be JSON-serialisable (TypeError
    otherwise, raised before anything is written). Once the new one is in place, all but the
    `keep` newest checkpoints (by step) are deleted; rewriting an existing step replaces it.
    `states`: (model, optimizer) state dicts to write instead of `model`'s and `optimizer`'s
    own (`Trainer.checkpoint_state`: gathered in full from a sharded trainer). `drafter`: the
    draft head's state (`Trainer.drafter_state`), saved as DRAFTER_FILE (`load_drafter`).
    `adapter`: a LoRA run's adapter (`Trainer.lora`), saved instead of the model's weights.
    Size: the model's weights plus about twice that for AdamW's moments (SmolLM2-135M fp32:
    0.54 GB + 1.08 GB).
    """
    import torch  # lazy: torch only here, so `checkpoint_step` alone stays light

    if keep < 1:
        raise ValueError(f"keep ({keep}) must be >= 1")
    state = json.dumps({"step": step, "extra": extra})
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{_PREFIX}{step:08d}"
    tmp = root / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    model_state, optimizer_state = states or (None, optimizer.state_dict())
    if adapter is not None:
        adapter.save(tmp)
    else:
        model.save_pretrained(tmp, state_dict=model_state)
    torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
    if drafter is not None:
        torch.save(drafter, tmp / DRAFTER_FILE)
    (tmp / STATE_FILE).write_text(state)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    done = sorted(root.glob(f"{_PREFIX}*"), key=lambda p: int(p.name[len(_PREFIX):]))
    for old in [p for p in done if p != final][: max(0, len(done) - keep)]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder under `run_dir/checkpoints/`, or None."""
    root = Path(run_dir) / "checkpoints"
    done = [p for p in root.glob(f"{_PREFIX}*") if (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name[len(_PREFIX) :]), default=None)


def checkpoint_step(run_dir: str | Path) -> int:
    """The step of the newest complete checkpoint under `run_dir` (0 if none), read from its
    trainer_state.json without loading weights."""
    ckpt = latest_checkpoint(run_dir)
    return 0 if ckpt is None else int(json.loads((ckpt / STATE_FILE).read_text())["step"])


def load_checkpoint(
    ckpt_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    adapter: PolicyAdapter | None = None,
) -> tuple[int, dict[str, Any]]:
    """Load weights and optimizer state in place from `ckpt_dir`; return (step, extra).

    Weights come from every `*.safetensors` file in the folder (sharded or not); keys missing
    from the files must be tied weights (e.g. an lm_head tied to the embeddings), else
    ValueError. With `adapter` (a LoRA run) the folder's peft adapter is loaded into it
    instead (`PolicyAdapter.load`; ValueError for another rank, alpha or targets). Raises
    FileNotFoundError when the folder is not a checkpoint.
    """
    import torch  # lazy: torch only here, so `checkpoint_step` alone stays light

    ckpt_dir = Path(ckpt_dir)
    state = json.loads((ckpt_dir / STATE_FILE).read_text())
    if adapter is not None:
        adapter.load(ckpt_dir)
    else:
        _load_weights(ckpt_dir, model)
    opt_state = torch.load(ckpt_dir / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(opt_state)
    return int(state["step"]), dict(state["extra"])


def _load_weights(ckpt_dir: Path, model: torch.nn.Module) -> None:
    """The model's weights from checkpoint `ckpt_dir`, in place (see `load_checkpoint`)."""
    import safetensors.torch  # lazy: as in load_checkpoint

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt_dir.glob("*.safetensors")):
        weights.update(safetensors.torch.load_file(f))
    if any(k not in model.state_dict() for k in weights):  # saved in the family's on-disk
        # layout (transformers converts e.g. fused MoE experts on save): load it back through it
        weights = type(model).from_pretrained(ckpt_dir, dtype=next(model.parameters()).dtype
                                              ).state_dict()
    result = model.load_state_dict(weights, strict=False)
    # A key absent from the files is fine only if it shares storage with a loaded one (tied).
    current = model.state_dict()
    loaded = {current[k].data_ptr() for k in weights if k in current}
    untied_missing = {k for k in result.missing_keys if current[k].data_ptr() not in loaded}
    if result.unexpected_keys or untied_missing:
        raise ValueError(
            f"checkpoint {ckpt_dir} does not match the model: missing {sorted(untied_missing)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )


def load_drafter(ckpt_dir: str | Path) -> dict[str, Any] | None:
    """The drafter state saved in checkpoint `ckpt_dir` (`save_checkpoint`), or None when it
    holds none."""
    import torch  # lazy: as in save_checkpoint

    path = Path(ckpt_dir) / DRAFTER_FILE
    return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None
