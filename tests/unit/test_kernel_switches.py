"""engram.model.kernel_switches: named module flags set for a block and restored, refused when unknown."""
import pytest

from engram.model import kernel_switches
from engram.model.layers import pdl


def test_a_switch_is_set_inside_the_block_and_restored_after_even_on_error():
    before = pdl.ENABLED
    with kernel_switches.applied({"pdl": not before}):
        assert pdl.ENABLED is (not before)
    assert pdl.ENABLED is before
    with pytest.raises(KeyError):
        with kernel_switches.applied({"pdl": not before}):
            raise KeyError("boom")
    assert pdl.ENABLED is before


def test_unknown_names_and_non_bools_are_refused_before_anything_changes():
    known = ("known: \\['pdl', 'first_lookup_alone', 'together_when_deep', 'later_at_first_read', 'late_caching', "
             "'cublaslt', 'disk_decode_in_graph', 'background_lookups', 'early_host_ids', 'split_gemv'\\]")
    with pytest.raises(ValueError, match="unknown kernel switch 'pd'; " + known):
        with kernel_switches.applied({"pd": False}):
            pass  # entering the block is what raises
    with pytest.raises(ValueError, match="must be true or false"):
        kernel_switches.check({"pdl": "no"})


def test_a_switch_that_cannot_be_set_here_says_so_and_leaves_the_others_as_they_were(monkeypatch):
    import torch

    monkeypatch.setitem(kernel_switches.SWITCHES, "first_lookup_alone",
                        kernel_switches._module_flag("engram.no_such_module", "FLAG"))
    with pytest.raises(RuntimeError, match="kernel switch 'first_lookup_alone' needs engram.no_such_module"):
        with kernel_switches.applied({"first_lookup_alone": False}):
            pass  # entering the block is what raises
    before = pdl.ENABLED
    if not torch.cuda.is_available():  # a CPU build cannot choose cuBLASLt
        with pytest.raises(RuntimeError, match="kernel switch 'cublaslt' cannot choose the BLAS library"):
            with kernel_switches.applied({"pdl": not before, "cublaslt": True}):
                pass  # entering the block is what raises
        assert pdl.ENABLED is before  # the one set before the failure is restored
