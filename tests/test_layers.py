"""The package's layers run one way (STYLE.md §3): read every `import` in forgerl/ with `ast`
and check that (1) no two modules import each other through any chain (module-level,
TYPE_CHECKING and function-level imports all count), (2) every import goes to a lower layer or
stays inside its own top-level package, and (3) every import inside a function says on its line,
or the line above, why it must stay lazy (an optional extra, a heavy import off a fast path).

The one sanctioned upward edge: a config section's `build()` in forgerl/config.py imports its
implementation lazily (STYLE.md §4, the config-union build mechanism).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "forgerl"

# Lowest first. A top-level name (forgerl.<name>) is placed here; a module of a package belongs to
# its package's layer.
LAYERS: list[set[str]] = [
    {"types"},  # the records every layer shares
    {"config", "cpu_share"},  # config / runtime
    {"models", "weights", "drafter", "lora"},  # models, weight formats, the MTP draft head,
    # many LoRA adapters on one base
    {"engines", "datapool", "rewards"},
    {"gateway", "scheduler", "trainer"},
    {"agents", "cluster", "metrics"},
    {"tasks"},  # environments: the sandbox (agents) below them
    {"controller", "plot"},
    {"cli"},
    {"__main__", ""},  # "" is forgerl/__init__.py
]


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted (forgerl.gateway.app)
    target: str  # imported module, dotted
    line: int
    in_function: str | None  # the enclosing function's name, None at module level
    reason: bool  # a comment on the line or the line above


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _functions(tree: ast.AST) -> dict[int, str]:
    """id(node) → name of the innermost function holding it."""
    owner: dict[int, str] = {}

    def visit(node: ast.AST, name: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            is_function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            inner = child.name if is_function else name
            if inner is not None:
                owner[id(child)] = inner
            visit(child, inner)

    visit(tree, None)
    return owner


def _commented(lines: list[str], lineno: int) -> bool:
    """A comment on import line `lineno` (1-based), on an import line of the run of import lines
    it ends, or on the comment line right above that run."""
    i = lineno - 1
    while i >= 0:
        text = lines[i].strip()
        if "#" in text:
            return True
        if i < lineno - 1 and not text.startswith(("import ", "from ")):
            return False
        i -= 1
    return False


def read_imports() -> tuple[set[str], list[Import]]:
    """All forgerl modules, and every import among them (targets outside forgerl kept as named)."""
    paths = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    found: list[Import] = []
    for name, path in paths.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        owner = _functions(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" for a in node.names]
                targets = [t for t in targets if t in paths] or [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            function, reason = owner.get(id(node)), _commented(lines, node.lineno)
            for target in targets:
                if target.startswith("forgerl"):
                    while target not in paths:
                        target = target.rpartition(".")[0]
                if target != name:
                    found.append(Import(name, target, node.lineno, function, reason))
    return set(paths), found


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module} is in no layer: add forgerl.{top} to LAYERS")


def _package(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def cycles(modules: set[str], imports: list[Import]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for imp in imports:
        if imp.target in modules:
            edges[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.append(w)
            on_stack.discard(v)
            if component:
                found.append(sorted([v, *component]))

    for module in sorted(modules):
        if module not in index:
            connect(module)
    return found


def test_every_module_has_a_layer() -> None:
    modules, _ = read_imports()
    assert all(layer(m) >= 0 for m in modules)


def test_no_import_cycles() -> None:
    modules, imports = read_imports()
    found = cycles(modules, imports)
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def test_imports_go_down_or_stay_in_their_package() -> None:
    _, imports = read_imports()
    wrong = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in imports
        if i.target.startswith("forgerl")
        and _package(i.source) != _package(i.target)
        and layer(i.target) >= layer(i.source)
        and not (i.source == "forgerl.config" and i.in_function == "build")
    ]
    assert wrong == [], "\n".join(wrong)


def test_imports_inside_functions_say_why() -> None:
    _, imports = read_imports()
    silent = [f"{i.source}:{i.line} ({i.in_function})" for i in imports
              if i.in_function is not None and not i.reason]
    assert silent == [], "\n".join(silent)


def test_the_checker_sees_a_cycle_and_an_upward_import() -> None:
    """The reader itself: a two-module cycle is found and a trainer → controller edge is upward."""
    a, b = "forgerl.trainer.x", "forgerl.controller.y"
    found = cycles({a, b}, [Import(a, b, 1, None, False), Import(b, a, 1, None, False)])
    assert found == [[b, a]]
    assert layer(b) > layer(a)
    lines = ["def f():", "    # lazy: an extra", "    import a", "    import b",
             "def g():", "    import c"]
    assert _commented(lines, 4) and not _commented(lines, 6)
    assert layer("forgerl.types") == 0 and layer("forgerl") == len(LAYERS) - 1
