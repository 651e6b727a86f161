"""`engram check`: identical arms pass, a planted table-row corruption is found and named, near-ties are
classified from the top-2 logprobs, bad options exit 2 naming the option (tiny model, float32, CPU)."""
from __future__ import annotations

import json

import pytest
import torch

from engram.bench.check import DIVERGED, EQUAL, NEAR_TIE, compare, make_probes
from engram.bench.corpus import LengthRange, generate_corpus, load_tokenizer, write_corpus
from engram.cli import build_parser, main
from engram.commands.check import prompt_texts
from engram.engine.step import TokenLogprobs
from engram.hashing import NgramHasher
from engram.model.loader import load_model
from engram.model.tables import read_table_tensors
from engram.store import write_table

SMALL = ["--requests", "3", "--max-tokens", "4", "--prefix-tokens", "64", "--threads", "1"]


def check(tmp_path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "check.json"
    code = main(["check", "tiny", *argv, *SMALL, "--json", str(out)])
    return code, json.loads(out.read_text())["result"] if out.exists() else {}


def test_tier_gpu_and_host_are_equal_on_every_probe(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(generate_corpus(4, 3, LengthRange(8, 40), LengthRange(1, 32), load_tokenizer("builtin")), corpus)
    code, res = check(tmp_path, "--a", '{"tier": "gpu", "dtype": "float32"}',
                      "--b", '{"tier": "host", "dtype": "float32", "max_num_batched_tokens": 16, "max_num_seqs": 2}',
                      "--corpus", str(corpus))
    assert code == 0 and res["verdict"] == "equal" and res["exit_code"] == 0
    assert [p["probe"] for p in res["probes"]] == ["serial", "concurrent", "fixed-prefix"]
    assert all(p["requests"] == 3 and p["equal"] == 3 for p in res["probes"])
    assert len(res["requests"]) == 9 and {r["status"] for r in res["requests"]} == {EQUAL}
    assert res["arms"]["a"]["tier"] == "gpu" and res["arms"]["b"]["tier"] == "host"
    assert res["prompts"]["corpus"] == str(corpus) and len(set(res["prompts"]["prompt_tokens"])) > 1


def test_a_corrupted_table_row_is_a_divergence_that_names_the_row(tmp_path):
    tiny = load_model("tiny", dtype="float32", device="cpu", progress=False)
    ecfg, layer = tiny.engram_config, tiny.engram_config.layer_ids[-1]
    texts, _ = prompt_texts(build_parser().parse_args(["check", "tiny", *SMALL]))
    prompt = tiny.tokenizer.encode(texts[0]).ids  # what the command sends as request 0
    hasher = NgramHasher.from_tokenizer(ecfg, tiny.compressed_tokenizer)
    row_ids = hasher.hash(torch.tensor([tiny.compressed_tokenizer.compress(prompt)]), layer)[0]  # [T, n_cols]
    last, col = len(prompt) - 1, ecfg.n_cols - 1
    target = int(row_ids[last, col])  # the top-order row read where request 0's first token is predicted

    values, scales = read_table_tensors(tiny.table_dirs[layer])
    values, scales = values.clone(), scales.view(torch.uint8).clone()
    values[target] = (-values[target].float()).to(values.dtype)
    scales[target] = (scales[target].int() + 6).clamp(max=254).to(torch.uint8)  # 64x larger and negated
    corrupt = tmp_path / "corrupt"
    write_table(corrupt, values, scales, meta={"layer_id": layer, "fingerprint": ecfg.fingerprint(layer)})

    code, res = check(tmp_path, "--a", '{"dtype": "float32"}',
                      "--b", json.dumps({"dtype": "float32", "table_dirs": {str(layer): str(corrupt)}}))
    assert code == 1 and res["verdict"] == "diverged"
    first = next(r for r in res["requests"] if r["probe"] == "serial" and r["request"] == 0)
    assert first["status"] == DIVERGED and first["prompt_tokens"] == len(prompt)
    assert first["token_a"] != first["token_b"] and min(first["gap_a"], first["gap_b"]) >= 1e-3
    rows = first["rows"]
    assert {"layer": layer, "position": last, "column": col, "row": target} in rows["rows"]
    assert rows["distinct"] == 1 and {(r["layer"], r["row"]) for r in rows["rows"]} == {(layer, target)}
    assert rows["compared"] == (len(prompt) + first["position"]) * ecfg.n_cols * len(ecfg.layer_ids)
    assert res["probes"][0]["diverged"] >= 1


def lp(*top: tuple[int, float]) -> TokenLogprobs:
    return TokenLogprobs(top[0][0], top[0][1], list(top))


def test_near_tie_rule_on_synthetic_logprobs():
    same = ([5, 6, 7], [lp((5, -1.0), (9, -2.0))] * 3)
    assert compare("serial", 0, 4, same, same, 1e-3).status == EQUAL
    a = ([5, 6, 7], [lp((5, -1.0), (1, -3.0)), lp((6, -1.0), (8, -1.0004)), lp((7, -1.0), (1, -2.0))])
    b = ([5, 8, 2], [lp((5, -1.0), (1, -3.0)), lp((8, -1.0), (6, -1.5)), lp((2, -1.0), (1, -2.0))])
    tie = compare("concurrent", 3, 4, a, b, 1e-3)  # arm a's gap 4e-4 < 1e-3: a near-tie
    assert (tie.status, tie.position, tie.token_a, tie.token_b) == (NEAR_TIE, 1, 6, 8)
    assert tie.gap_a == pytest.approx(4e-4, abs=1e-9) and tie.gap_b == pytest.approx(0.5)
    assert tie.logit_gap_a == pytest.approx(4e-4, abs=1e-9) and tie.logit_gap_b == pytest.approx(0.5)
    assert compare("concurrent", 3, 4, a, b, 4e-4 / 2).status == DIVERGED  # below the tolerance: real
    far = compare("serial", 1, 4, (a[0], [a[1][0], lp((6, -1.0), (3, -1.2)), a[1][2]]), b, 1e-3)
    assert far.status == DIVERGED and far.logit_gap_a is None  # token 8 is not in arm a's top-2
    short = compare("serial", 2, 4, ([5, 6], a[1][:2]), ([5, 6, 7], a[1]), 1.0)
    assert (short.status, short.position, short.token_a, short.token_b) == (DIVERGED, 2, None, 7)


def test_fixed_prefix_prompts_share_the_prefix_and_differ_after_it():
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    probes = {p.name: p.prompts for p in make_probes(prompts, ["serial", "fixed-prefix"], 5, 2)}
    assert probes["serial"] == prompts
    assert probes["fixed-prefix"] == [[1, 2, 3, 4, 5, 1, 2], [1, 2, 3, 4, 5, 5, 6], [1, 2, 3, 4, 5, 7, 8]]


@pytest.mark.parametrize("argv, named", [
    (["--a", '{"tierr": "gpu"}'], "--a: unknown key(s) ['tierr']"),
    (["--b", '{"engram_config": {"cache_rowz": 5}}'], "--b: engram_config has unknown key(s) ['cache_rowz']"),
    (["--b", '{"tier": "nvme"}'], "--b: tier='nvme'"),
    (["--a", '{"max_num_seqs": 0}'], "--a: engine.max_num_seqs=0"),
    (["--a", '{"table_dirs": {"1": "/nonexistent-dir"}}'], "--a: table_dirs['1']='/nonexistent-dir'"),
    (["--b", '{"engram_config": {"seed": 1}}'], "--b: engram_config.seed=1 differs"),
    (["--a", "[1]"], "--a: expected a JSON object"),
    (["--b", '{"device": "tpu:x"}'], "--b: device='tpu:x' is not a torch device"),
    (["--b", '{"engram_config": []}'], "--b: engram_config=[] must be a JSON object"),
    *([(["--a", '{"device": "cuda"}'], "--a: device='cuda': CUDA is not available")]
      if not torch.cuda.is_available() else []),
    (["--near-tie", "-1"], "--near-tie=-1.0"),
    (["--probes", "serial,bogus"], "--probes='serial,bogus'"),
    (["--prompt-tokens", "9:3"], "--prompt-tokens='9:3'"),
    (["--b", '{"max_model_len": 20}'], "--max-tokens=4: serial prompt 0 has 34 tokens"),  # loads, then refuses
])
def test_bad_options_exit_2_naming_the_option(tmp_path, capsys, argv, named):
    code, res = check(tmp_path, *argv)
    assert code == 2 and res == {}
    assert named in capsys.readouterr().err


def test_a_table_of_another_layer_is_refused_at_load(tmp_path, capsys):
    tiny = load_model("tiny", dtype="float32", device="cpu", progress=False)
    first, last = tiny.engram_config.layer_ids[0], tiny.engram_config.layer_ids[-1]
    spec = json.dumps({"table_dirs": {str(last): str(tiny.table_dirs[first])}})
    assert check(tmp_path, "--b", spec)[0] == 2
    assert f"--b: table_dirs[{last}]=" in capsys.readouterr().err
