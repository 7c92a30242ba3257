"""Run logging: metrics as JSONL and TensorBoard event files in the run directory, a rich
progress bar (steps, rollouts in flight, reward, seconds per step), and the per-step agent
statistics of the trained groups (`rollout_stats`: tool use, turns, prefix reuse)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from forgerl.types import NOT_TRAINED, Trajectory

if TYPE_CHECKING:
    from forgerl.gateway.renderers.tool_parsers import ParsedReply

_log = logging.getLogger(__name__)


def rollout_stats(trajectories: Sequence[Trajectory], decode: Callable[[list[int]], str],
                  parse: Callable[[str, set[str] | None], ParsedReply]) -> dict[str, float]:
    """How the agent used the model in these rollouts (one step's trained groups), from the
    recorded completions alone; aborted and aborted_infra trajectories are left out. `decode`:
    completion ids → text and `parse`: text → tool calls and parse errors (the gateway
    renderer's `decode` and `parser.parse`, so the configured tool format is counted).

    tool_call_rate: fraction of rollouts with >= 1 parsed tool call in any completion;
    parallel_call_rate: with a completion holding >= 2 parsed tool calls (parallel calls).
    tool_calls / tool_call_attempts: parsed calls / `<tool_call>` blocks written (parsed + kept
    as text: bad JSON, no name, unclosed or cut by max_tokens); tool_call_valid_rate: their
    ratio (NaN without attempts; logged as null). Any tool name counts as parsed (the request's
    declared names are not recorded). A call forced by `tool_choice` is missed: its opening
    was prefilled into the prompt, not sampled.
    turns_per_trajectory: mean model calls per rollout.
    prefix_hits / prefix_misses: later calls whose prompt extended the previous call's prompt +
    completion token for token (`Completion.extends_previous`) / that did not (a branch).
    Empty input gives zeros (and NaN for the valid rate).
    """
    trajectories = [t for t in trajectories if t.status not in NOT_TRAINED]
    calls = attempts = with_call = parallel = hits = misses = 0
    for traj in trajectories:
        parsed = [parse(decode(c.completion_ids), None) for c in traj.completions]
        n = sum(len(p.tool_calls) for p in parsed)
        calls, with_call = calls + n, with_call + (n > 0)
        parallel += any(len(p.tool_calls) >= 2 for p in parsed)
        attempts += n + sum(len(p.errors) for p in parsed)
        hits += sum(c.extends_previous for c in traj.completions)
        misses += sum(not c.extends_previous for c in traj.completions[1:])
    rollouts = max(len(trajectories), 1)
    return {"tool_call_rate": with_call / rollouts, "parallel_call_rate": parallel / rollouts,
            "tool_calls": float(calls),
            "tool_call_attempts": float(attempts),
            "tool_call_valid_rate": calls / attempts if attempts else math.nan,
            "turns_per_trajectory": sum(len(t.completions) for t in trajectories) / rollouts,
            "prefix_hits": float(hits), "prefix_misses": float(misses)}


class MetricsLogger:
    """Appends one JSON object per record to RUN_DIR/metrics.jsonl and mirrors scalars to
    TensorBoard (RUN_DIR/tb). Non-finite floats are written as null in JSON.

    Resume: `resume_step` is the optimizer step of the restored checkpoint. Records of later
    steps (logged before a crash, then lost with the weights) are removed from metrics.jsonl
    (rewritten atomically; a torn last line is dropped too) and TensorBoard is told to purge
    them (`purge_step`), so every step has exactly one record once the run is done.
    """

    def __init__(self, run_dir: Path, resume_step: int = 0) -> None:
        from tensorboardX import SummaryWriter  # lazy: only a run that logs needs it

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


class EntropyWatch:
    """The entropy collapse warning: `update` once per trained step with its `entropy_mean`.

    A step with loss tokens is collapsed when its entropy is below `floor`, or below
    reference / `drop_factor`, the reference being the mean entropy of the first `first`
    steps with loss tokens. Each collapsed step is counted (`entropy_collapse_steps`, the
    run's total so far, in every record); a one-line warning is logged at the first collapsed
    step and then at most once per `every` steps while it lasts.
    """

    def __init__(self, floor: float, drop_factor: float, every: int = 10, first: int = 5,
                 warn: Callable[[str], None] | None = None) -> None:
        self.floor, self.drop_factor, self.every, self.first = floor, drop_factor, every, first
        self.warn = warn or _log.warning
        self.early: list[float] = []
        self.collapsed_steps = 0
        self.last_warned: int | None = None

    def update(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """{"entropy_collapse_steps": total} after optimizer step `step` with `metrics`."""
        entropy = metrics.get("entropy_mean")
        if entropy is None or not metrics.get("num_loss_tokens"):
            return {"entropy_collapse_steps": float(self.collapsed_steps)}
        if len(self.early) < self.first:
            self.early.append(entropy)
        ref = sum(self.early) / len(self.early)
        low = entropy < self.floor
        if low or (len(self.early) == self.first and entropy < ref / self.drop_factor):
            self.collapsed_steps += 1
            if self.last_warned is None or step - self.last_warned >= self.every:
                self.last_warned = step
                why = f"below trainer.entropy_floor {self.floor}" if low else (
                    f"{ref / max(entropy, 1e-12):.0f}x below the first steps' {ref:.3g}")
                self.warn(f"step {step}: policy entropy {entropy:.3g} nats per loss token is "
                          f"{why}: the policy may be collapsing (lower lr, raise eps_high)")
        return {"entropy_collapse_steps": float(self.collapsed_steps)}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All records of RUN_DIR/metrics.jsonl in order. Raises FileNotFoundError."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    return _read_records(path)


def _read_records(path: Path) -> list[dict[str, Any]]:
    """The step records of a JSONL file ([] if missing): a torn (unparsable) line, or one that
    is no object with an integer "step" (an edited file), is skipped."""
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and type(record.get("step")) is int:
            records.append(record)
    return records


def agent_summary(metrics: dict[str, Any]) -> str:
    """The console's view of `rollout_stats` values, e.g. `tools 0.44 valid 0.88 turns 1.44
    prefix 7/0` (tool-call rate, valid-call rate or "-", model calls per rollout, prefix
    hits/misses), then ` entropy 0.77` (`entropy_mean`, nats) when the metrics have it and
    ` infra N` when rollouts_aborted_infra = N > 0; "-" for any value missing."""
    def show(key: str, spec: str) -> str:
        value = metrics.get(key)
        return "-" if value is None or not math.isfinite(value) else format(value, spec)

    return (f"tools {show('tool_call_rate', '.2f')} valid {show('tool_call_valid_rate', '.2f')} "
            f"turns {show('turns_per_trajectory', '.2f')} prefix {show('prefix_hits', '.0f')}/"
            f"{show('prefix_misses', '.0f')}"
            + (f" entropy {show('entropy_mean', '.2f')}" if "entropy_mean" in metrics else "")
            + (f" infra {infra:.0f}" if (infra := metrics.get("rollouts_aborted_infra")) else ""))


class ProgressBar:
    """A rich progress bar over optimizer steps with live rollout/reward fields; when stdout is
    not a terminal (a log file, `nohup`, CI) one plain line per step instead, e.g.
    `step 3/12  in flight 16  reward 0.500  acc -  tools 0.44 valid 0.88 turns 1.44 prefix 7/0
    31.2 s/step  0:01:34` (the agent fields: `agent_summary`)."""

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
            TextColumn("{task.fields[agent]}"),
            TextColumn("{task.fields[sps]} s/step"),
            TimeElapsedColumn(),
            console=self._console,
            disable=not enabled or self._lines,
        )
        self._task = self._progress.add_task(
            "train", total=total_steps, completed=done, in_flight=0, reward="-", acc="-", agent="",
            sps="-"
        )

    def __enter__(self) -> ProgressBar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, **fields: Any) -> None:
        """Set `completed` (steps done) and any of in_flight, reward, acc, agent (the
        `agent_summary` text), sps (seconds per step: the caller passes the mean)."""
        completed = fields.pop("completed", None)
        self._progress.update(self._task, completed=completed, **fields)
        if self._lines:
            f = self._progress.tasks[0].fields
            elapsed = int(time.time() - self._start)
            print(f"step {completed}/{self._total}  in flight {f['in_flight']}  reward "
                  f"{f['reward']}  acc {f['acc']}  {f['agent']}  {f['sps']} s/step  "
                  f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}", flush=True)
