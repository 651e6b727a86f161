"""Programmatic dependent launch's switch (engram/model/layers/pdl.py) on any machine: on by default, off with
ENGRAM_PDL=0, never on the CPU, a bad ENGRAM_PDL refused by name, the kernel switch flips it. Its kernels:
tests/gpu/test_pdl.py."""
from __future__ import annotations

import importlib

import pytest
import torch

from engram.fast_path import env_flag
from engram.model import kernel_switches
from engram.model.layers import pdl


@pytest.fixture
def reload_pdl():
    """Reloads pdl under the test's environment; reloads it again afterwards, under the restored one."""
    yield lambda: importlib.reload(pdl)
    importlib.reload(pdl)


def test_on_by_default_off_with_zero_and_never_on_the_cpu(monkeypatch, reload_pdl):
    monkeypatch.delenv("ENGRAM_PDL", raising=False)
    assert reload_pdl().ENABLED is True
    assert not pdl.active(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setenv("ENGRAM_PDL", "0")
    assert reload_pdl().ENABLED is False


def test_a_bad_value_is_refused_by_name(monkeypatch, reload_pdl):
    monkeypatch.setenv("ENGRAM_PDL", "yes")
    with pytest.raises(ValueError, match="ENGRAM_PDL='yes': must be 0 or 1"):
        reload_pdl()
    monkeypatch.setenv("ENGRAM_PDL", "1")
    assert env_flag("ENGRAM_PDL", default=False) is True


def test_the_kernel_switch_sets_and_restores_it():
    before = pdl.ENABLED
    with kernel_switches.applied({"pdl": not before}):
        assert pdl.ENABLED is (not before)
    assert pdl.ENABLED is before
