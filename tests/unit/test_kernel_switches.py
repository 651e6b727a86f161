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
    known = "known: \\['fused_combine', 'l2_prefetch', 'pdl', 'first_lookup_alone', 'cublaslt'\\]"
    with pytest.raises(ValueError, match="unknown kernel switch 'l2'; " + known):
        with kernel_switches.applied({"l2": True}):
            pass  # entering the block is what raises
    with pytest.raises(ValueError, match="must be true or false"):
        kernel_switches.check({"fused_combine": "yes"})


def test_a_switch_that_cannot_be_set_here_says_so_and_leaves_the_others_as_they_were(monkeypatch):
    import torch

    monkeypatch.setitem(kernel_switches.SWITCHES, "fused_combine",
                        kernel_switches._module_flag("engram.no_such_module", "FLAG"))
    with pytest.raises(RuntimeError, match="kernel switch 'fused_combine' needs engram.no_such_module"):
        with kernel_switches.applied({"fused_combine": True}):
            pass  # entering the block is what raises
    before = l2_prefetch.ENABLED
    if not torch.cuda.is_available():  # a CPU build cannot choose cuBLASLt
        with pytest.raises(RuntimeError, match="kernel switch 'cublaslt' cannot choose the BLAS library"):
            with kernel_switches.applied({"l2_prefetch": not before, "cublaslt": True}):
                pass  # entering the block is what raises
        assert l2_prefetch.ENABLED is before  # the one set before the failure is restored
