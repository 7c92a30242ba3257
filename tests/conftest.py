"""Shared fixtures: the tiny random Llama-style model, the byte tokenizer, a SQLite path, a
PostgreSQL database URL (`pg_url`, tests/pg.py).

`pytest --prefix-cache off` runs the suite with the engine's prefix (KV reuse) cache disabled:
every LocalEngine built in this process gets prefix_cache_tokens=0, and tests marked
`prefix_cache` (they test the cache itself) are deselected. Engines built in child processes
(the `forgerl train` runs of tests/test_cli.py) keep their config's setting.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from forgerl.models import build_byte_tokenizer, build_tiny_model
from tests.pg import pg_server, pg_url  # noqa: F401  (fixtures: a real PostgreSQL server)

# Skips name their reason, are summed up by reason at the end, and fail under CI (tests/skips.py).
pytest_plugins = ("tests.skips",)
pytest.register_assert_rewrite("tests.skips")  # imported here before pytest loads it as a plugin
from tests.skips import deselect, in_ci  # noqa: E402

# CI (CI=true) draws every property test's examples from a fixed seed, so a landing is judged on
# the code, not on the draw; a developer's run draws new examples each time.
with contextlib.suppress(ImportError):  # .venv-vllm, where vLLM tests re-run, has no hypothesis
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, print_blob=True)
    if in_ci():
        settings.load_profile("ci")

# One intra-op thread per test process: the suite runs as 2 xdist workers on 2 cores, and
# oversubscribed OpenMP threads make small CPU kernels many times slower.
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--prefix-cache",
        choices=("on", "off"),
        default="on",
        help="off: build every LocalEngine with prefix_cache_tokens=0 (default: on)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "prefix_cache: tests the engine's prefix cache; deselected by --prefix-cache off"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("prefix_cache") == "off":  # a choice of this run, not a skip
        deselect(config, items, lambda item: "prefix_cache" in item.keywords)


@pytest.fixture(scope="session", autouse=True)
def _prefix_cache_option(request: pytest.FixtureRequest):
    """With --prefix-cache off, force prefix_cache_tokens=0 in LocalEngine.__init__."""
    if request.config.getoption("prefix_cache") == "on":
        yield
        return
    from forgerl.engines.local import LocalEngine

    init = LocalEngine.__init__
    signature = inspect.signature(init)

    def init_without_cache(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["prefix_cache_tokens"] = 0
        init(*bound.args, **bound.kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalEngine, "__init__", init_without_cache)
        yield


@pytest.fixture(scope="session")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture
def tiny_model():
    return build_tiny_model()


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "pool.sqlite"
