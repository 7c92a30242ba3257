"""The model families built by scripts/families.py (`.cache/families/<family>/`), for tests.

`load(name)` gives a family's HF tokenizer (its real chat template) and its family.json; a
family whose folder is missing is a skip naming the command that builds it (scripts/setup.sh
builds them all, CI runs it from scratch). Loaded once per process.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from scripts.families import FAMILIES

ROOT = Path(__file__).resolve().parent.parent / ".cache" / "families"
NAMES = tuple(FAMILIES)
"""Every family the builder knows, in its order."""


@dataclass(frozen=True)
class Family:
    """One built family: `name`, its tokenizer (chat template set) and family.json (`meta`)."""

    name: str
    tokenizer: PreTrainedTokenizerBase
    meta: dict[str, Any]

    @property
    def eos_ids(self) -> list[int]:
        """The generation config's eos ids (the ids a reply may end with)."""
        return list(self.meta["generation_eos_ids"])


@functools.cache
def _load(name: str) -> Family | None:
    folder = ROOT / name
    if not (folder / "family.json").exists():
        return None
    meta = json.loads((folder / "family.json").read_text(encoding="utf-8"))
    return Family(name, AutoTokenizer.from_pretrained(folder), meta)


def load(name: str) -> Family:
    """The built family `name`; pytest.skip (with the reason) when its folder is missing."""
    fam = _load(name)
    if fam is None:
        pytest.skip(f"family {name} not built: run `python scripts/families.py {name}` "
                    "(scripts/setup.sh builds every family)")
    return fam
