"""Programmatic dependent launch's switch (engram/model/layers/pdl.py) on any machine: off by default, never on
the CPU, a bad ENGRAM_PDL refused by name, the kernel switch flips it. Its kernels: tests/gpu/test_pdl.py."""
from __future__ import annotations

import pytest
import torch

from engram.model import kernel_switches
from engram.model.layers import pdl


def test_off_by_default_and_never_on_the_cpu(monkeypatch):
    monkeypatch.delenv("ENGRAM_PDL", raising=False)
    assert pdl._flag("ENGRAM_PDL") is False
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert not pdl.active(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}


def test_a_bad_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ENGRAM_PDL", "yes")
    with pytest.raises(ValueError, match="ENGRAM_PDL='yes': must be 0 or 1"):
        pdl._flag("ENGRAM_PDL")
    monkeypatch.setenv("ENGRAM_PDL", "1")
    assert pdl._flag("ENGRAM_PDL") is True


def test_the_kernel_switch_sets_and_restores_it():
    before = pdl.ENABLED
    with kernel_switches.applied({"pdl": not before}):
        assert pdl.ENABLED is (not before)
    assert pdl.ENABLED is before
