"""Deferred lookups (engine/lookup.py): a layer after the first whose reads still run when the step is staged
is waited for only when the model reaches that layer; outputs are bitwise those of staging everything first,
and reads a failed forward never reached are cancelled."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.worker import Worker
from engram.model.loader import load_model
from tests.unit.test_worker import hand_built_step

CPU = torch.device("cpu")
CFG = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=8, max_model_len=128)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype=torch.float64, device=CPU, progress=False)


class SlowHandle:
    """A lookup still reading until ``wait``: ``done()`` is False; ``wait`` logs, then returns the rows (or
    raises ``fail``, once: a planted read error)."""

    def __init__(self, inner, layer_id: int, log: list, fail: BaseException | None = None):
        self.inner, self.layer_id, self.log, self.fail = inner, layer_id, log, fail
        self.cancelled = False

    def done(self) -> bool:
        return False

    def wait(self):
        self.log.append(f"wait {self.layer_id}")
        if self.fail is not None:
            raise self.fail
        return self.inner.wait()

    def cancel(self) -> bool:
        self.cancelled = True
        return self.inner.cancel()


class SlowTable:
    """A table whose lookups report themselves as still running (a disk read in flight)."""

    def __init__(self, table, layer_id: int, log: list):
        self._table, self.layer_id, self.log = table, layer_id, log
        self.handles: list[SlowHandle] = []
        self.fail_next: BaseException | None = None  # the next lookup's wait raises this

    def submit(self, ids, dtype=torch.bfloat16):
        self.log.append(f"submit {self.layer_id}")
        fail, self.fail_next = self.fail_next, None
        self.handles.append(SlowHandle(self._table.submit(ids, dtype=dtype), self.layer_id, self.log, fail))
        return self.handles[-1]

    def gather(self, ids, *args, **kwargs):  # a lookup on the caller's thread (the first Engram layer's)
        self.log.append(f"gather {self.layer_id}")
        return self._table.gather(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._table, name)


def worker_with_slow_tables(slow: tuple[int, ...], log: list) -> tuple[Worker, dict]:
    """A Worker over a model of its own (the hooks stay on it), the tables of ``slow`` layers slowed."""
    loaded = load_model("tiny", dtype=torch.float64, device=CPU, progress=False)
    tables = dict(loaded.open_tables())
    for lid in slow:
        tables[lid] = SlowTable(tables[lid], lid, log)
    worker = Worker(dataclasses.replace(loaded, tables=tables), CFG, 128, CPU, torch.float64)
    for i, layer in enumerate(worker.model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: log.append(f"layer {i}"))
    return worker, tables


def test_a_later_layer_waits_for_its_reads_when_the_model_reaches_it(tiny):
    prompt = tiny.tokenizer.encode("Deferred reads let the layers before them compute").ids
    step = hand_built_step(tiny, prompt, CFG.block_size)
    ref = Worker(tiny, CFG, 128, CPU, torch.float64).execute(step)
    log: list[str] = []
    worker, _ = worker_with_slow_tables((3,), log)
    got = worker.execute(step)
    assert got.token_ids == ref.token_ids and got.logprobs == ref.logprobs  # float64: same kernels, same bits
    # layer 3's rows are read inside layer 3, after layers 0-2 ran
    assert log.index("wait 3") > log.index("layer 2") and log.index("wait 3") > log.index("layer 3")


def test_the_first_engram_layer_is_read_on_the_calling_thread_and_never_deferred(tiny):
    """The model needs the first Engram layer's rows at once: its lookup runs on the caller's thread (no
    hand-off to its table's thread) and is never deferred; the later layers' lookups start once it has its
    rows (tables that read no disk never read together: lookup.reads_together)."""
    step = hand_built_step(tiny, [5, 6, 7, 8, 9], CFG.block_size)
    log: list[str] = []
    worker, tables = worker_with_slow_tables((1, 3), log)
    worker.execute(step)
    assert not tables[1].handles and len(tables[3].handles) == 1  # layer 1 gathered, layer 3 submitted
    assert log.index("gather 1") < log.index("submit 3") < log.index("layer 0") < log.index("wait 3")


def test_reads_a_failed_forward_never_reached_are_cancelled(tiny):
    step = hand_built_step(tiny, [5, 6, 7, 8, 9], CFG.block_size)
    log: list[str] = []
    worker, tables = worker_with_slow_tables((3,), log)

    def fail(module, args):
        raise RuntimeError("planted failure in layer 2")

    hook = worker.model.model.layers[2].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="planted failure in layer 2"):
        worker.execute(step)
    assert tables[3].handles[-1].cancelled and "wait 3" not in log
    hook.remove()
    ref = Worker(tiny, CFG, 128, CPU, torch.float64).execute(step)
    assert worker.execute(step).token_ids == ref.token_ids  # the worker serves the next step as before


def test_a_deferred_read_error_fails_its_step_and_the_engine_reruns_it(tiny):
    """The read of a deferred layer fails mid-forward: the step commits nothing, the engine re-runs its
    batch (the failure does not repeat) and every request ends with the tokens of a run without it."""
    from engram.engine.engine import LLMEngine
    from engram.engine.sampling_params import SamplingParams

    prompts = [tiny.tokenizer.encode(t).ids for t in ("Rows arrive late", "from the disk tier", "and the layers wait")]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=8, max_model_len=128)

    def generate(engine, fail_at: int | None = None, table=None) -> dict:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        out, step = {}, 0
        while engine.has_unfinished():
            if step == fail_at:
                table.fail_next = OSError("planted read error")
            out.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            step += 1
        return out

    ref = LLMEngine(tiny, cfg, CPU, torch.float64)
    want = generate(ref)
    log: list[str] = []
    loaded = load_model("tiny", dtype=torch.float64, device=CPU, progress=False)
    tables = dict(loaded.open_tables())
    tables[3] = SlowTable(tables[3], 3, log)
    engine = LLMEngine(dataclasses.replace(loaded, tables=tables), cfg, CPU, torch.float64)
    got = generate(engine, fail_at=2, table=tables[3])
    assert got == want and len(want) == 3
    assert sum(h.fail is not None for h in tables[3].handles) == 1  # one read was planted to fail ...
    assert engine.num_steps > ref.num_steps  # ... it did, inside the forward, and its batch ran again
