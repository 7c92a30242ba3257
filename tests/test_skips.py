"""The no-silent-skips plugin (tests/skips.py), run as a real pytest subprocess on a small temp
suite: a skip with a reason is listed by reason at the end; a bare skip fails; under CI=true a
skip for a missing venv fails naming it (a module-level one as a collection error) while a
"needs CUDA" skip stays a skip; a `runs_in(False, ...)` test is deselected, not skipped; the same
block and counts under xdist (`-n 2`; its summary line leaves out the deselected)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import pytest

def test_runs():
    pass

@pytest.mark.parametrize("n", [1, 2])
def test_needs_a_venv(n):
    pytest.skip("no .venv-demo: run `bash scripts/setup_demo.sh`")

@pytest.mark.skipif(True, reason="needs CUDA")
def test_gpu():
    pass

@pytest.mark.runs_in(False, "another test's namespace")
def test_inner():
    raise AssertionError("deselected, never run")
'''
BARE = '''
import pytest

def test_bare():
    pytest.skip()

@pytest.mark.skip
def test_bare_mark():
    pass
'''
MODULE_SKIP = 'import pytest\npytest.importorskip("forgerl_no_such_module")\n'


def run(tmp_path: Path, files: dict[str, str], *args: str, ci: bool) -> tuple[int, str]:
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    # no third-party plugins but xdist where asked: a start in 1 s instead of 10
    env.update(PYTHONPATH=str(ROOT), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               **({"CI": "true"} if ci else {}))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.skips", "-p",
                           "no:cacheprovider", "-q", *args, *files], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout


def block(out: str) -> list[str]:
    """The lines of the "skipped N:" block."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.fullmatch(r"-+ skipped \d+: -+", line))
    return lines[start: start + 1 + sum(1 for line in lines[start + 1:]
                                        if re.match(r" +\d+ x ", line))]


@pytest.mark.parametrize("xdist", [(), ("-p", "xdist", "-n", "2")], ids=["serial", "xdist"])
def test_skips_are_listed_by_reason(tmp_path, xdist):
    code, out = run(tmp_path, {"test_demo.py": SUITE, "test_mod.py": MODULE_SKIP}, *xdist,
                    ci=False)
    assert code == 0, out
    assert block(out) == [
        block(out)[0],
        "   2 x no .venv-demo: run `bash scripts/setup_demo.sh` (test_demo.py)",
        "   1 x could not import 'forgerl_no_such_module': No module named "
        "'forgerl_no_such_module' (test_mod.py)",
        "   1 x needs CUDA (test_demo.py)",
    ]
    assert "skipped 4:" in block(out)[0]
    # xdist's controller does not count its workers' deselected tests
    assert re.search(r"\b1 passed, 4 skipped(, 1 deselected)? in\b", out), out


def test_a_skip_without_a_reason_fails(tmp_path):
    code, out = run(tmp_path, {"test_bare.py": BARE}, ci=False)
    assert code == 1, out
    assert re.search(r"test_bare _+\na skip without a reason \(empty\): give pytest.skip", out)
    assert re.search(r"setup of test_bare_mark _+\na skip without a reason \(unconditional", out)
    assert re.search(r"\b1 failed, 1 error in\b", out), out  # the mark skips in setup


@pytest.mark.parametrize("xdist", [(), ("-p", "xdist", "-n", "2")], ids=["serial", "xdist"])
def test_under_ci_an_env_skip_fails_and_a_gpu_skip_stays(tmp_path, xdist):
    code, out = run(tmp_path, {"test_demo.py": SUITE}, "-rfs", *xdist, ci=True)
    assert code == 1, out
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 2 and all(
        "skipped under CI" in line and "no .venv-demo" in line for line in failed), out
    assert block(out)[1:] == ["   1 x needs CUDA (test_demo.py)"]
    assert re.search(r"\b2 failed, 1 passed, 1 skipped(, 1 deselected)? in\b", out), out


def test_under_ci_a_module_level_skip_is_a_collection_error(tmp_path):
    code, out = run(tmp_path, {"test_mod.py": MODULE_SKIP}, ci=True)
    assert code == 2, out
    assert "ERROR test_mod.py" in out and "skipped under CI" in out, out
    assert "forgerl_no_such_module" in out
