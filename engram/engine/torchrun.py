"""The same ranks under ``torchrun`` (c10d env rendezvous, one or several nodes): every process runs the same
``engram generate|serve --tensor-parallel-size N`` command. Rank 0 runs the engine with a ``TorchrunExecutor`` (its
own rank-0 Worker in process, each step description broadcast from it on the gloo group, engine/tp_rank.py); every
other rank runs ``serve_rank`` (build its Worker, run the broadcast messages until rank 0 stops). torchrun's own
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) says which rank a process is; WORLD_SIZE must equal the
tensor-parallel size. A rank that dies is torchrun's to report (its agent stops the others); a collective whose peer
is gone gives up after START_TIMEOUT_S."""
from __future__ import annotations

import collections
import weakref
from typing import Any, Mapping

import torch.distributed as dist

from engram import envs

from engram.engine.executor import Executor, ExecutorFailed
from engram.engine.rank_groups import leave_groups
from engram.engine.step import StepDescription, StepResult
from engram.engine.tp_rank import RankSpec, build_rank_worker, init_group, run_message, serve_steps

START_TIMEOUT_S = 300.0  # ranks wait this long for each other: loading (and writing table shards) included
NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # set by torchrun in every process it starts


def torchrun_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's rank when torchrun started it (its rendezvous environment is set), else None."""
    env = envs.torchrun_environment() if environ is None else environ
    if not all(k in env for k in NEEDED):
        return None
    return int(env["RANK"])


def check_world(spec: RankSpec, environ: Mapping[str, str] | None = None) -> None:
    """ValueError unless torchrun's WORLD_SIZE equals the tensor-parallel size; NotImplementedError for pipeline
    stages (their ranks are spawned on one node: engine/multiproc.py)."""
    env = envs.torchrun_environment() if environ is None else environ
    if spec.config.pipeline_parallel_size > 1:
        raise NotImplementedError(f"--pipeline-parallel-size={spec.config.pipeline_parallel_size} under torchrun: "
                                  "pipeline stages run as spawned processes on one node; run it without torchrun")
    if int(env["WORLD_SIZE"]) != spec.config.tensor_parallel_size:
        raise ValueError(f"--tensor-parallel-size={spec.config.tensor_parallel_size} under torchrun with "
                         f"WORLD_SIZE={env['WORLD_SIZE']}: start one process per rank (--nnodes x --nproc-per-node)")


def _local_rank() -> int:
    """This process's device index on its node (torchrun's LOCAL_RANK, else its RANK)."""
    env = envs.torchrun_environment()
    return int(env.get("LOCAL_RANK", env["RANK"]))


def _agree_on_blocks(worker, group) -> int:
    """Every rank's KV block count, which must be the same (the scheduler's one pool) -> it."""
    blocks: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(blocks, worker.memory.num_blocks, group=group)
    if len(set(blocks)) != 1:
        raise ExecutorFailed(f"tensor-parallel ranks sized different KV caches {blocks}")
    return blocks[0]


def serve_rank(spec: RankSpec, rank: int) -> None:
    """A rank other than 0: build its Worker, then run what rank 0 broadcasts until it says "stop"."""
    check_world(spec)
    groups = init_group(spec, rank, START_TIMEOUT_S, _local_rank())
    worker = None
    try:
        worker = build_rank_worker(rank, spec, groups)
        _agree_on_blocks(worker, groups.control)
        serve_steps(rank, worker, groups, None, None)
    finally:
        worker = groups = None  # the last references to this rank's groups, before they are left
        leave_groups()


class TorchrunExecutor(Executor):
    """Rank 0's side: its Worker in this process; every call is one broadcast message run on all ranks."""

    def __init__(self, spec: RankSpec):
        check_world(spec)
        self.groups = init_group(spec, 0, START_TIMEOUT_S, _local_rank())
        self.worker = build_rank_worker(0, spec, self.groups)
        self.num_kv_blocks = _agree_on_blocks(self.worker, self.groups.control)
        self._results: collections.deque[StepResult] = collections.deque()
        self._open = [True]  # shared with the finalizer
        self._finalizer = weakref.finalize(self, _stop_ranks, self.worker, self.groups, self._open)

    def _run(self, msg: tuple) -> Any:
        if not self._open[0]:
            raise ExecutorFailed("the torchrun executor is closed")
        return run_message(0, self.worker, self.groups, msg)[1]

    def launch(self, step: StepDescription) -> int:
        self._results.append(self._run(("step", step)))  # synchronous: the step ran on every rank
        return step.step_id

    def collect(self, handle: int) -> StepResult:
        result = self._results.popleft()
        if result.step_id != handle:
            raise ValueError(f"collect({handle}): steps are collected in launch order (next: {result.step_id})")
        return result

    def stats(self) -> dict[str, Any]:
        return self._run(("stats", None))

    def sampled(self) -> list[list[list[int]]]:
        """Every rank's sampled ids of its recent steps, rank by rank."""
        return self._run(("sampled", None))

    def close(self) -> None:
        """Tell the other ranks to stop and leave the groups (also at exit, if never called); then drop this
        executor's Worker and groups so that the groups' threads finish before the interpreter does
        (rank_groups.leave_groups)."""
        self._finalizer()
        self.worker = self.groups = None
        leave_groups()


def _stop_ranks(worker, groups, open_: list) -> None:
    if open_[0]:
        open_[0] = False
        run_message(0, worker, groups, ("stop", None))
        dist.destroy_process_group()
