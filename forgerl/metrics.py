"""Run logging: metrics as JSONL and TensorBoard event files in the run directory, and a rich
progress bar (steps, rollouts in flight, reward, seconds per step)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class MetricsLogger:
    """Appends one JSON object per record to RUN_DIR/metrics.jsonl and mirrors scalars to
    TensorBoard (RUN_DIR/tb). Non-finite floats are written as null in JSON."""

    def __init__(self, run_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self._tb = SummaryWriter(str(run_dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one record for optimizer step `step`; numeric values also go to TensorBoard."""
        record = {"step": step, "time": time.time()}
        for key, value in metrics.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            record[key] = value
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._tb.add_scalar(key, value, step)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self._tb.flush()

    def close(self) -> None:
        """Flush and close the JSONL file and the TensorBoard writer."""
        self._file.close()
        self._tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All records of RUN_DIR/metrics.jsonl in order. Raises FileNotFoundError."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class ProgressBar:
    """A rich progress bar over optimizer steps with live rollout/reward fields."""

    def __init__(self, total_steps: int, done: int, enabled: bool = True) -> None:
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("in flight {task.fields[in_flight]}"),
            TextColumn("reward {task.fields[reward]}"),
            TextColumn("acc {task.fields[acc]}"),
            TextColumn("{task.fields[sps]} s/step"),
            TimeElapsedColumn(),
            disable=not enabled,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=done, in_flight=0, reward="-", acc="-", sps="-"
        )

    def __enter__(self) -> ProgressBar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, **fields: Any) -> None:
        """Set `completed` (steps done) and any of in_flight, reward, acc, sps."""
        completed = fields.pop("completed", None)
        self._progress.update(self._task, completed=completed, **fields)
