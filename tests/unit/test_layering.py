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


# The package's layers in data-flow order: a module imports its own layer and the ones before it only.
LAYERS = [
    ("config", {"envs", "fast_path", "transfer", "config", "configs"}),
    ("addressing", {"tokenizer", "hashing", "quant"}),
    ("store", {"store"}),
    ("model", {"model", "module", "short_conv", "weights", "embedding"}),
    ("parallel", {"parallel"}),
    ("engine", {"engine"}),
    ("server", {"server"}),
    ("bench", {"bench"}),
    ("commands", {"commands", "cli", "__main__"}),
]
EXTENSIONS = {"engram.store._pread_pool"}  # built from csrc/: no Python imports of its own


def _modules() -> dict[str, Path]:
    out = {}
    for p in (ROOT / "engram").rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks (annotations only, never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from pkg import submodule`` counts as the submodule)."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_nodes(tree)
        found = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    if sub not in EXTENSIONS:
                        found.add(sub if sub in mods else node.module)
        edges[mod] = {r for n in found if n.startswith("engram") for r in [resolve(n)] if r and r != mod}
    return edges


def _layer(mod: str) -> int | None:
    parts = mod.split(".")
    if len(parts) < 2:
        return None  # the package itself re-exports the public API
    return next(i for i, (_, tops) in enumerate(LAYERS) if parts[1] in tops)


def test_every_module_belongs_to_a_layer():
    unplaced = [m for m in _modules() if m != "engram" and _layer(m) is None]
    assert not unplaced, unplaced


def test_no_module_imports_a_later_layer():
    mods = _modules()
    upward = sorted(f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
                    for a, bs in _edges(mods).items() if _layer(a) is not None
                    for b in bs if _layer(b) is not None and _layer(b) > _layer(a))
    assert not upward, upward


def test_no_import_cycle():
    edges = _edges(_modules())
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


# Function-level imports of package modules: only of the Triton modules (triton has no CPU backend, so they
# import only where a GPU path runs), and in the command layer, which defers each subcommand's imports until
# it runs (``engram --help`` loads no model code).
# _pread_pool: the C reader
OPTIONAL = ("triton_gather", "fused_triton", "paged_attention_triton", "mhc_triton", "_pread_pool")
DEFERRING = ("engram.commands", "engram.bench", "engram.cli")


def test_lazy_package_imports_only_for_optional_dependencies():
    offenders = []
    for mod, path in _modules().items():
        if mod.startswith(DEFERRING):
            continue
        tree = ast.parse(path.read_text(), str(path))
        top, skip = {id(n) for n in tree.body}, _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in top or id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"{node.module}.{a.name}" for a in node.names] if node.module else [])
            bad = [n for n in names if n.startswith("engram") and not n.rsplit(".", 1)[-1] in OPTIONAL
                   and not n.rsplit(".", 2)[-2] in OPTIONAL]
            offenders += [f"{mod}:{node.lineno} imports {n} lazily" for n in bad]
    assert not offenders, offenders


def test_sizes_stay_within_the_limits_the_docs_keep():
    """One concept a file (at most 400 lines in engram/), a README of at most 150 lines and docs/benchmarks.md of at
    most 250: the latest numbers, nothing older."""
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sorted((ROOT / "engram").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 400]
    assert not long, long
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 250
