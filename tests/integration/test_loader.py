"""load_model / save_model: presets, checkpoint round trips and the errors a bad checkpoint must give."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engram.model.loader import load_model, save_model
from tests.oracles.reference import greedy_generate, prefill_logits
from engram.model.tables import read_table_tensors
from engram.store import write_table
from engram.store.format import MANIFEST

PROMPT = "Return the number of items in a container."


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("engram-cache")


@pytest.fixture(scope="module")
def tiny(cache_dir):
    return load_model("tiny", tier="host", device="cpu", cache_dir=cache_dir, progress=False)


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):
    return save_model(tmp_path_factory.mktemp("ckpt") / "tiny-ckpt", tiny)


def _ids(loaded):
    return loaded.tokenizer.encode(PROMPT).ids


def test_tiny_preset_fields_and_cache_reuse(tiny, cache_dir):
    assert tiny.name == "tiny" and tiny.dtype == torch.float32 and tiny.device.type == "cpu"
    assert tiny.model_config.hc_mult == 2 and sorted(tiny.open_tables()) == [1, 3]
    assert len(tiny.compressed_tokenizer) == tiny.engram_config.compressed_vocab_size
    assert tiny.eos_token_id == tiny.tokenizer.token_to_id("<|eos|>") and "<|assistant|>" in tiny.chat_template
    manifests = {l: (d / MANIFEST).stat().st_mtime_ns for l, d in tiny.table_dirs.items()}
    again = load_model("tiny", tier="host", device="cpu", cache_dir=cache_dir, progress=False)
    assert again.table_dirs == tiny.table_dirs
    assert {l: (d / MANIFEST).stat().st_mtime_ns for l, d in again.table_dirs.items()} == manifests  # reused
    ids = _ids(tiny)
    assert torch.equal(prefill_logits(again, ids), prefill_logits(tiny, ids))  # deterministic weights


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path))
    loaded = load_model("tiny", tier="host", device="cpu", progress=False)
    assert all(str(d).startswith(str(tmp_path)) for d in loaded.table_dirs.values())


def test_save_load_identical_logits(tiny, checkpoint, cache_dir):
    back = load_model(checkpoint, tier="host", device="cpu", cache_dir=cache_dir, progress=False)
    assert back.model_config.replace(name="tiny", init_seed=0) == tiny.model_config
    assert back.chat_template == tiny.chat_template and back.eos_token_id == tiny.eos_token_id
    ids = _ids(tiny)
    a, b = prefill_logits(tiny, ids), prefill_logits(back, ids)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert greedy_generate(back, ids, 6) == greedy_generate(tiny, ids, 6)
    for lid in tiny.open_tables():  # the converted table has the same bytes
        ids_all = torch.arange(tiny.tables[lid].rows)
        assert torch.equal(back.open_tables()[lid].gather_raw(ids_all), tiny.tables[lid].gather_raw(ids_all))


def _rewrite(src, dst, edit):
    """Copy checkpoint ``src`` to ``dst`` with its tensors passed through ``edit(dict) -> dict``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def test_hf_names_without_model_prefix_and_fp8_wkv(tiny, checkpoint, tmp_path, cache_dir):
    def edit(sd):
        out = {}
        for k, v in sd.items():
            k = k[len("model."):] if k.startswith("model.") else k
            if k.endswith("engram.wkv.weight"):  # FP8 with 32x32 power-of-two block scales, as V4.1 ships it
                out[k] = v.to(torch.float8_e4m3fn)
                out[k.replace("weight", "scale")] = torch.full((-(-v.shape[0] // 32), -(-v.shape[1] // 32)), 127,
                                                               dtype=torch.uint8).view(torch.float8_e8m0fnu)
            else:
                out[k] = v
        return out

    back = load_model(_rewrite(checkpoint, tmp_path / "c", edit), tier="host", device="cpu", cache_dir=cache_dir,
                      progress=False)
    w = back.model.model.layers[1].engram.wkv.weight
    assert torch.equal(w, tiny.model.model.layers[1].engram.wkv.weight.to(torch.float8_e4m3fn).float())
    assert torch.equal(back.model.model.layers[0].mlp.up_proj.weight, tiny.model.model.layers[0].mlp.up_proj.weight)


@pytest.mark.parametrize("edit, message", [
    (lambda sd: {k: v for k, v in sd.items() if k != "model.layers.2.mlp.up_proj.weight"},
     "missing tensors: \\['model.layers.2.mlp.up_proj.weight'\\]"),
    (lambda sd: {**sd, "model.layers.0.self_attn.q_proj.weight": torch.zeros(3, 64)},
     r"'model.layers.0.self_attn.q_proj.weight' has shape \[3, 64\], expected \[64, 64\]"),
    (lambda sd: {**sd, "model.layers.0.extra.weight": torch.zeros(2)}, "unexpected tensors.*model.layers.0.extra"),
    (lambda sd: {**sd, "model.layers.1.engram.k_weight": torch.zeros(2, 63)}, r"k_weight has shape \(2, 63\)"),
    (lambda sd: {k: v for k, v in sd.items() if k != "model.layers.3.engram.embed.weight"},
     "layer 3 has an engram.embed.scale but no engram.embed.weight"),
    (lambda sd: {k: v for k, v in sd.items() if not k.startswith("model.layers.3.engram.embed")},
     r"layers \[3\] have no engram.embed tensors"),
    (lambda sd: {**sd, "model.layers.1.engram.embed.scale": sd["model.layers.1.engram.embed.scale"][:-1]},
     r"model.layers.1.engram.embed.scale is F8_E8M0 \[10169, 1\], expected F8_E8M0 \[10170, 1\]"),
    (lambda sd: {**sd, "model.layers.1.engram.embed.weight": sd["model.layers.1.engram.embed.weight"][:-1]},
     r"layer 1: tensor is \[10169, 32\] but the config's layout needs \[10170, 32\]"),
])
def test_bad_checkpoints_name_the_tensor(checkpoint, tmp_path, edit, message):
    bad = _rewrite(checkpoint, tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        load_model(bad, tier="host", device="cpu", cache_dir=tmp_path / "cache", progress=False)


def test_pickled_weights_are_refused(checkpoint, tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (d / name).write_bytes((checkpoint / name).read_bytes())
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="pytorch_model.bin.*Convert them to safetensors"):
        load_model(d, device="cpu", cache_dir=tmp_path / "cache", progress=False)
    with pytest.raises(ValueError, match="convert it to safetensors"):
        load_model(d / "pytorch_model.bin", device="cpu", cache_dir=tmp_path / "cache", progress=False)


def test_config_and_option_errors(checkpoint, tmp_path):
    d = _rewrite(checkpoint, tmp_path / "cfg", lambda sd: sd)
    raw = json.loads((d / "config.json").read_text())
    del raw["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="'num_hidden_layers' is required"):
        load_model(d, device="cpu", cache_dir=tmp_path / "cache", progress=False)
    (d / "config.json").write_text("{\"hidden_size\": 64,")
    with pytest.raises(ValueError, match="config.json: not valid JSON at line 1"):
        load_model(d, device="cpu", cache_dir=tmp_path / "cache", progress=False)
    (d / "config.json").write_text(json.dumps(raw | {"num_hidden_layers": 4}))
    (d / "tokenizer_config.json").write_text("[]")
    with pytest.raises(ValueError, match="tokenizer_config.json: expected a JSON object, found list"):
        load_model(d, device="cpu", cache_dir=tmp_path / "cache", progress=False)
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(tmp_path / "nope", device="cpu")
    with pytest.raises(ValueError, match="dtype='int8'"):
        load_model("tiny", dtype="int8", device="cpu")
    with pytest.raises(ValueError, match="table_rows applies to 4b-like"):
        load_model("tiny", device="cpu", engram_config={"table_rows": 1000}, cache_dir=tmp_path / "cache")


def test_float64_and_cpu_offload_option(cache_dir):
    loaded = load_model("tiny", dtype="float64", device="cpu", engram_config={"cpu_offload": True},
                        cache_dir=cache_dir, progress=False)
    assert loaded.model.lm_head.weight.dtype == torch.float64
    assert all(t.__class__.__name__ == "HostTable" for t in loaded.open_tables().values())
    assert prefill_logits(loaded, _ids(loaded)).dtype == torch.float32


def test_small_preset_runs_on_cpu(cache_dir):
    loaded = load_model("small", tier="host", device="cpu", cache_dir=cache_dir, progress=False)
    assert sorted(loaded.open_tables()) == [1, 6] and loaded.model_config.hc_mult == 2
    logits = prefill_logits(loaded, _ids(loaded)[:8])
    assert logits.shape == (8, 4096) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_read_table_tensors_returns_what_was_written(tmp_path, dtype):
    """save_model's table reader gives back the written values (and E8M0 scales) bitwise, for every row dtype;
    48 rows of 40 dims: fp32 rows (160 B) are padded to a 256 B stride that must be cut off."""
    g = torch.Generator().manual_seed(0)
    dim = 64 if dtype == torch.float8_e4m3fn else 40
    values = (torch.randn(48, dim, generator=g) * 4).to(dtype)
    scales = torch.randint(110, 130, (48, dim // 32), generator=g, dtype=torch.uint8) if dtype.itemsize == 1 else None
    write_table(tmp_path / "t", values, scales)
    got_v, got_s = read_table_tensors(tmp_path / "t")
    assert got_v.dtype == dtype and torch.equal(got_v.view(torch.uint8), values.view(torch.uint8))
    if scales is None:
        assert got_s is None
    else:
        assert got_s.dtype == torch.float8_e8m0fnu and torch.equal(got_s.view(torch.uint8), scales)
