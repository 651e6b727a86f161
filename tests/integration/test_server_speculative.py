"""A real ``engram serve --speculative-config`` (tiny, float64, CPU): completions, streamed and not, give the greedy
tokens of an engine without speculation, and ``/metrics`` and ``/engram/steps`` report the drafts verified and accepted."""
from __future__ import annotations

import json

import httpx

import engram
from engram.engine.sampling_params import SamplingParams
from engram.server.launcher import ServerProcess

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
PROMPT = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]  # its own continuation recurs: drafts are proposed


def test_server_with_speculation_gives_the_tokens_without(tmp_path):
    want = engram.LLM("tiny", dtype="float64", device="cpu").generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    server = ServerProcess(["tiny", "--device", "cpu", "--dtype", "float64", "--speculative-config", json.dumps(SPEC)],
                           None, tmp_path / "server.log")
    url = server.wait_ready().url
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "ignore_eos": True, "temperature": 0}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want.text
            streamed = ""
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        streamed += "".join(ch["text"] for ch in json.loads(line[6:])["choices"])
            assert streamed == want.text
            metrics = c.get("/metrics").text
            spec = c.get("/engram/steps").json()["stats"]["speculative"]
            assert spec["method"] == "ngram" and spec["draft_tokens"] >= 4, spec
            for name, key in (("num_draft_tokens", "draft_tokens"), ("num_accepted_tokens", "accepted_tokens")):
                value = [float(line.split()[-1]) for line in metrics.splitlines()
                         if line.startswith(f"engram_spec_decode_{name}_total")]
                assert value == [spec[key]], (name, value, spec)
    finally:
        server.stop()
