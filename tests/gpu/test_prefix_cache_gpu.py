"""Prefix caching on CUDA (skipped without a GPU): ``engram check`` of 4b-like in bf16 with the cache on against off.
With the cache a request computes only its uncached suffix, so its prefill chunks have other shapes than without it and
bf16 logits differ in the last bits: tokens must agree except at near-ties (engram check's policy), here a top-2 gap
below 0.1 nats (a few bf16 ulps of a logit of magnitude 4-8: random weights leave many such gaps). The serial probe,
whose requests run alone and find nothing cached, must be equal. The probes run in
one engine per arm: the concurrent probe's prompts are the serial probe's (cached whole) and the fixed-prefix probe's
start with the first of them, so with the cache on they start after cached blocks, CUDA graphs and async scheduling on."""
from __future__ import annotations

import json

import pytest
import torch

from engram.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_prefix_caching_agrees_with_it_off_on_4b_like_bf16(tmp_path):
    out = tmp_path / "check.json"
    code = main(["check", "4b-like", "--a", json.dumps({"dtype": "bfloat16"}),
                 "--b", json.dumps({"dtype": "bfloat16", "enable_prefix_caching": False}),
                 "--requests", "16", "--max-tokens", "32", "--prefix-tokens", "512", "--near-tie", "0.1",
                 "--json", str(out)])
    res = json.loads(out.read_text())["result"]
    assert code == 0 and res["verdict"] in ("equal", "equal up to near-ties"), res["verdict"]
    assert all(p["requests"] == 16 for p in res["probes"])
    serial = next(p for p in res["probes"] if p["probe"] == "serial")
    assert serial["equal"] == 16, serial
