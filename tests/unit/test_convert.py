"""`engram convert`: V4.1-named safetensors round trip, float sources, random tables, the CLI."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import engram
from engram.cli import main
from engram.quant import dequantize_mxfp8, quantize_mxfp8
from engram.store import open_table, read_manifest, verify_table
from engram.store.convert import convert_random, convert_safetensors

CFG = engram.EngramConfig(layer_ids=(1, 4), max_ngram_size=3, n_heads=2, head_dim=64, vocab_size=(101, 211),
                          compressed_vocab_size=50, pad_token_id=0, hidden_size=32)


def _bits(x):
    return x.contiguous().view(torch.uint8)


def _layer(rows, dim, seed):
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed))
    v, s = quantize_mxfp8(x)
    s[0, 0] = 0  # a zero scale byte, as seen in checkpoints
    return v, s


@pytest.fixture
def v41_checkpoint(tmp_path):
    """Two shards with the published names (one with the ``model.`` prefix) plus unrelated tensors."""
    w1, s1 = _layer(CFG.table_rows(1), 64, 1)
    w4, s4 = _layer(CFG.table_rows(4), 64, 4)
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_file({"layers.1.engram.embed.weight": w1, "layers.1.engram.embed.scale": s1.view(torch.float8_e8m0fnu),
               "layers.1.engram.q_weight": torch.zeros(2, 32, dtype=torch.bfloat16)}, ck / "model-00001.safetensors")
    save_file({"model.layers.4.engram.embed.weight": w4,
               "model.layers.4.engram.embed.scale": s4.view(torch.float8_e8m0fnu),
               "embed_tokens.weight": torch.zeros(4, 4)}, ck / "model-00002.safetensors")
    return ck, {1: (w1, s1), 4: (w4, s4)}


def test_v41_safetensors_round_trip(tmp_path, v41_checkpoint):
    ck, layers = v41_checkpoint
    out = tmp_path / "tables"
    ms = convert_safetensors([ck], out, config=CFG, progress=False, chunk_bytes=4096)
    assert [m.layer_id for m in ms] == [1, 4]
    for lid, (w, s) in layers.items():
        d = out / f"layer_{lid}"
        assert verify_table(d).ok
        m = read_manifest(d)
        assert m.fingerprint == CFG.fingerprint(lid) and m.meta["source_dtype"] == "F8_E4M3"
        with open_table(d, "host", device="cpu", expect=CFG.fingerprint(lid), cache_rows=32) as t:
            ids = torch.randint(0, m.rows, (200,), generator=torch.Generator().manual_seed(lid))
            ids[0] = 0
            ref = dequantize_mxfp8(w, s, torch.bfloat16)
            assert torch.equal(_bits(t.gather(ids)), _bits(ref[ids]))
            raw = t.gather_raw(ids)
            assert torch.equal(raw[:, :64], w.view(torch.uint8)[ids]) and torch.equal(raw[:, 64:], s[ids])


def test_convert_selected_layer_and_checks(tmp_path, v41_checkpoint):
    ck, _ = v41_checkpoint
    ms = convert_safetensors([ck / "model-00002.safetensors"], tmp_path / "o", progress=False)
    assert [m.layer_id for m in ms] == [4] and ms[0].fingerprint is None
    with pytest.raises(ValueError, match=r"layers \[7\] have no engram.embed tensors"):
        convert_safetensors([ck], tmp_path / "x", layers=[7], progress=False)
    small = CFG.replace(vocab_size=(103, 211))  # other primes: the tensor no longer fits the layout
    with pytest.raises(ValueError, match="layer 1: tensor is"):
        convert_safetensors([ck], tmp_path / "y", layers=[1], config=small, progress=False)
    assert not (tmp_path / "y" / "layer_1").exists()


def test_fp8_without_scale_refused(tmp_path):
    w, _ = _layer(64, 64, 0)
    save_file({"layers.2.engram.embed.weight": w}, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="F8_E4M3 but has no scale"):
        convert_safetensors([tmp_path / "a.safetensors"], tmp_path / "o", progress=False)


@pytest.mark.parametrize("dtype,quantize", [(torch.bfloat16, None), (torch.float32, None), (torch.float32, "mxfp8"),
                                            (torch.bfloat16, "mxfp8")])
def test_float_tables(tmp_path, dtype, quantize):
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    save_file({"layers.3.engram.embed.weight": x}, tmp_path / "f.safetensors")
    (m,) = convert_safetensors([tmp_path / "f.safetensors"], tmp_path / "o", quantize=quantize, progress=False)
    with open_table(m.path, "gpu", device="cpu") as t:
        got = t.gather(torch.arange(300), dtype=torch.float32)
    if quantize:
        assert m.row_dtype == "mxfp8" and m.meta["quantized"] == "mxfp8"
        want = dequantize_mxfp8(*quantize_mxfp8(x), dtype=torch.float32)
    else:
        assert m.row_dtype == {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
        want = x.to(torch.float32)
    assert torch.equal(_bits(got), _bits(want))


def test_random_tables_are_valid_and_deterministic(tmp_path):
    a = convert_random(tmp_path / "a", 3000, 256, seed=7, progress=False)
    b = convert_random(tmp_path / "b", 3000, 256, seed=7, progress=False)
    c = convert_random(tmp_path / "c", 3000, 256, seed=8, progress=False)
    va = (a.path / "values.bin").read_bytes()
    assert va == (b.path / "values.bin").read_bytes() and va != (c.path / "values.bin").read_bytes()
    v = torch.frombuffer(bytearray(va), dtype=torch.uint8)[: 3000 * 256]
    assert int(((v & 0x7F) == 0x7F).sum()) == 0  # no NaN encodings
    assert 120 < v.float().mean() < 135  # bytes spread over the whole range
    s = torch.frombuffer(bytearray((a.path / "scales.bin").read_bytes()), dtype=torch.uint8)
    assert int(s.min()) >= 118 and int(s.max()) <= 125 and s.unique().numel() == 8
    with open_table(a.path, "gpu", device="cpu") as t:
        rows = t.gather(torch.arange(3000), dtype=torch.float32)
    assert torch.isfinite(rows).all() and rows.std() > 0


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_random_float_tables(tmp_path, dtype):
    m = convert_random(tmp_path / "f", 100, 48, seed=1, row_dtype=dtype, progress=False)
    assert m.row_dtype == dtype and verify_table(m.path).ok


def test_cli_random_per_layer_and_single(tmp_path, capsys):
    assert main(["convert", "--random", "--config", "tiny", "--out", str(tmp_path / "t"), "--no-progress"]) == 0
    cfg = engram.EngramConfig.preset("tiny")
    for lid in cfg.layer_ids:
        m = read_manifest(tmp_path / "t" / f"layer_{lid}")
        assert (m.rows, m.dim, m.layer_id, m.fingerprint) == (cfg.table_rows(lid), cfg.head_dim, lid,
                                                              cfg.fingerprint(lid))
    assert main(["convert", "--random", "--rows", "1000", "--dim", "64", "--seed", "3", "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 0
    assert read_manifest(tmp_path / "r").rows == 1000
    assert '"rows": 1000' in capsys.readouterr().out


def test_cli_safetensors_and_tensor(tmp_path, v41_checkpoint, capsys):
    ck, layers = v41_checkpoint
    assert main(["convert", str(ck), "--out", str(tmp_path / "o"), "--layers", "4", "--no-progress"]) == 0
    assert read_manifest(tmp_path / "o" / "layer_4").rows == CFG.table_rows(4)
    x = torch.randn(10, 32)
    save_file({"my.table": x}, tmp_path / "x.safetensors")
    assert main(["convert", str(tmp_path / "x.safetensors"), "--tensor", "my.table", "--layer", "2",
                 "--out", str(tmp_path / "one"), "--no-progress"]) == 0
    m = read_manifest(tmp_path / "one")
    assert (m.row_dtype, m.layer_id) == ("fp32", 2)
    assert main(["convert", str(tmp_path / "x.safetensors"), "--tensor", "no.such", "--out", str(tmp_path / "two"),
                 "--no-progress"]) == 2
    assert "tensor 'no.such' is in none of" in capsys.readouterr().err and not (tmp_path / "two").exists()


def test_cli_errors_and_help(tmp_path, capsys):
    assert main(["convert", "--random", "--rows", "10", "--out", str(tmp_path / "r")]) == 2
    assert "--rows and --dim" in capsys.readouterr().err
    assert main(["convert", "--out", str(tmp_path / "r")]) == 2
    assert main(["convert", str(tmp_path / "missing"), "--out", str(tmp_path / "r")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["convert", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for needle in ("layers.L.engram.embed.weight", "F8_E8M0", "--quantize mxfp8", "--tensor", "--random", "--config"):
        assert needle in text
