"""Engram liveness through the whole model: perturbing one table row changes the logits exactly from the
first position that looks that row up, and leaves every earlier position bitwise unchanged."""
from __future__ import annotations

import shutil

import pytest
import torch

from engram.model.loader import load_model
from tests.oracles.reference import engram_fields, prefill_logits
from engram.store import open_table, write_table
from engram.model.tables import read_table_tensors

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire."


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_perturbed_row_changes_logits_from_its_first_use(tmp_path, dtype):
    loaded = load_model("tiny", tier="host", dtype=dtype, device="cpu", cache_dir=tmp_path / "cache", progress=False)
    ids = loaded.tokenizer.encode(TEXT).ids
    layer = loaded.engram_config.layer_ids[-1]
    row_ids = engram_fields(loaded, ids, [], "cpu")["engram_rows"].row_ids[layer]  # [T, n_cols]
    p = len(ids) // 2
    target = int(row_ids[p, -1])  # an order-3 row first used at a middle position
    first = int(torch.nonzero((row_ids == target).any(dim=1))[0])
    assert 0 < first <= p
    before = prefill_logits(loaded, ids)

    values, scales = read_table_tensors(loaded.table_dirs[layer])
    values = values.clone()
    values[target] = (-values[target].float()).to(values.dtype)  # negated: a different row, still finite
    new_dir = tmp_path / "perturbed"
    write_table(new_dir, values, scales.view(torch.uint8), meta={"layer_id": layer,
                                               "fingerprint": loaded.engram_config.fingerprint(layer)})
    loaded.tables[layer] = open_table(new_dir, tier="host", device="cpu")
    after = prefill_logits(loaded, ids)

    assert torch.equal(before[:first].view(torch.uint8), after[:first].view(torch.uint8))
    assert not torch.equal(before[first], after[first])
    shutil.rmtree(new_dir)


def test_dead_tokens_zero_the_gate(tmp_path):
    """A DEAD token's Engram contribution is gated off: its own rows cannot change its logits."""
    loaded = load_model("tiny", tier="host", device="cpu", cache_dir=tmp_path / "cache", progress=False)
    ids = loaded.tokenizer.encode(TEXT).ids
    dead = ids[5]
    loaded.engram_config = loaded.engram_config.replace(dead_token_ids=(dead,))
    fields = engram_fields(loaded, ids, [], "cpu")
    assert bool(fields["dead_mask"][5]) and int(fields["dead_mask"].sum()) == ids.count(dead)
    base = prefill_logits(loaded, ids)
    for lid in list(loaded.tables):
        values, scales = read_table_tensors(loaded.table_dirs[lid])
        rows = fields["engram_rows"].row_ids[lid][5]  # the DEAD position's rows
        values = values.clone()
        values[rows] = (-values[rows].float()).to(values.dtype)  # still non-zero: only the gate can hide it
        d = tmp_path / f"perturbed{lid}"
        write_table(d, values, scales.view(torch.uint8), meta={"layer_id": lid})
        loaded.tables[lid] = open_table(d, tier="host", device="cpu")
    after = prefill_logits(loaded, ids)
    # rows of position 5 may be shared with later positions, so only position 5 itself is compared
    assert torch.equal(base[5].view(torch.uint8), after[5].view(torch.uint8))
    loaded.engram_config = loaded.engram_config.replace(dead_token_ids=())  # control: the DEAD handling is live
    assert not torch.equal(prefill_logits(loaded, ids)[5], base[5])
