"""No silent skips (issue 51): a pytest plugin, loaded by tests/conftest.py.

- Every skip carries a reason: `pytest.skip()` without one, `@pytest.mark.skip` without
  `reason=` or a string `skipif` condition without `reason=` fails that test (pytest itself
  refuses a boolean `skipif` without a reason).
- The run ends with a block "skipped N:" and one line per reason, "count x reason (files)",
  built from the reports the terminal received, so it is the same under xdist (`-n 2`).
- Under CI (`CI` set to anything but "", "0", "false"; `.ci/run` exports CI=true) a skip fails,
  naming its reason, unless the reason starts with one of `CI_MAY_SKIP`: what no CI machine
  here can provide (CUDA; a platform that is not Linux). Root, the venvs (.venv-vllm,
  .venv-openenv, .venv-verifiers), servers, node and the coding CLIs, the built families and
  the SmolLM2 cache are CI's to provide (scripts/setup.sh), so their skips fail there. A skip at
  collection (a module-level `importorskip`) becomes a collection error.
- `@pytest.mark.runs_in(active, where)` marks a test that runs only in `where`, where another
  test re-runs its module (a private network namespace, `.venv-vllm`): when `active` is false
  it is deselected ("N deselected" in the summary line), neither run nor counted as a skip.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable

import pytest

CI_MAY_SKIP = ("needs CUDA", "not Linux")  # reason prefixes that may skip under CI
NO_REASON = ("", "unconditional skip")  # pytest's reasons for a skip given none


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def reason_of(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason of a skipped report; its longrepr is (path, line, "Skipped: reason")."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple | list) else str(longrepr)
    return text.removeprefix("Skipped").removeprefix(":").strip()


def refusal(reason: str) -> str | None:
    """Why a skip with this reason fails the run, or None when it may stay a skip."""
    if reason in NO_REASON or reason.startswith("condition: "):
        return (f"a skip without a reason ({reason or 'empty'}): give pytest.skip / "
                "pytest.mark.skip(if) a reason naming what is missing")
    if in_ci() and not reason.startswith(CI_MAY_SKIP):
        return (f"skipped under CI, which must provide what this test needs "
                f"(scripts/setup.sh, .ci/run): {reason}")
    return None


def _refuse(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        why = refusal(reason_of(report))
        if why is not None:
            report.outcome = "failed"
            report.longrepr = why


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    _refuse(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    _refuse(report)
    return report


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "runs_in(active, where): runs only in `where` (another test re-runs its module "
        "there); deselected, not skipped, where `active` is false")


def deselect(config: pytest.Config, items: list[pytest.Item],
             drop: Callable[[pytest.Item], bool]) -> None:
    """Take the items `drop` picks out of this run, reported as deselected (not skipped)."""
    keep: list[pytest.Item] = []
    gone: list[pytest.Item] = []
    for item in items:
        (gone if drop(item) else keep).append(item)
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = keep


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deselect(config, items, lambda item: (mark := item.get_closest_marker("runs_in")) is not None
             and not mark.args[0])


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """"skipped N:" then "count x reason (files)" per reason, most frequent first."""
    files: dict[str, list[str]] = defaultdict(list)
    for report in terminalreporter.stats.get("skipped", []):
        if not hasattr(report, "wasxfail"):
            files[reason_of(report)].append(report.nodeid.split("::")[0] or ".")
    if not files:
        return
    terminalreporter.write_sep("-", f"skipped {sum(map(len, files.values()))}:")
    for reason, where in sorted(files.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        terminalreporter.write_line(f"{len(where):4d} x {reason} ({', '.join(sorted(set(where)))})")
