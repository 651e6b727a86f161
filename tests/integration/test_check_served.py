"""`engram check --served` against real `engram serve` processes (tiny, float32, CPU): servers on tiers host and disk
(and one with prompt prefetch and no row dedup) agree bitwise on the burst probe, whose step traces match; a server
whose checkpoint has one corrupted table row fails the check, naming the request, the position and both tokens with
their logprobs; bad arms exit 2 naming the option before any server starts."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engram.cli import build_parser, main
from engram.commands.check import prompt_texts
from engram.hashing import NgramHasher
from engram.model.loader import load_model, save_model

pytestmark = pytest.mark.timeout(300)

SMALL = ["--requests", "3", "--max-tokens", "5", "--threads", "1"]


def served_check(tmp_path, model: str, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "check.json"
    code = main(["check", model, "--served", *argv, *SMALL, "--json", str(out)])
    return code, json.loads(out.read_text())["result"] if out.exists() else {}


def test_host_disk_and_prefetch_servers_agree_bitwise(tmp_path, capsys):
    code, res = served_check(tmp_path, "tiny", "--a", '{"tier": "host"}', "--b", '{"tier": "disk"}',
                             "--c", '{"tier": "gpu", "prompt_prefetch": true, "dedup_rows": false}')
    out = capsys.readouterr().out
    assert code == 0 and res["verdict"] == "equal" and res["first_difference"] is None, out
    rows = {(p["arms"], p["probe"]): p for p in res["probes"]}
    assert set(rows) == {("a:b", "burst"), ("a:b", "concurrent"), ("a:c", "burst"), ("a:c", "concurrent")}
    for arms in ("a:b", "a:c"):
        burst = rows[arms, "burst"]
        assert burst["rule"] == "bitwise" and burst["batches"].startswith("same") and burst["equal"] == 3
        assert rows[arms, "concurrent"]["rule"] == "near-tie" and rows[arms, "concurrent"]["equal"] == 3
    assert len(res["requests"]) == 12 and {r["status"] for r in res["requests"]} == {"equal"}
    runs = res["arm_runs"]
    assert runs["b"]["argv"][:3] == ["tiny", "--tier", "disk"] and runs["a"]["served_model"] == "tiny"
    assert all(runs[n]["probes"]["burst"]["steps"] >= 5 for n in "abc")  # prefill, then one step per token
    assert len(set(res["prompts"]["prompt_tokens"])) > 1
    assert "burst       bitwise" in out and "equal: arm a (engram serve tiny --tier host --threads 1)" in out


def _corrupt_checkpoint(tmp_path) -> tuple[str, str, int, int]:
    """(good checkpoint, the same with one row corrupted, its layer, its row): the top-order row read where request
    0's first token is predicted, 64x larger and negated."""
    tiny = load_model("tiny", dtype="float32", device="cpu", progress=False)
    good = save_model(tmp_path / "good", tiny)
    ecfg, layer = tiny.engram_config, tiny.engram_config.layer_ids[-1]
    texts, _ = prompt_texts(build_parser().parse_args(["check", str(good), *SMALL]))
    prompt = tiny.tokenizer.encode(texts[0], add_special_tokens=False).ids  # what the served check sends
    hasher = NgramHasher.from_tokenizer(ecfg, tiny.compressed_tokenizer)
    row_ids = hasher.hash(torch.tensor([tiny.compressed_tokenizer.compress(prompt)]), layer)[0]  # [T, n_cols]
    target = int(row_ids[len(prompt) - 1, ecfg.n_cols - 1])
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    tensors = load_file(str(good / "model.safetensors"))
    values = tensors[f"model.layers.{layer}.engram.embed.weight"].clone()
    scales = tensors[f"model.layers.{layer}.engram.embed.scale"].view(torch.uint8).clone()
    values[target] = (-values[target].float()).to(values.dtype)
    scales[target] = (scales[target].int() + 6).clamp(max=254).to(torch.uint8)
    tensors[f"model.layers.{layer}.engram.embed.weight"] = values
    tensors[f"model.layers.{layer}.engram.embed.scale"] = scales.view(torch.float8_e8m0fnu)
    save_file(tensors, str(bad / "model.safetensors"))
    return str(good), str(bad), layer, target


