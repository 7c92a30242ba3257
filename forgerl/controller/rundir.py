"""The run directory: its lock, the resume from its newest checkpoint, and its resolved config.

RUN_DIR holds the metrics log, config.json, the data pool and checkpoints/. The checkpoint (or,
before the first one, a fresh start) is the run's state: `start_services` reconciles the pool
and the metrics log with the step it returns. Groups consumed after it are trained again,
rollouts of weights newer than it are run again, records of later steps are dropped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from forgerl.config import Config, ConfigError
from forgerl.datapool.base import redacted
from forgerl.trainer.checkpoint import ADAPTER_FILE, latest_checkpoint, load_checkpoint

log = logging.getLogger("forgerl")


def open_run_dir(config: Config) -> tuple[Path, int]:
    """(RUN_DIR, its lock's descriptor): the folder created if needed, then locked
    (`lock_run_dir`). Raises ConfigError when it is a file or cannot be created."""
    run_dir = Path(config.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir {run_dir}: exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run_dir {run_dir}: cannot be created ({e.strerror or e})") from e
    return run_dir, lock_run_dir(run_dir)


def lock_run_dir(run_dir: Path) -> int:
    """Take RUN_DIR/.lock (an exclusive `flock`, released when the process ends however it
    ends, SIGKILL included); returns its file descriptor. Raises ConfigError naming the
    holder's pid when another process has the run (a second `forgerl train`, or a `forgerl
    gateway`, on it would reconcile its pool and metrics under it)."""
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(f"run_dir {run_dir}: in use by another forgerl process (pid "
                          f"{holder}); stop it or pass another --run_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def resume(run_dir: Path, trainer: Any, model_path: str) -> dict | None:
    """Load RUN_DIR's newest checkpoint into `trainer` (weights, AdamW state, step); returns
    the scheduler state saved with it, None for a fresh run. Raises ConfigError naming
    `model.path` when the checkpoint is of another model."""
    if (ckpt := latest_checkpoint(run_dir)) is None:
        return None
    if (ckpt / ADAPTER_FILE).is_file() != (trainer.lora is not None):
        saved = "a LoRA adapter" if trainer.lora is None else "all weights (no LoRA)"
        raise ConfigError(f"model.lora: the checkpoint {ckpt} holds {saved}; resume with the "
                          "run's [model] lora or pass another --run_dir")
    try:
        trainer.step, extra = load_checkpoint(ckpt, trainer.model, trainer.optimizer,
                                              trainer.lora)
    except ValueError as e:  # a LoRA adapter of another rank, alpha or targets
        if trainer.lora is None:
            raise
        raise ConfigError(f"model.lora: {e}; resume with the run's [model] lora") from e
    except RuntimeError as e:  # torch's multi-line "Error(s) in loading state_dict ..."
        if "state_dict" not in str(e):
            raise
        first = next((x.strip() for x in str(e).splitlines()[1:] if x.strip()), "")
        raise ConfigError(f"model.path: the checkpoint {ckpt} is not of {model_path!r} "
                          f"({first}); resume with the run's model or pass another "
                          "--run_dir") from e
    log.info("resumed from %s at step %d", ckpt, trainer.step)
    return extra.get("scheduler")


def claim_pool(run_dir: Path, pool: Any) -> None:
    """One database per run: RUN_DIR/run_id (a random id, written once; it moves with the
    folder) is claimed in the pool's meta. Another run's id there is a ConfigError naming
    `datapool.url`: this run would retrain that run's groups and overwrite its trained marks."""
    path = run_dir / "run_id"
    with contextlib.suppress(FileExistsError), path.open("x") as f:
        f.write(secrets.token_hex(16))
    mine = path.read_text().strip()
    if (owner := pool.claim("run_id", mine)) != mine:
        raise ConfigError(f"datapool.url: the database holds the pool of another run (run_id "
                          f"{owner}, this run's is {mine} in {path}); give each run its own "
                          "database")


def admin_key(run_dir: Path) -> str:
    """The sessions API's key when `[gateway] admin_key` is unset (CASES.md C26: that API never
    answers without one): RUN_DIR/admin_key, written once (mode 0600, 32 random characters) and
    kept by a resumed run."""
    path = run_dir / "admin_key"
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_urlsafe(24).encode())
        finally:
            os.close(fd)
    return path.read_text().strip()


def save_config(run_dir: Path, config: Config) -> None:
    """Write RUN_DIR/config.json (the run's settings once started), first logging the settings
    that differ from the ones saved there (`config_changes`)."""
    saved, now = run_dir / "config.json", config.model_dump()
    now["datapool"]["url"] = redacted(now["datapool"]["url"])  # no password on disk or in logs
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a new run, or a torn file
        if changes := config_changes(json.loads(saved.read_text()), now):
            log.warning("resuming %s with changed settings: %s", run_dir, "; ".join(changes))
    saved.write_text(json.dumps(now, indent=2))


def config_changes(old: dict[str, Any], new: dict[str, Any], where: str = "") -> list[str]:
    """The settings that differ between two `Config.model_dump()`s, as "section.key: old ->
    new" (a resume logs them: nothing else says that the run goes on with another dataset)."""
    out = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{where}{key}.")
        elif a != b:
            out.append(f"{where}{key}: {a!r} -> {b!r}")
    return out
