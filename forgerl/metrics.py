"""Run logging: metrics as JSONL and TensorBoard event files in the run directory, and a rich
progress bar (steps, rollouts in flight, reward, seconds per step)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class MetricsLogger:
    """Appends one JSON object per record to RUN_DIR/metrics.jsonl and mirrors scalars to
    TensorBoard (RUN_DIR/tb). Non-finite floats are written as null in JSON.

    Resume: `resume_step` is the optimizer step of the restored checkpoint. Records of later
    steps (logged before a crash, then lost with the weights) are removed from metrics.jsonl
    (rewritten atomically; a torn last line is dropped too) and TensorBoard is told to purge
    them (`purge_step`), so every step has exactly one record once the run is done.
    """

    def __init__(self, run_dir: Path, resume_step: int = 0) -> None:
        from tensorboardX import SummaryWriter

        self.path = run_dir / "metrics.jsonl"
        self.records = [r for r in _read_records(self.path) if r.get("step", 0) <= resume_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        os.replace(tmp, self.path)
        self._file = self.path.open("a")
        self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=resume_step + 1)

    def logged(self, step: int) -> bool:
        """True if a record for `step` exists (e.g. the step-0 evaluation before a resume)."""
        return any(r["step"] == step for r in self.records)

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
        os.fsync(self._file.fileno())  # the checkpoint that follows must never be ahead of it
        self._tb.flush()
        self.records.append(record)

    def close(self) -> None:
        """Flush and close the JSONL file and the TensorBoard writer."""
        self._file.close()
        self._tb.close()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All records of RUN_DIR/metrics.jsonl in order. Raises FileNotFoundError."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    return _read_records(path)


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a JSONL file ([] if missing); a torn (unparsable) line is skipped."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class ProgressBar:
    """A rich progress bar over optimizer steps with live rollout/reward fields; when stdout is
    not a terminal (a log file, `nohup`, CI) one plain line per step instead, e.g.
    `step 3/12  in flight 16  reward 0.500  acc -  31.2 s/step  0:01:34`."""

    def __init__(self, total_steps: int, done: int, enabled: bool = True) -> None:
        self._console = Console()
        self._lines = enabled and not self._console.is_terminal
        self._total, self._start = total_steps, time.time()
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("in flight {task.fields[in_flight]}"),
            TextColumn("reward {task.fields[reward]}"),
            TextColumn("acc {task.fields[acc]}"),
            TextColumn("{task.fields[sps]} s/step"),
            TimeElapsedColumn(),
            console=self._console,
            disable=not enabled or self._lines,
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
        """Set `completed` (steps done) and any of in_flight, reward, acc, sps (seconds per
        step: the caller passes the mean)."""
        completed = fields.pop("completed", None)
        self._progress.update(self._task, completed=completed, **fields)
        if self._lines:
            f = self._progress.tasks[0].fields
            elapsed = int(time.time() - self._start)
            print(f"step {completed}/{self._total}  in flight {f['in_flight']}  reward "
                  f"{f['reward']}  acc {f['acc']}  {f['sps']} s/step  "
                  f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}", flush=True)
