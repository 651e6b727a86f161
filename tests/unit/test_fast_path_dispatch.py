"""Which fast path runs: attention and the fused small ops take the torch reference on the CPU (and for float64);
the C-extension switches (disk reader, CRC32C) follow whether the extension is built; the backend switches."""
from __future__ import annotations

import pytest
import torch

from engram.model.layers import paged_attention as pa


def test_cpu_and_float64_take_the_reference_and_triton_insists():
    q = torch.zeros(2, 4, 16)
    assert not pa.uses_triton(q) and not pa.uses_triton(q.double())
    old = pa.set_backend("triton")
    try:
        with pytest.raises(RuntimeError, match="cannot run torch.float32 queries on cpu"):
            pa.uses_triton(q)
    finally:
        pa.set_backend(old)


def test_fused_ops_take_the_reference_on_the_cpu_and_triton_insists():
    from engram.model.layers import fused

    x = torch.randn(3, 2, 8)
    assert not fused._fast(x)
    cos, sin = torch.ones(3, 1, 8), torch.zeros(3, 1, 8)
    assert torch.equal(fused.norm_rope(x, None, 1e-6, cos, sin), x)  # angle 0: rotation is the identity
    old = fused.set_backend("triton")
    try:
        with pytest.raises(RuntimeError, match="cannot run torch.float32 on cpu"):
            fused.rms_norm(x, torch.ones(8), 1e-6)
    finally:
        fused.set_backend(old)


def test_c_extension_switch_follows_availability(monkeypatch):
    """A switch with an ``available`` predicate (the C extension case: engram.store.reader / crc32c)."""
    import warnings

    from engram.fast_path import FastPathSwitch

    built = {"c": False}
    monkeypatch.setenv("ENGRAM_KERNELS", "reader=python")  # the initial choice of a switch named by its kernel
    sw = FastPathSwitch("thing backend", "reader", ("auto", "c", "python"), fast="c",
                        available=lambda: built["c"], missing="the C thing is not built",
                        fallback_warning="C thing missing, using Python")
    assert sw.value == "python" and sw.active() == "python"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not sw.use_fast()  # a forced reference does not warn
    with pytest.raises(RuntimeError, match="the C thing is not built"):
        sw.set("c")
    with pytest.raises(ValueError, match=r"thing backend 'triton' is not one of \('auto', 'c', 'python'\)"):
        sw.set("triton")
    assert sw.set("auto") == "python" and sw.active() == "python"
    with pytest.warns(RuntimeWarning, match="C thing missing"):
        assert not sw.use_fast()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not sw.use_fast()  # warned once per switch
    built["c"] = True
    assert sw.active() == "c" and sw.use_fast()
    assert sw.set("c") == "auto" and sw.active() == "c"
    assert sw.set("python") == "c" and sw.active() == "python" and not sw.use_fast()
    monkeypatch.setenv("ENGRAM_KERNELS", "reader=cuda")
    with pytest.raises(ValueError, match="thing backend 'cuda'"):  # the environment is checked like set()
        FastPathSwitch("thing backend", "reader", ("auto", "c", "python"), fast="c",
                       available=lambda: True)


def test_store_switches_report_the_c_extension():
    from engram.store import crc32c
    from engram.store import reader as rd

    assert rd.active_backend() == ("c" if rd.c_available() else "python")
    assert crc32c.implementation() in (("sse4.2", "table") if rd.c_available() else ("numpy",))
    old = rd.set_backend("python")
    try:
        assert rd.active_backend() == "python"
    finally:
        rd.set_backend(old)
    old = crc32c.set_backend("numpy")
    try:
        assert crc32c.implementation() == "numpy"
    finally:
        crc32c.set_backend(old)
    with pytest.raises(ValueError, match=r"reader backend 'torch' is not one of \('auto', 'c', 'python'\)"):
        rd.set_backend("torch")
    with pytest.raises(ValueError, match=r"crc32c backend 'python' is not one of \('auto', 'c', 'numpy'\)"):
        crc32c.set_backend("python")