def test_a_server_with_one_corrupted_row_fails_naming_the_position(tmp_path, capsys):
    good, bad, _, _ = _corrupt_checkpoint(tmp_path)
    code, res = served_check(tmp_path, good, "--a", '{"tier": "host"}',
                             "--b", json.dumps({"tier": "disk", "model": bad}), "--probes", "burst",
                             "--c", '{"max_num_batched_tokens": 16, "max_num_seqs": 2}')
    out = capsys.readouterr().out
    assert code == 1 and res["verdict"] == "diverged", out
    rows = {p["arms"]: p for p in res["probes"]}
    assert rows["a:b"]["diverged"] >= 1 and rows["a:b"]["rule"] == "bitwise"
    # other batches: the near-tie rule, which the good checkpoint passes
    assert rows["a:c"]["rule"] == "near-tie" and rows["a:c"]["batches"].startswith("differ at step 0")
    assert rows["a:c"]["equal"] + rows["a:c"]["near-ties"] == 3 and rows["a:c"]["why"] == "batches differ"
    first = next(r for r in res["requests"] if r["request"] == 0 and r["arms"] == "a:b")
    assert first["status"] == "diverged" and first["rule"] == "bitwise" and first["position"] == 0
    assert first["token_a"] != first["token_b"] and first["logprob_a"] != first["logprob_b"]
    want = (f"first difference: arms a:b, probe burst (bitwise), request 0, position 0: arm a token "
            f"{first['token_a']} (logprob {first['logprob_a']!r}), arm b token {first['token_b']} "
            f"(logprob {first['logprob_b']!r})")
    assert res["first_difference"] == want and want in out
    assert res["arm_runs"]["b"]["argv"][0] == bad


@pytest.mark.parametrize("argv,needle", [
    (["--served", "--b", '{"port": 9}'], "--b: 'port' is not an `engram serve` option"),
    (["--served", "--b", '{"max_num_seqs": 0}'], "--b: --max-num-seqs=0"),
    (["--served", "--b", '{"tier": "tape"}'], "--b: argument --tier: invalid choice: 'tape'"),
    (["--served", "--b", '{"enforce_eager": "yes"}'], "--b: enforce_eager='yes' must be true or false"),
    (["--served", "--b", '{"engram_config": {"seed": 1}}'], "engram_config.seed=1 differs from --a's 0"),
    (["--served", "--probes", "serial"], "with --served choose from ['burst', 'concurrent']"),
    (["--c", "{}"], "--c: a third arm needs --served"),
])
def test_bad_served_options_exit_2_naming_them(argv, needle, capsys):
    assert main(["check", "tiny", *argv, *SMALL]) == 2
    assert needle in capsys.readouterr().err


def _lp(tok: int, own: float, *top: tuple[int, float]):
    from engram.engine.step import TokenLogprobs

    return TokenLogprobs(tok, own, list(top) or [(tok, own)])


def test_the_bitwise_rule_names_the_first_position_where_any_bit_differs():
    import math

    from engram.bench.check import DIVERGED, EQUAL, compare_bitwise

    lps = [_lp(5, -1.0, (5, -1.0), (9, -2.0)), _lp(6, -0.5, (6, -0.5), (8, -0.75)), _lp(7, 0.0)]
    same = ([5, 6, 7], lps)
    assert compare_bitwise("burst", 0, 4, same, same).status == EQUAL
    ulp = [lps[0], _lp(6, math.nextafter(-0.5, 0.0), (6, math.nextafter(-0.5, 0.0)), (8, -0.75)), lps[2]]
    c = compare_bitwise("burst", 0, 4, same, ([5, 6, 7], ulp))  # same tokens, one logprob one ulp apart
    assert (c.status, c.position, c.token_a, c.token_b, c.logprob_a) == (DIVERGED, 1, 6, 6, -0.5)
    assert c.logprob_b == math.nextafter(-0.5, 0.0) and c.gap_a == 0.25
    top = [lps[0], _lp(6, -0.5, (6, -0.5), (3, -0.75)), lps[2]]  # another runner-up
    assert compare_bitwise("burst", 0, 4, same, ([5, 6, 7], top)).position == 1
    zero = [lps[0], lps[1], _lp(7, -0.0)]  # -0.0 is not 0.0
    assert compare_bitwise("burst", 0, 4, same, ([5, 6, 7], zero)).position == 2
    short = compare_bitwise("burst", 0, 4, same, ([5, 6], lps[:2]))
    assert (short.status, short.position, short.token_a, short.token_b) == (DIVERGED, 2, 7, None)
