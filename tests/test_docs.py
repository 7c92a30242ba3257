"""The docs site builds without a warning, and the configuration reference matches the code.

`mkdocs build --strict` (mkdocs.yml) fails on a broken link or anchor and on a page missing from
the navigation; `scripts/config_reference.py` regenerates docs/reference/config.md from
forgerl.config's pydantic models, which must equal the committed file.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mkdocs_build_strict_has_no_warning(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "WARNING" not in out, out
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_config_reference_matches_the_schema() -> None:
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    committed = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert committed == module.render(), (
        "docs/reference/config.md is stale: run .venv/bin/python scripts/config_reference.py")
