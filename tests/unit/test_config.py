import json

import pytest

from engram.config import EngramConfig, is_prime

V41_LAYER1_PRIMES = [16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183, 16000189,
                     16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321, 16000339, 16000381,
                     16000393, 16000399, 16000403, 16000409, 16000447, 16000463]


def test_v41_primes_rows_and_multipliers_match_published_layout():
    cfg = EngramConfig.preset("deepseek-v4.1-flash")
    assert cfg.n_cols == 24 and cfg.orders == (2, 3, 4)
    assert cfg.primes(1) == V41_LAYER1_PRIMES
    p14 = cfg.primes(14)
    assert p14[0] == 16000477 and p14[-1] == 16000889 and len(p14) == 24
    assert sum(cfg.primes(1)) == 384006168 and sum(p14) == 384016682
    assert cfg.table_rows(1) == 384006168 and cfg.table_rows(14) == 384016682
    assert cfg.multipliers(1) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert cfg.multipliers(14) == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    assert cfg.row_bytes == 264
    total = sum(cfg.table_bytes(l) for l in cfg.layer_ids)
    assert total == 768_022_850 * 264
    assert cfg.column_offsets(1)[:3] == [0, 16000057, 16000057 + 16000079]


def test_primes_are_unique_across_layers_and_each_order_restarts_at_its_base():
    cfg = EngramConfig.preset("tiny").replace(vocab_size=(100, 50))
    all_p = [p for l in cfg.layer_ids for p in cfg.primes(l)]
    assert len(all_p) == len(set(all_p)) and all(is_prime(p) for p in all_p)
    first = cfg.primes(cfg.layer_ids[0])
    assert first[: cfg.n_heads] == [101, 103, 107, 109]
    assert first[cfg.n_heads:] == [53, 59, 61, 67]


def test_miller_rabin_against_trial_division():
    def slow(n):
        return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))
    assert [n for n in range(3000) if is_prime(n)] == [n for n in range(3000) if slow(n)]
    assert is_prime(2**61 - 1) and not is_prime(3215031751)  # strong pseudoprime to bases 2,3,5,7


@pytest.mark.parametrize("change,field", [
    (dict(layer_ids=(3, 1)), "layer_ids"),
    (dict(layer_ids=(1, 1)), "layer_ids"),
    (dict(layer_ids=(-1, 2)), "layer_ids"),
    (dict(layer_ids=()), "layer_ids"),
    (dict(head_dim=48), "head_dim"),
    (dict(vocab_size=(1009, 1511, 2003)), "vocab_size"),
    (dict(num_embeddings=(10, 10)), "num_embeddings"),
    (dict(num_embeddings=(10**6,)), "num_embeddings"),
    (dict(variant="v5"), "variant"),
    (dict(row_dtype="int4"), "row_dtype"),
    (dict(max_ngram_size=1), "max_ngram_size"),
    (dict(n_heads=0), "n_heads"),
])
def test_validation_names_field_and_value(change, field):
    with pytest.raises(ValueError, match=f"engram.{field}="):
        EngramConfig.preset("tiny").replace(**change)


def test_head_dim_need_not_be_multiple_of_32_for_float_rows():
    cfg = EngramConfig.preset("tiny").replace(head_dim=48, row_dtype="bf16")
    assert cfg.row_bytes == 96


def test_from_hf_config_flat_nested_path_and_aliases(tmp_path):
    fields = EngramConfig.preset("deepseek-v4.1-flash").to_hf_fields()
    flat = EngramConfig.from_hf_config(fields)
    assert flat == EngramConfig.preset("deepseek-v4.1-flash")
    nested = {"model_type": "x", "text_config": dict(fields)}
    nested["text_config"]["engram_pad_id"] = nested["text_config"].pop("engram_pad_token_id")
    assert EngramConfig.from_hf_config(nested) == flat
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert EngramConfig.from_hf_config(tmp_path) == flat
    assert EngramConfig.from_hf_config(tmp_path / "config.json") == flat


def test_from_hf_config_defaults_and_missing_fields():
    minimal = {"engram_layer_ids": [2], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_head_dim": 32,
               "engram_vocab_size": [101, 211], "engram_compressed_vocab_size": 50, "engram_pad_id": 1,
               "hidden_size": 16, "image_token_id": 9}
    cfg = EngramConfig.from_hf_config(minimal)
    assert (cfg.hc_mult, cfg.rms_norm_eps, cfg.seed, cfg.variant) == (1, 1e-6, 0, "v41")
    assert cfg.dead_token_ids == (9,) and cfg.vocab_size == (101, 211)
    del minimal["engram_head_dim"]
    with pytest.raises(ValueError, match="engram_head_dim"):
        EngramConfig.from_hf_config(minimal)
    with pytest.raises(ValueError, match="engram_layer_ids"):
        EngramConfig.from_hf_config({"hidden_size": 3})


def test_unknown_layer_and_preset():
    cfg = EngramConfig.preset("tiny")
    with pytest.raises(ValueError, match="not an Engram layer"):
        cfg.primes(2)
    with pytest.raises(ValueError, match="unknown Engram preset"):
        EngramConfig.preset("nope")


def test_paper_demo_preset():
    cfg = EngramConfig.preset("paper-demo")
    assert cfg.variant == "paper" and cfg.head_dim == 64 and cfg.n_cols == 16 and cfg.layer_ids == (1, 15)
    assert min(cfg.primes(1)) >= 129280 * 5
