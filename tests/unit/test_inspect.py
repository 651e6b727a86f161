"""`engram inspect`: layouts of every config name, the row ids of a text, table verification."""
import json

import pytest

from engram.cli import main
from engram.commands.inspect import layout_report
from engram.config import PRESETS, EngramConfig
from engram.commands.config_names import config_names, named_config
from engram.configs import shipped_config_path
from engram.hashing import NgramHasher


def test_inspect_v41_layout(capsys):
    assert main(["inspect", "--preset", "deepseek-v4.1-flash", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["layout"]
    assert r["total_rows"] == 768_022_850 and r["bytes_per_token"] == 2 * 24 * 264
    assert [l["prime_min"] for l in r["layers"]] == [16000057, 16000477]


def test_inspect_text_row_ids_match_hasher(capsys):
    assert main(["inspect", "--preset", "tiny", "--text", "Hello, Engram world", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["text"]
    import torch
    cfg = EngramConfig.preset("tiny")
    rows = NgramHasher(cfg, r["compressed_pad_id"]).hash(torch.tensor([r["compressed_ids"]]), 1)[0].tolist()
    assert r["rows"]["1"] == rows and len(rows) == len(r["tokens"])
    assert main(["inspect", "--preset", "tiny", "--text", "Hello"]) == 0
    assert "2-gram x4 | 3-gram x4" in capsys.readouterr().out


def test_inspect_text_pad_id_is_the_hashers(capsys):
    from engram.model.presets import TOKENIZER_FILE
    from engram.tokenizer import CompressedTokenizer

    assert main(["inspect", "--preset", "tiny", "--text", "a b", "--json"]) == 0
    pad = json.loads(capsys.readouterr().out)["text"]["compressed_pad_id"]
    assert pad == NgramHasher.from_tokenizer(EngramConfig.preset("tiny"),
                                             CompressedTokenizer.from_file(TOKENIZER_FILE)).pad_id


@pytest.mark.parametrize("name", config_names())
def test_inspect_takes_every_config_name(name, capsys):
    expect = EngramConfig.from_hf_config(named_config(name))
    if name in PRESETS:
        assert expect == EngramConfig.preset(name)
    for flag in ("--preset", "--config"):
        assert main(["inspect", flag, name, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["layout"] == layout_report(expect)


def test_inspect_config_file_and_unknown_names(capsys):
    assert main(["inspect", "--config", str(shipped_config_path("deepseek-v4.1-flash")), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == layout_report(EngramConfig.preset("deepseek-v4.1-flash"))
    assert main(["inspect", "--preset", "huge"]) == 2
    assert ("config name 'huge' is unknown; known: ['4b-like', '8b-like', 'deepseek-v4.1-flash',"
            in capsys.readouterr().err)
    assert main(["inspect", "--config", "huge.json"]) == 2
    assert "--config='huge.json': no such file or directory, and not a config name" in capsys.readouterr().err


def test_inspect_refuses_mismatched_tokenizer(capsys):
    assert main(["inspect", "--preset", "deepseek-v4.1-flash", "--text", "hi"]) == 2
    assert "silently rehashed" in capsys.readouterr().err


def test_inspect_verify_good_and_corrupt_tables(tmp_path, capsys):
    import torch

    from engram.quant import quantize_mxfp8
    from engram.store import write_table

    v, s = quantize_mxfp8(torch.randn(300, 64))
    d = tmp_path / "t"
    write_table(d, v, s)
    assert main(["inspect", "--verify", str(d), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    values = d / "values.bin"
    data = bytearray(values.read_bytes())
    data[5000] ^= 0xFF
    values.write_bytes(bytes(data))
    assert main(["inspect", "--verify", str(d), "--json"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["ok"] is False and "values.bin: byte 0: checksum mismatch" in out.err
