"""Each package of forgerl/ stays within its line budget (STYLE.md §1.5, scripts/sz.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _sz():
    path = Path(__file__).resolve().parents[1] / "scripts" / "sz.py"
    spec = importlib.util.spec_from_file_location("sz", path)
    sz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sz)
    return sz


def test_every_package_within_its_budget():
    sz = _sz()
    counts = sz.table()
    assert set(counts) == set(sz.BUDGETS), "a new package needs a budget in scripts/sz.py"
    over = {name: (n, sz.BUDGETS[name]) for name, n in counts.items() if n > sz.BUDGETS[name]}
    assert over == {}


def test_the_counter_reads_docstrings_and_skips_comments(tmp_path):
    sz = _sz()
    module = tmp_path / "m.py"
    module.write_text('"""Doc\nstring."""\n\n# a comment\nx = 1  # trailing\n')
    assert sz.lines(module) == 3
