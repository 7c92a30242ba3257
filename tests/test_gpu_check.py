"""scripts/gpu_check.py, the prepared device check, runs its checks on the CPU with the tiny
model and writes their numbers: so a lent GPU's minutes are never spent on a broken script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_on_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--tiny", "--out",
         str(tmp_path), "--requests", "8", "--tokens", "16"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["env"]["device"] == "cpu" and r["env"]["model"] == "tiny"
    fp32, bf16 = r["agreement_fp32"], r["agreement_bf16"]
    assert fp32["ok"] and fp32["max_abs_diff"] < 1e-4 and fp32["tokens"] == 16 * 24
    assert bf16["ok"] and 0 < bf16["mean_abs_diff"] < 0.02
    assert r["train_step"]["ok"] and r["train_step"]["tree_tokens"] > 0
    assert r["weight_update"]["ok"]
    assert r["throughput"]["tokens"] == 8 * 16 and r["throughput"]["tokens_per_second"] > 0
    assert r["nccl"] == {**r["nccl"], "ok": True, "backend": "gloo"}
    assert set(r) >= {"vllm", "sglang"}
