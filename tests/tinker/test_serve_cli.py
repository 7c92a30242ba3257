"""`forgerl serve`: bad input is one line and exit 2 (the happy path: test_cookbook.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("config, args, message", [
    (None, [], "config file not found"),
    ('[engine]\ntype = "remote"\nbase_url = "http://127.0.0.1:9"\n', [],
     "engine.type: forgerl serve samples with the local engine"),
    ("[serve]\nlora_alpha = 0.0\n", [], "serve.lora_alpha"),
    ("", ["--port", "70000"], "serve.port"),
    ('[serve]\nlora_targets = ["q_proj", "qkv"]\n', [],  # was served, "qkv" adapting nothing
     "serve.lora_targets: 'qkv' names no Linear layer"),
    ("[serve]\nlora_targets = []\n", [], "serve.lora_targets: '' names no Linear layer"),
])
def test_bad_serve_input_is_one_line(tmp_path: Path, config: str | None, args: list[str],
                                     message: str) -> None:
    path = tmp_path / "serve.toml"
    if config is not None:
        path.write_text('[model]\npath = "tiny"\n' + config)
    done = subprocess.run([sys.executable, "-m", "forgerl", "serve", str(path), *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
