"""engram.model.kernel_switches: named module flags set for a block and restored, refused when unknown."""
import pytest

from engram.model import kernel_switches
from engram.model.layers import l2_prefetch


def test_a_switch_is_set_inside_the_block_and_restored_after_even_on_error():
    before = l2_prefetch.ENABLED
    with kernel_switches.applied({"l2_prefetch": not before}):
        assert l2_prefetch.ENABLED is (not before)
    assert l2_prefetch.ENABLED is before
    with pytest.raises(KeyError):
        with kernel_switches.applied({"l2_prefetch": not before}):
            raise KeyError("boom")
    assert l2_prefetch.ENABLED is before


def test_unknown_names_and_non_bools_are_refused_before_anything_changes():
    with pytest.raises(ValueError, match="unknown kernel switch 'l2'; known: \\['fused_combine', 'l2_prefetch'\\]"):
        with kernel_switches.applied({"l2": True}):
            pass
    with pytest.raises(ValueError, match="must be true or false"):
        kernel_switches.check({"fused_combine": "yes"})


def test_a_switch_whose_module_cannot_load_says_so(monkeypatch):
    monkeypatch.setitem(kernel_switches.SWITCHES, "fused_combine", ("engram.no_such_module", "FLAG"))
    with pytest.raises(RuntimeError, match="kernel switch 'fused_combine' needs engram.no_such_module"):
        with kernel_switches.applied({"fused_combine": True}):
            pass
