"""The pieces of a run's durable state on their own: the metrics log reconciled with the restored
step, the checkpoints kept, the one-line summary, and the rollout seeds."""

from __future__ import annotations

import json

import pytest
import torch

from forgerl.controller import rollout_seed, summary
from forgerl.metrics import MetricsLogger, read_metrics
from forgerl.models import build_tiny_model
from forgerl.trainer.checkpoint import checkpoint_step, latest_checkpoint, save_checkpoint


def test_metrics_log_drops_records_after_the_restored_step(tmp_path):
    """A crash after steps 3 and 4 were logged, with the checkpoint at step 2: resuming drops
    records 3 and 4 and a torn last line, keeps 0..2, and appends after them."""
    lines = [json.dumps({"step": s, "reward_mean": s / 10}) for s in range(5)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "rew')
    logger = MetricsLogger(tmp_path, resume_step=2)
    assert [r["step"] for r in logger.records] == [0, 1, 2]
    assert logger.logged(0) and not logger.logged(3)
    logger.log(3, {"reward_mean": 0.9, "lr": float("nan")})
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[3]["reward_mean"] == 0.9 and records[3]["lr"] is None
    (tmp_path / "new").mkdir()
    fresh = MetricsLogger(tmp_path / "new", resume_step=0)
    assert fresh.records == [] and not fresh.logged(0)
    fresh.close()


def test_lines_that_are_no_step_record_are_skipped(tmp_path):
    """Hand-edited lines ([1, 2], null, an object without an integer step) are skipped by the
    logger and by `forgerl plot`, as a torn line is (they raised AttributeError / KeyError)."""
    from forgerl.plot import plot_run

    lines = [json.dumps({"step": 0, "eval_accuracy": 0.5}), "[1, 2]", "null",
             json.dumps({"reward_mean": 0.5}), json.dumps({"step": "1", "reward_mean": 0.1}),
             json.dumps({"step": 1, "reward_mean": 0.25})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    logger = MetricsLogger(tmp_path, resume_step=1)
    assert [r["step"] for r in logger.records] == [0, 1]
    logger.close()
    assert plot_run(tmp_path).stat().st_size > 0


@pytest.mark.parametrize("keep", [1, 2])
def test_the_newest_checkpoints_are_kept(tmp_path, keep):
    model = build_tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    assert checkpoint_step(tmp_path) == 0
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, model, optimizer, step, {}, keep=keep)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["step_00000006", "step_00000004"][:keep][::-1]
    assert latest_checkpoint(tmp_path).name == "step_00000006" and checkpoint_step(tmp_path) == 6
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, model, optimizer, 8, {}, keep=0)


def test_summary_line():
    records = [{"step": 0, "eval_accuracy": 0.40625}, {"step": 1, "reward_mean": 0.5},
               {"step": 2, "eval_accuracy": 0.71875}]
    line = summary(records, steps=2, seconds=566.4)
    assert line.startswith("forgerl: done: 2 steps; 9 min 26 s; held-out accuracy 0.406 → 0.719;")
    assert line.endswith(" GiB") and "peak RSS" in line
    assert "no held-out evaluation" in summary([{"step": 1}], steps=1, seconds=3.0)


def test_rollout_seeds_are_stable_and_distinct():
    seeds = {rollout_seed(0, task, g) for task in range(50) for g in range(8)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)
    assert rollout_seed(0, 3, 1) == rollout_seed(0, 3, 1) != rollout_seed(1, 3, 1)
