"""Shared fixtures: the tiny random Llama-style model, the byte tokenizer, a SQLite path."""

from __future__ import annotations

import pytest
import torch

from forgerl.models import build_byte_tokenizer, build_tiny_model

# One intra-op thread per test process: the suite runs as 2 xdist workers on 2 cores, and
# oversubscribed OpenMP threads make small CPU kernels many times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture
def tiny_model():
    return build_tiny_model()


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "pool.sqlite"
