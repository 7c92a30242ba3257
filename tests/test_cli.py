"""The `forgerl` command as a user runs it: one-line errors with exit code 2 for bad input.
Stopping and resuming runs: tests/test_crash_consistency.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FORGERL = [sys.executable, "-m", "forgerl"]


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
        ("[agent]\ncommand = ['x']\n[tasks]\nparams = {min_terms = 5, max_terms = 2}\n", [],
         "tasks.params: max_terms must be >= min_terms"),
        ("[agent]\ncommand = ['x']\n[tasks]\nparams = {foo = 1}\n", [], "tasks.params"),
        ("[agent]\ncommand = ['x']\n[tasks]\ndataset = 'nosuch'\n", [], "tasks.dataset"),
        ("[agent]\ncommand = ['x']\n", ["--run_dir", ""], "run_dir"),
        ("[agent]\ncommand = ['x']\n", ["--seed", "99999999999999999999999"], "seed"),
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


def test_a_directory_as_config_is_one_line_exit_2(tmp_path):
    result = _run("train", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"forgerl: error: {tmp_path}: cannot read it as a TOML "
                                     "config (IsADirectoryError)")


def test_a_run_dir_in_use_is_refused_and_left_alone(tmp_path):
    """A second `forgerl train` (or `forgerl gateway`) on a run directory another process holds
    exits 2 with one line naming that process, before touching its pool or metrics."""
    import os

    from forgerl.controller import lock_run_dir

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fd = lock_run_dir(run_dir)  # this test process plays the running trainer
    try:
        (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
        config = tmp_path / "c.toml"
        config.write_text(f"run_dir = '{run_dir}'\n[model]\npath = 'tiny'\n[agent]\n"
                          "command = ['x']\n[tasks]\neval_size = 0\n")
        for command in ("train", "gateway"):
            result = _run(command, str(config))
            assert result.returncode == 2, result.stderr
            assert result.stderr.strip() == (
                f"forgerl: error: run_dir {run_dir}: in use by another forgerl process (pid "
                f"{os.getpid()}); stop it or pass another --run_dir")
        assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "metrics.jsonl"]
    finally:
        os.close(fd)


def last_error_line(result: subprocess.CompletedProcess) -> str:
    """The last stderr line of a run that must have failed with exit 2."""
    assert result.returncode == 2, result.stderr
    return result.stderr.strip().splitlines()[-1]


def test_resuming_a_run_with_another_model_is_one_line_exit_2(tmp_path):
    """A run directory whose checkpoint holds another model (here the tiny one, resumed with
    SmolLM2) is refused with one line naming the checkpoint and the first mismatch, not
    torch's multi-line state_dict error cut to its first line."""
    import torch

    from forgerl.models import build_tiny_model
    from forgerl.trainer.checkpoint import save_checkpoint

    run_dir = tmp_path / "run"
    model = build_tiny_model()
    ckpt = save_checkpoint(run_dir, model, torch.optim.AdamW(model.parameters()), 1, {})
    config = tmp_path / "c.toml"
    config.write_text(f"run_dir = '{run_dir}'\nmax_steps = 2\n[model]\npath = 'smollm2'\n"
                      "[agent]\ncommand = ['python', '-c', 'pass']\n[tasks]\neval_size = 0\n")
    result = _run("train", str(config))
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"forgerl: error: model.path: the checkpoint {ckpt} is not of "
                           "'smollm2' (size mismatch for "), line
    assert line.endswith("resume with the run's model or pass another --run_dir"), line
    assert not (run_dir / "config.json").exists()  # the refused settings are not the run's


@pytest.mark.parametrize(("command", "expected"), [
    ("['python', 'nonexistent_agent.py']", "script 'nonexistent_agent.py' not found in {dir}"),
    ("['no_such_binary_xyz', '--flag']", "'no_such_binary_xyz' is not an executable on PATH"),
    ("['./agent.sh']", "'./agent.sh' is not an executable in {dir}"),
])
def test_an_agent_that_cannot_start_is_one_line_exit_2(tmp_path, command, expected):
    """A missing agent script or program is refused before any rollout (it used to fail 16
    groups of rollouts, then stop with a RuntimeError, exit 1)."""
    config = tmp_path / "c.toml"
    config.write_text(f"run_dir = '{tmp_path / 'run'}'\nmax_steps = 1\n[model]\npath = 'tiny'\n"
                      f"[agent]\ncommand = {command}\n[tasks]\neval_size = 0\n")
    result = _run("train", str(config))
    assert last_error_line(result) == (
        "forgerl: error: agent.command: " + expected.format(dir=tmp_path))
    assert [p.name for p in (tmp_path / "run").iterdir()] == [".lock"]  # nothing to resume


def test_a_taken_port_and_a_file_as_run_dir_are_one_line_exit_2(tmp_path):
    """The gateway's address in use, or a run_dir that is a file, name the setting in one line
    (were `OSError: [Errno 98] ...` and `FileExistsError: ...`, exit 1)."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    config = tmp_path / "c.toml"
    config.write_text(f"run_dir = '{tmp_path / 'run'}'\n[model]\npath = 'tiny'\n[agent]\n"
                      "command = ['python', '-c', 'pass']\n[tasks]\neval_size = 0\n")
    try:
        result = _run("gateway", str(config), "--gateway.port", str(port))
    finally:
        taken.close()
    assert last_error_line(result) == (
        f"forgerl: error: gateway.host / gateway.port: cannot listen on 127.0.0.1:{port} "
        "(Address already in use)")
    (tmp_path / "file").write_text("not a directory")
    result = _run("train", str(config), "--run_dir", str(tmp_path / "file"))
    assert last_error_line(result) == (
        f"forgerl: error: run_dir {tmp_path / 'file'}: exists and is not a directory")
    assert (tmp_path / "file").read_text() == "not a directory"
    result = _run("train", str(config), "--run_dir", "/proc/forgerl_run")  # cannot be made
    assert last_error_line(result) == (
        "forgerl: error: run_dir /proc/forgerl_run: cannot be created (No such file or directory)")


def test_the_cli_module_imports_neither_torch_nor_transformers():
    """`forgerl --help` and a stop while starting stay fast and clean: importing forgerl.cli
    loads no torch or transformers (a module-level import of the gateway core from the
    controller once did, so SIGTERM during that import exited 1 and the hub's progress bars
    were on before the CLI turned them off)."""
    code = ("import sys, forgerl.cli; "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"
