"""The `forgerl` command as a user runs it: one-line errors with exit code 2 for bad input, and
Ctrl-C (SIGINT) during a run stops it cleanly with no orphan agent processes; the run directory
keeps what was recorded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

FORGERL = [sys.executable, "-m", "forgerl"]


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    """True once `pid` no longer runs (a zombie waiting for init to reap it counts as gone)."""
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*FORGERL, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize(
    ("toml", "override", "expected"),
    [
        ("max_steps = 2\n[agent]\ncommand = ['x']\n", ["--trainer.lr", "-1"], "trainer.lr"),
        ("max_steps = 2\n[agent]\ncommand = ['x']\n", ["--trainer.bogus", "1"], "trainer.bogus"),
        ("max_steps = 'many'\n", [], "max_steps"),
        ("[agent\n", [], "invalid TOML"),
        ("[agent]\ncommand = []\n", [], "agent.command"),
        ("[agent]\ncommand = ['x']\n", ["--trainer.lr"], "needs a value"),
        ("[agent]\ncommand = ['x']\n[model]\npath = '/nonexistent'\n", [], "model.path"),
    ],
)
def test_bad_config_is_one_line_exit_2(tmp_path, toml, override, expected):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    result = _run("train", str(path), *override)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("forgerl: error:") and expected in lines[0]
    assert "Traceback" not in result.stderr


def test_missing_config_and_plot_of_empty_dir(tmp_path):
    result = _run("train", str(tmp_path / "nope.toml"))
    assert result.returncode == 2 and "config file not found" in result.stderr
    result = _run("plot", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_sigint_stops_cleanly_without_orphans(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    # An agent that records its pid, spawns a grandchild, and hangs.
    agent = tmp_path / "hang.py"
    agent.write_text(
        "import os, subprocess, sys, time, pathlib\n"
        f"d = pathlib.Path({str(pids)!r})\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "(d / str(os.getpid())).write_text(str(child.pid))\n"
        "time.sleep(600)\n"
    )
    config = tmp_path / "c.toml"
    config.write_text(
        f"run_dir = {str(tmp_path / 'run')!r}\nmax_steps = 2\n"
        "[model]\npath = 'tiny'\nmax_model_len = 512\n"
        f"[agent]\ncommand = ['python', {str(agent)!r}]\n"
        "[tasks]\neval_size = 0\n[rollout]\ngroup_size = 2\ntasks_per_step = 1\n"
    )
    proc = subprocess.Popen([*FORGERL, "train", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while len(list(pids.iterdir())) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert len(list(pids.iterdir())) >= 2, "agents did not start"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    for f in pids.iterdir():
        for pid in (int(f.name), int(f.read_text())):
            assert _gone(pid), f"agent process {pid} survived Ctrl-C"
    assert (tmp_path / "run" / "pool.sqlite").exists()


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_trains_each_group_once(tmp_path):
    """SIGKILL the whole run after its first checkpoint, re-run the same command: training
    continues from the checkpoint to max_steps and no task is trained twice (CASES.md C12)."""
    agent = tmp_path / "agent.py"
    agent.write_text(  # one model call, then right half of the time: group rewards vary
        "import json, os, random\n"
        "from openai import OpenAI\n"
        "q = json.loads(os.environ['FORGERL_TASK'])['question']\n"
        "OpenAI().chat.completions.create(model='policy', max_tokens=4,\n"
        "                                 messages=[{'role': 'user', 'content': q}])\n"
        "expr = q.rsplit(':', 1)[1].replace('=', '')\n"
        "print(eval(expr) if random.random() < 0.5 else 'no idea')\n"
    )
    run_dir = tmp_path / "run"
    config = tmp_path / "c.toml"
    config.write_text(
        f"run_dir = {str(run_dir)!r}\nmax_steps = 4\n"
        "[model]\npath = 'tiny'\nmax_model_len = 512\n"
        f"[agent]\ncommand = ['python', {str(agent)!r}]\n"
        "[tasks]\neval_size = 0\nparams = {min_terms = 2, max_terms = 2, max_digits = 1}\n"
        "[rollout]\ngroup_size = 4\ntasks_per_step = 1\n"
        "[trainer]\ncheckpoint_every = 1\n"
    )
    proc = subprocess.Popen([*FORGERL, "train", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    ckpts = run_dir / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not any(ckpts.glob("step_*/trainer_state.json")):
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    result = _run("train", str(config))
    assert result.returncode == 0, result.stderr
    import sqlite3

    db = sqlite3.connect(run_dir / "pool.sqlite")
    trained = db.execute("SELECT trained_step FROM tasks WHERE status='trained'")
    steps = sorted(s for (s,) in trained)
    # One group per step; a batch without learning signal is consumed at the current step (0 if
    # it came before the first update), so steps may repeat, but every step 1..4 trained a group
    # and the pool refuses to mark a task trained twice.
    assert steps[-1] == 4 and {1, 2, 3, 4} <= set(steps)
    records = [r for r in (run_dir / "metrics.jsonl").read_text().splitlines() if r]
    assert records
