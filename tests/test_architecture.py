"""The floor plan (docs/architecture.md), checked from the source: an AST walk of every import in snlp/,
module-level and inside functions (imports under `if TYPE_CHECKING:` are annotations, not dependencies).

- no import cycle between modules;
- a floor imports only from floors below it (siblings on one floor not at all);
- no module imports another module's `_private` names;
- argparse only in snlp.apps;
- the public API (snlp.__all__) fits on one screen.
import-linter (`lint-imports`, the contract in pyproject.toml) checks the floors too; this test also covers
what it does not (private names, argparse, cycles inside a package)."""

from __future__ import annotations

import ast
from pathlib import Path

import snlp

ROOT = Path(snlp.__file__).resolve().parent
# bottom to top; a tuple is one floor of siblings that must not import each other
FLOORS = ["runtime", "model", "method", "io", "decode", ("train", "eval", "dist"), "bench", "apps"]


def _floor(pkg: str) -> int | None:
    for i, f in enumerate(FLOORS):
        if pkg == f or (isinstance(f, tuple) and pkg in f):
            return i
    return None


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _type_checking_nodes(tree) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for b in node.body for n in ast.walk(b)}
    return skip


def _imports(name: str, path: Path, modules: dict) -> list[tuple[str, list[str]]]:
    """(imported snlp module, imported names) for every import statement of the module."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "snlp"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "snlp":
                continue
            names = [a.name for a in node.names]
            for n in names:  # `from snlp.io import data` imports the module snlp.io.data
                if f"{base}.{n}" in modules:
                    out.append((f"{base}.{n}", []))
            out.append((base, [n for n in names if f"{base}.{n}" not in modules]))
    return out


def _graph():
    modules = _modules()
    return modules, {m: _imports(m, p, modules) for m, p in modules.items()}


def test_no_import_cycles():
    modules, g = _graph()
    edges = {m: {t for t, _ in imps if t in modules and t != m} for m, imps in g.items()}
    # a package's __init__ re-exporting its own modules is not a dependency of those modules on it
    for m in edges:
        edges[m] = {t for t in edges[m] if not (m.startswith(t + ".") and t != "snlp")}
    edges["snlp"] = edges.get("snlp", set())
    color, stack, cycles = {}, [], []

    def visit(m):
        color[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if color.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in color:
                visit(t)
        stack.pop()
        color[m] = 2

    for m in sorted(edges):
        if m not in color:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_floors_import_only_downwards():
    modules, g = _graph()
    bad = []
    for m, imps in g.items():
        parts = m.split(".")
        if len(parts) < 2 or parts[1] == "__main__":
            continue
        src = _floor(parts[1])
        assert src is not None, f"{m}: sub-package {parts[1]} is on no floor of FLOORS / docs/architecture.md"
        for t, _ in imps:
            tp = t.split(".")
            if len(tp) < 2 or tp[1] == parts[1]:
                continue
            dst = _floor(tp[1])
            if dst is None or dst >= src:
                bad.append(f"{m} imports {t}")
    assert not bad, "imports that go up or sideways:\n" + "\n".join(sorted(bad))


def test_no_private_imports_across_modules():
    modules, g = _graph()
    bad = [f"{m} imports {t}.{n}" for m, imps in g.items() for t, names in imps for n in names
           if n.startswith("_") and not n.startswith("__") and t != m]
    assert not bad, "\n".join(sorted(bad))


def test_argparse_only_in_apps():
    bad = []
    for m, p in _modules().items():
        if m.startswith("snlp.apps") or m == "snlp.__main__":
            continue
        src = p.read_text()
        if "import argparse" in src or "ArgumentParser" in src or "def add_arguments(" in src or "def run(args" in src:
            bad.append(m)
    assert not bad, f"command-line code outside snlp.apps: {bad}"


def test_public_api_fits_on_a_screen():
    assert len(snlp.__all__) <= 35
    missing = [n for n in snlp.__all__ if not hasattr(snlp, n)]
    assert not missing, missing
