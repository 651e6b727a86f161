"""pin_tensor without CUDA hands the same tensor back; argument checks hold everywhere."""
import pytest
import torch

from engram.store.pinning import pin_tensor, pinned_stats


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_pin_without_cuda_returns_same_tensor():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert pin_tensor(t) is t
    assert pinned_stats()["regions"] == 0


@pytest.mark.parametrize("kw", [{"chunk_bytes": 0}, {"chunk_bytes": 1000}, {"threads": 0}, {"method": "mlock"}])
def test_pin_rejects_bad_arguments(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        pin_tensor(torch.zeros(4), **kw)


def test_copy_chunks_copies_every_byte_with_a_short_last_chunk():
    from engram.store.pinning import _copy_chunks
    src = torch.randint(0, 256, (3 * 4096 + 123,), dtype=torch.uint8)  # 3 full chunks and a short one
    dst = torch.zeros_like(src)
    _copy_chunks(dst, src, chunk_bytes=4096, threads=3)
    assert torch.equal(dst, src)
