"""Programmatic dependent launch (engram/model/layers/pdl.py) on any machine: a capability check per device,
never on the CPU, on a CUDA device of compute capability 9.0 or newer (``_CAPABLE``, filled at the first
launch on a device). Its kernels: tests/gpu/test_pdl.py."""
from __future__ import annotations

import torch

from engram.model.layers import pdl


def test_never_on_the_cpu():
    assert not pdl.active(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}


def test_a_cuda_device_uses_it_where_its_capability_allows(monkeypatch):
    """What the device can do decides, per device index (no CUDA needed here: the capability is cached)."""
    monkeypatch.setitem(pdl._CAPABLE, 0, True)
    monkeypatch.setitem(pdl._CAPABLE, 1, False)
    assert pdl.active(torch.device("cuda", 0)) and not pdl.active(torch.device("cuda", 1))
    assert pdl.launch_options(torch.device("cuda", 0)) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_options(torch.device("cuda", 1)) == {"USE_PDL": False}
