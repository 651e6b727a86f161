"""What the PDL-launched Triton kernels read before their ``griddepcontrol.wait`` (CPU: the kernels' source,
parsed; Triton itself is not needed).

The rule (engram/model/layers/pdl.py): when a PDL kernel runs, every kernel before it on its stream has
finished except the one just before, so before its wait a kernel may read only what that one does not write:
weights, the step's inputs, cos/sin, the keys and values of earlier steps. Each kernel's early reads are
listed below with the reason they are safe; a read moved before the wait without being listed here (say the
norm's input X, which the GEMM just before writes) fails this test, and with it the review the move needs.
Whether outputs stay bitwise equal is tests/gpu/test_pdl.py's part.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

LAYERS = Path(__file__).resolve().parents[2] / "engram" / "model" / "layers"
# kernel -> (pointer arguments read before the wait, pointer arguments only prefetched into L2 before it)
EARLY_READS = {
    "_rms_norm_kernel": ({"W"}, set()),  # the norm weight
    "_norm_rope_kernel": ({"W", "COS", "SIN", "SLOTS"}, set()),  # weight, cos/sin (before layer 0), slots (input)
    "_norm_rope_qk_kernel": ({"WQ", "WK", "COS", "SIN", "SLOTS"}, set()),
    "_silu_mul_kernel": (set(), set()),
    # the step's sequences, tokens, lengths and block tables (inputs); K/V lines of the first split into L2 only
    "_decode_split_kernel": ({"SEQ", "TOK", "LENS", "BT"}, {"K", "V"}),
    "_decode_combine_kernel": ({"LENS", "TOK"}, set()),
}
PREFETCH_HELPERS = {"_prefetch_l2"}


def _kernels() -> dict[str, ast.FunctionDef]:
    found = {}
    for name in ("fused_triton.py", "paged_attention_triton.py"):
        tree = ast.parse((LAYERS / name).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                    _is_pdl_enter(c) for c in ast.walk(node) if isinstance(c, ast.Call)):
                found[node.name] = node
    return found


def _is_pdl_enter(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Name) and call.func.id == "pdl_enter"


def _before_wait(body: list[ast.stmt]) -> list[ast.ast]:
    """What can run before a pdl_enter in ``body``: on each path down to a pdl_enter call, the statements (and
    branch conditions) ahead of it in every enclosing block. Empty when ``body`` has no pdl_enter."""
    return _scan(body)[1]


def _scan(body: list[ast.stmt]) -> tuple[bool, list[ast.ast]]:
    """(whether ``body`` reaches a pdl_enter, what runs before it)."""
    for i, stmt in enumerate(body):
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and _is_pdl_enter(stmt.value):
            return True, list(body[:i])
        found, inner = False, []
        for block in (getattr(stmt, f, None) or [] for f in ("body", "orelse")):
            f, before = _scan(block)
            found, inner = found or f, inner + before
        if found:  # the rest of body runs after the wait
            head = [stmt.test] if isinstance(stmt, (ast.If, ast.While)) else []
            return True, list(body[:i]) + head + inner
    return False, []


def _pointer_names(nodes) -> tuple[set[str], set[str]]:
    """Upper-case names (the kernels' pointer arguments, by the project's convention) used in ``nodes``:
    (used otherwise, used inside a prefetch helper's call)."""
    plain, prefetched = set(), set()
    for node in nodes:
        inside = set()
        for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)):
            if isinstance(call.func, ast.Name) and call.func.id in PREFETCH_HELPERS:
                for n in ast.walk(call):
                    if isinstance(n, ast.Name) and n.id.isupper():
                        prefetched.add(n.id)
                        inside.add(id(n))
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id.isupper() and id(n) not in inside:
                plain.add(n.id)
    return plain, prefetched


def test_every_pdl_kernel_is_listed():
    assert set(_kernels()) == set(EARLY_READS)


@pytest.mark.parametrize("kernel", sorted(EARLY_READS))
def test_a_kernel_reads_before_its_wait_only_what_the_rule_allows(kernel):
    node = _kernels()[kernel]
    constexprs = {a.arg for a in node.args.args
                  if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)}
    plain, prefetched = _pointer_names(_before_wait(node.body))
    reads, prefetches = EARLY_READS[kernel]
    assert plain - constexprs == reads, f"{kernel} reads before its wait: {sorted(plain - constexprs)}"
    assert prefetched == prefetches


def test_the_parser_sees_a_read_moved_before_the_wait():
    """The check can fail: the rms norm with its input X loaded before the wait is caught."""
    src = '''
def k(X, W, Y, USE_PDL: tl.constexpr):
    w = tl.load(W)
    x = tl.load(X)
    pdl_enter(USE_PDL)
    tl.store(Y, x * w)
'''
    node = ast.parse(src).body[0]
    assert _pointer_names(_before_wait(node.body))[0] == {"W", "X"}
    branchy = '''
def k(Q, K, S, USE_PDL: tl.constexpr):
    if tl.program_id(1) == 0:
        pdl_enter(USE_PDL)
        tl.load(Q)
    else:
        s = tl.load(S)
        pdl_enter(USE_PDL)
        tl.load(K)
'''
    node = ast.parse(branchy).body[0]
    assert _pointer_names(_before_wait(node.body))[0] == {"S"}
