"""LLM(data_parallel_size=2) on the CPU (engine/data_parallel.py): greedy tokens in float64 equal one engine's, with
requests spread over both replicas, both mapping one shared copy of each host table (one replica created it, the
other mapped it, and the last out unlinked it); a request the engine would refuse is refused before any replica sees
it; a replica killed mid-generation is reported (ReplicaFailed naming it, its pid and exit code) within seconds,
the other replica is stopped, and every later call raises again."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import engram
from engram.engine.data_parallel import Placement, ReplicaFailed, plan_replicas
from engram.engine.config import EngineConfig

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["hello world", "the tables are", "a b c d e f", "memory is cheap", "one", "two three four",
           "ids hashed into rows", "gate it"]


def _llm(shm_dir: Path, **kw):
    return engram.LLM("tiny", device="cpu", dtype="float64", tier="host",
                      engram_config={"advanced": {"shm_dir": str(shm_dir)}}, **kw)


def _segments(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir() if not p.name.endswith(".lock"))


def test_two_replicas_give_one_engines_greedy_tokens_from_one_shared_copy(shm_dir):
    params = engram.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in _llm(shm_dir).generate(PROMPTS, params, use_tqdm=False)]
    assert _segments(shm_dir) == []  # one engine keeps private tables
    llm = _llm(shm_dir, data_parallel_size=2)
    try:
        infos = llm.engine.infos
        layers = len(llm.loaded.engram_config.layer_ids)
        assert sorted((i.shared["created"], i.shared["mapped"]) for i in infos) == [(0, layers), (layers, 0)]
        assert len(_segments(shm_dir)) == layers  # one packed segment a layer, for both replicas
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == one
        assert [o.prompt for o in outs] == PROMPTS
        stats = llm.engine.stats()
        assert [r["pid"] for r in stats["replicas"]] == llm.engine.pids
        per_replica = [s["steps"] for s in llm.engine.replica_stats]
        assert min(per_replica) > 0 and sum(per_replica) == stats["steps"]  # requests went to both
        for table in stats["tables"].values():  # the replicas' table counters add up (one lookup a step here)
            assert table["lookups"] == stats["steps"]
        assert len(llm.engine.step_trace()) == stats["steps"]
        assert llm.engine.reset_prefix_cache() >= 0
    finally:
        llm.engine.close()
    deadline = time.monotonic() + 30
    while _segments(shm_dir) and time.monotonic() < deadline:  # the last replica out unlinks them
        time.sleep(0.1)
    assert _segments(shm_dir) == []


def test_least_loaded_routing_and_requests_refused_before_any_replica(shm_dir):
    llm = _llm(shm_dir, data_parallel_size=2, max_model_len=64)
    try:
        eng = llm.engine
        p = engram.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for k in range(5):
            eng.add_request(f"r{k}", PROMPTS[k], p)
        assert eng.loads == [3, 2]  # ties to the lowest index: 0, 1, 0, 1, 0
        with pytest.raises(ValueError, match=r"request 'long': prompt of \d+ tokens leaves no room.*max_model_len=64"):
            eng.add_request("long", list(range(1, 65)), p)
        with pytest.raises(ValueError, match="already running"):
            eng.add_request("r0", "again", p)
        assert eng.abort_request("r1") and not eng.abort_request("r1")
        assert eng.loads == [3, 1]
        eng.add_request("r5", "next", p)
        assert eng.replica_of("r5") == 1
        while eng.has_unfinished():
            eng.step()
        assert eng.loads == [0, 0]
    finally:
        llm.engine.close()


def test_a_killed_replica_is_reported_and_the_others_stopped(shm_dir):
    llm = _llm(shm_dir, data_parallel_size=2)
    pids = llm.engine.pids
    params = engram.SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    caught: list[BaseException] = []

    def run() -> None:
        try:
            llm.generate(["a replica goes", "the other stays"], params, use_tqdm=False)
        except BaseException as e:
            caught.append(e)

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while not all(s and s["running"] for s in llm.engine.replica_stats) and time.monotonic() < deadline:
        time.sleep(0.05)  # both replicas are generating
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    t.join(60)
    assert not t.is_alive() and time.monotonic() - killed < 30
    assert len(caught) == 1 and isinstance(caught[0], ReplicaFailed), caught
    assert f"replica 1 (pid {pids[1]}, exit code -9)" in str(caught[0])
    with pytest.raises(ReplicaFailed, match="replica 1"):
        llm.engine.add_request("later", "x", params)
    for pid in pids:  # the other replica was stopped
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_placement_of_replicas(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert plan_replicas(EngineConfig(data_parallel_size=3), torch.device("cpu")) == [Placement(None, 0.9, False)] * 3
    cuda = torch.device("cuda")  # plans only: nothing touches a GPU
    assert plan_replicas(EngineConfig(data_parallel_size=2, tensor_parallel_size=2), cuda, gpus=4) == \
        [Placement("0,1", 0.9, False), Placement("2,3", 0.9, False)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert [p.visible_devices for p in plan_replicas(EngineConfig(data_parallel_size=2), cuda, gpus=2)] == ["3", "5"]
    shared = plan_replicas(EngineConfig(data_parallel_size=2, gpu_memory_utilization=0.8), cuda, gpus=1)
    assert [(p.visible_devices, round(p.gpu_memory_utilization, 6), p.after_previous) for p in shared] == \
        [(None, 0.4, False), (None, 0.8, True)]  # one GPU: in turn, each into its own half
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 needs 4 GPUs.*has 2"):
        plan_replicas(EngineConfig(data_parallel_size=2, tensor_parallel_size=2), cuda, gpus=2)


def test_two_replicas_of_two_tensor_parallel_ranks_share_each_ranks_shard(shm_dir):
    params = engram.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in _llm(shm_dir).generate(PROMPTS[:4], params, use_tqdm=False)]
    llm = _llm(shm_dir, data_parallel_size=2, tensor_parallel_size=2)
    try:
        layers = len(llm.loaded.engram_config.layer_ids)
        assert len(_segments(shm_dir)) == 2 * layers  # rank r's column shard of each layer, once for both replicas
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)] == one
    finally:
        llm.engine.close()


def test_a_step_a_replica_fails_fails_its_requests_only_and_serving_goes_on(tmp_path, shm_dir):
    """The disk tier (its resident scales and page checksums shared): every page of the first Engram layer's file goes
    bad, so the replica that runs the next request fails that step; the router raises StepError naming just that
    request; once the file is good again both replicas serve the tokens of a clean run."""
    from engram.engine.stepping import StepError
    from engram.store import read_manifest

    llm = engram.LLM("tiny", device="cpu", dtype="float64", tier="disk", cache_dir=str(tmp_path),
                     engram_config={"io": "buffered", "advanced": {"shm_dir": str(shm_dir)}}, data_parallel_size=2)
    try:
        assert sorted(p.rsplit("-", 1)[1] for p in _segments(shm_dir)) == ["page_crc"] * 2 + ["scales"] * 2
        params = engram.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
        values = read_manifest(llm.loaded.table_dirs[min(llm.loaded.table_dirs)]).values_path
        good = values.read_bytes()
        values.write_bytes(b"\0" * len(good))  # every page now fails its checksum
        eng = llm.engine
        eng.add_request("bad", PROMPTS[2], params)
        with pytest.raises(StepError) as err:
            while eng.has_unfinished():
                eng.step()
        assert err.value.request_ids == ["bad"] and "replica 0" in str(err.value)
        assert not eng.has_unfinished() and eng.loads == [0, 0]
        values.write_bytes(good)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)] == want
    finally:
        llm.engine.close()


def test_a_replica_that_cannot_start_fails_the_start_naming_why():
    with pytest.raises(ReplicaFailed, match=r"replica \d \(pid \d+, (exit code 1|still running)\) failed: it raised "
                                            r"engram.store.shared_host.SharedMemoryError: "
                                            r"engram_config.advanced.shm_dir='/no/such/dir'"):
        engram.LLM("tiny", device="cpu", tier="host", engram_config={"advanced": {"shm_dir": "/no/such/dir"}},
                   data_parallel_size=2)
