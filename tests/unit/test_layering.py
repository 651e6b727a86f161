"""Layering rules checked on the source: model-side code that tests and tiny models use stands below the
store (it never imports ``engram.store``), and test oracles live under tests/, not in the package."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", ["engram/embedding.py", "engram/quant.py"])
def test_does_not_import_the_store(module):
    store = sorted(n for n in _imports(ROOT / module) if n == "engram.store" or n.startswith("engram.store."))
    assert not store, f"{module} imports {store}"


def test_no_package_module_imports_a_test_oracle():
    offenders = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "engram").rglob("*.py")
                       if any(n == "tests" or n.startswith("tests.") for n in _imports(p)))
    assert not offenders, offenders
