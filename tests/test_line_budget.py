"""The core package stays within its code-line budget (STYLE.md §9, scripts/sz.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_core_code_lines_within_budget():
    path = Path(__file__).resolve().parents[1] / "scripts" / "sz.py"
    spec = importlib.util.spec_from_file_location("sz", path)
    sz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sz)
    counts = sz.table()
    assert counts["controller.py"] > 100  # the counter sees real code
    assert sum(counts.values()) <= sz.MAX_LINES
