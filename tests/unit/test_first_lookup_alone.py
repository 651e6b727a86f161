"""The order of a step's lookups (engram/engine/lookup.py): over host-read tables the first Engram layer's lookup
runs alone and the later layers' are submitted once it has its rows, unless the first layer's row ids fill its
table's read queue (``reads_together``): then the later layers' are submitted with it. Either way the tokens
are the same (real disk tables, CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import engram
from engram.engine import lookup
from engram.engine.sampling_params import SamplingParams


class Recording:
    """A table wrapper that records the order of gathers, submits and the ends of gathers."""

    def __init__(self, table, lid: int, log: list):
        self._t, self._lid, self._log = table, lid, log

    def __getattr__(self, name):
        return getattr(self._t, name)

    def gather(self, *a, **k):
        self._log.append(("gather", self._lid))
        try:
            return self._t.gather(*a, **k)
        finally:
            self._log.append(("gathered", self._lid))

    def submit(self, *a, **k):
        self._log.append(("submit", self._lid))
        return self._t.submit(*a, **k)


# read queue depths: deeper than any step's ids (every step's first lookup alone), or one id (every step's
# lookups together: the later layers' submitted at the first layer's first read, or before it without one)
ALONE, TOGETHER = 1024, 1


def generate(tmp_path, alone: bool, log: list | None = None):
    llm = engram.LLM("tiny", tier="disk", dtype=torch.float32, cache_dir=str(tmp_path), max_num_seqs=4,
                     engram_config={"queue_depth": ALONE if alone else TOGETHER})
    worker = llm.engine.executor.worker
    if log is not None:
        worker.lookup.tables = {lid: Recording(t, lid, log) for lid, t in worker.lookup.tables.items()}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [[5 + i, 17, 99, 4 + 3 * i, 8] * (1 + i) for i in range(3)]
    return [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("alone", [False, True], ids=["together", "alone"])
def test_the_order_of_a_steps_lookups(tmp_path, alone):
    log: list = []
    generate(tmp_path, alone, log)
    first, later = 1, 3  # the tiny preset's Engram layers
    step = log[:3]  # the first step: one gather (first layer) and one submit (the later layer)
    if alone:
        assert step == [("gather", first), ("gathered", first), ("submit", later)]
    else:
        assert step == [("submit", later), ("gather", first), ("gathered", first)]
    assert log.count(("gather", first)) == log.count(("submit", later)) > 1


def test_over_the_disk_tier_the_first_lookup_waits_for_its_layer(tmp_path):
    """The first Engram layer's lookup runs when the model reaches that layer (after layer 0 ran), then the
    later layer's is submitted; every step, prefill and decode (none fills the read queue)."""
    log: list = []
    llm = engram.LLM("tiny", tier="disk", dtype=torch.float32, cache_dir=str(tmp_path), max_num_seqs=4,
                     enforce_eager=True,  # the hooks below see eager layers (tests/gpu: the graph pieces' order)
                     engram_config={"queue_depth": ALONE})
    worker = llm.engine.executor.worker
    worker.lookup.tables = {lid: Recording(t, lid, log) for lid, t in worker.lookup.tables.items()}
    for i in (0, 1):
        worker.model.model.layers[i].register_forward_pre_hook(lambda m, a, i=i: log.append(("layer", i)))
    llm.generate([[5, 17, 99, 4, 8]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    steps = [log[k:k + 5] for k in range(0, len(log), 5)]
    assert len(steps) == 4 and len(log) == 20
    for step in steps:
        assert step == [("layer", 0), ("layer", 1), ("gather", 1), ("gathered", 1), ("submit", 3)]


def test_the_tokens_do_not_depend_on_the_order(tmp_path):
    assert generate(tmp_path, True) == generate(tmp_path, False)


def submit_later_logged(log: list):
    """A chain's ``submit_later``: logs "submit 3" and gives layer 3 a handle whose cancel logs "cancel 3"."""
    from engram.store.base import CompletedLookup

    class Handle(CompletedLookup):
        def cancel(self) -> bool:
            log.append("cancel 3")
            return True

    def later():
        log.append("submit 3")
        return {3: Handle("rows 3")}

    return later


def test_a_chain_submits_the_later_lookups_after_the_first():
    """ChainedLookups (the disk tier's lookups, run when the model reaches the first Engram layer): the first
    layer's lookup runs on the waiting thread and the later layers' are submitted after it; when the first
    lookup fails, nothing later is submitted and every waiter gets the error."""
    log: list = []
    later = submit_later_logged(log)

    def first():
        log.append("first 1")
        return "rows 1"

    chain = lookup.ChainedLookups(1, first, later)
    assert chain.handle(3).wait() == "rows 3" and chain.handle(1).wait() == "rows 1"
    assert log == ["first 1", "submit 3"]

    def failing():
        raise OSError("planted read failure")

    log.clear()
    chain = lookup.ChainedLookups(1, failing, later)
    for lid in (1, 3):
        with pytest.raises(OSError, match="planted"):
            chain.handle(lid).wait()
    assert log == []


@pytest.mark.parametrize("case", ["reads", "reads nothing", "fails after its read", "fails before"])
def test_a_chain_can_submit_the_later_lookups_at_the_first_lookups_first_read(tmp_path, case):
    """ChainedLookups with ``later_first`` (a step whose reads go together): the first layer's lookup plans
    first, the later layers' are
    submitted right before its first read (a real reader's read; the thread's earlier read-start hook runs
    after them and is restored after), or after it when it read nothing; a failure after the submits cancels
    them, and one before any read submits nothing."""
    from engram.store import reader

    (tmp_path / "v.bin").write_bytes(bytes(range(256)) * 64)
    pages = reader.PageReader(tmp_path / "v.bin", io="buffered", queue_depth=4)
    log: list = []
    later = submit_later_logged(log)

    def first():
        log.append("plan 1")
        if case == "fails before":
            raise OSError("planted failure before the read")
        if case != "reads nothing":
            pages.read(np.array([0, 4096], dtype=np.int64), reader.aligned_pages(2))
            log.append("read 1")
        if case == "fails after its read":
            raise OSError("planted failure after the read")
        return "rows 1"

    issued = lambda: log.append("issued")  # noqa: E731 - the thread's hook before (step_lookups')
    reader.on_read_start(issued)
    try:
        chain = lookup.ChainedLookups(1, first, later, later_first=True)
        if case.startswith("fails"):
            with pytest.raises(OSError, match="planted"):
                chain.handle(1).wait()
        else:
            assert chain.handle(3).wait() == "rows 3" and chain.handle(1).wait() == "rows 1"
        assert reader.on_read_start(None) is issued  # restored
    finally:
        reader.on_read_start(None)
        pages.close()
    assert log == {"reads": ["plan 1", "submit 3", "issued", "read 1"],
                   "reads nothing": ["plan 1", "submit 3"],
                   "fails after its read": ["plan 1", "submit 3", "issued", "read 1", "cancel 3"],
                   "fails before": ["plan 1"]}[case]


class Counting(Recording):
    """``Recording`` that also notes how many row ids each gather and submit got."""

    def gather(self, ids, *a, **k):
        self._log.append(("n", ids.numel()))
        return super().gather(ids, *a, **k)

    def submit(self, ids, *a, **k):
        self._log.append(("n", ids.numel()))
        return super().submit(ids, *a, **k)


def test_a_step_submits_with_the_first_only_when_its_ids_fill_the_read_queue(tmp_path):
    """A step whose first layer has at least queue-depth row ids submits the later layer's lookup before the
    first's runs; a smaller step keeps the first alone (decode steps of one sequence: 8 ids against a depth of
    16; of three: 24)."""
    log: list = []
    # without host dedup every layer is asked for the step's T * n_cols ids, which the log below groups steps by
    llm = engram.LLM("tiny", tier="disk", dtype=torch.float32, cache_dir=str(tmp_path), max_num_seqs=4,
                     engram_config={"queue_depth": 16}, dedup_rows=False)
    worker = llm.engine.executor.worker
    assert {lookup.read_queue_depth(t) for t in worker.lookup.tables.values()} == {16}
    worker.lookup.tables = {lid: Counting(t, lid, log) for lid, t in worker.lookup.tables.items()}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 17, 99, 4, 8]], params, use_tqdm=False)  # decode steps of 1 sequence
    llm.generate([[5 + i, 17, 99, 4 + 3 * i, 8] for i in range(3)], params, use_tqdm=False)  # of 3
    first, later = 1, 3
    orders = {}  # ids in the step's first layer -> the step's order of calls
    for k in range(0, len(log), 5):  # per step: (n, gather first), gathered, (n, submit later) in some order
        step = log[k:k + 5]
        calls = [e for e in step if e[0] != "n"]
        n = {e[1] for e in step if e[0] == "n"}
        assert len(n) == 1, step  # both layers look up the step's tokens' ids
        orders.setdefault(n.pop(), set()).add(tuple(calls))
    alone = (("gather", first), ("gathered", first), ("submit", later))
    together = (("submit", later), ("gather", first), ("gathered", first))
    assert orders[8] == {alone} and orders[24] == {together}
    assert all(o == {together if n >= 16 else alone} for n, o in orders.items()), orders


def test_reads_together_is_the_rule():
    for ids, depth, want in [(63, 64, False), (64, 64, True), (1000, 64, True), (10 ** 6, None, False)]:
        assert lookup.reads_together(ids, depth) is want, (ids, depth)
