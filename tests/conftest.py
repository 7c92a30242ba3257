"""Shared fixtures: the tiny random Llama-style model, the byte tokenizer, a SQLite path."""

from __future__ import annotations

import pytest

from forgerl.models import build_byte_tokenizer, build_tiny_model


@pytest.fixture(scope="session")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture
def tiny_model():
    return build_tiny_model()


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "pool.sqlite"
