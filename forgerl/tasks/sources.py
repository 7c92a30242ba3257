"""`[tasks] source` → its `Environment`, each adapter imported only when chosen (each standard's
package is an optional extra, or lives in its own venv)."""

from __future__ import annotations

from pathlib import Path

from forgerl.config import TasksConfig
from forgerl.tasks.base import Environment

PLAYED_BY_TOOL_AGENT = frozenset({"ors", "openenv", "verifiers", "nemo_gym", "gymnasium"})
"""Sources whose episodes the built-in tool agent plays (no [agent] needed); Harbor's need one."""


def build_environment(t: TasksConfig, base_dir: Path | None = None) -> Environment | None:
    """The environment of `[tasks]` `t`; None for "reasoning_gym" and "file" (their tasks and
    scores come from `forgerl.rewards.reasoning_gym`). Raises ValueError naming the missing
    package (and how to install it) when the standard's adapter cannot load."""
    source = "file" if t.source == "reasoning_gym" and t.dataset.endswith(".py") else t.source
    if source in ("reasoning_gym", "file"):
        return None
    base = base_dir or Path.cwd()
    cls = _adapter(source)
    return cls(t.env, dict(t.params), base, t.python)


def _adapter(source: str) -> type[Environment]:
    """The adapter class of `source` (module forgerl.tasks.<source>, class Adapter)."""
    import importlib  # lazy: only environment sources load an adapter module

    try:
        module = importlib.import_module(f"forgerl.tasks.{source}")
    except ImportError as e:
        raise ValueError(f"the {source} adapter cannot load: {e} (install ForgeRL's "
                         f"'{source}' extra: pip install -e '.[{source}]')") from None
    return module.Adapter
