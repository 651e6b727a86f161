"""One tensor-parallel rank: ``build_rank_worker`` loads the model, shards it around the single-device model
(parallel/tp.py; ``wkv_tp: "column"``: parallel/wkv_column.py), opens the rank's column shard of every Engram table
(parallel/engram_tp.py) and builds its Worker, whose sampler is a ``RankZeroSampler``; ``serve_steps`` then runs
what rank 0 broadcasts until "stop". ``rank_main`` is a spawned rank's process (engine/multiproc.py); under torchrun
the ranks other than 0 run ``serve_steps`` too (engine/torchrun.py). Messages, broadcast from rank 0 on the group:
("step", StepDescription), ("stats", None), ("sampled", None) -> every rank's recent sampled ids, ("stop", None)."""
from __future__ import annotations

import collections
import dataclasses
import functools
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from engram import envs
from engram.engine.config import EngineConfig
from engram.engine.sampler import SampledTokens, Sampler
from engram.engine.step import SampleSpec
from engram.engine.worker import Worker
from engram.model.loader import load_model
from engram.model.options import RuntimeOptions
from engram.parallel import engram_tp, tp
from engram.parallel.wkv_column import shard_wkv_columns

GLOO_TIMEOUT_S = 60.0  # a collective whose peer is gone gives up (the executor has usually stopped it first)
SAMPLED_HISTORY = 256  # steps of sampled ids each rank keeps for the "sampled" message
# set in every rank before NCCL starts: NVLink multicast (NVLS) stays off, as the GPU machines used here require
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its Worker (picklable: it crosses the spawn)."""

    model: str  # preset name or checkpoint directory
    tier: str  # table tier
    dtype: torch.dtype  # parameter and step dtype
    options: RuntimeOptions  # the --engram-config options (wkv_tp among them)
    cache_dir: str | None  # table cache directory (None: the default)
    config: EngineConfig  # the engine's config (tensor_parallel_size = the world size)
    max_model_len: int | None  # None: the model's max_position_embeddings
    init_method: str  # rendezvous: tcp://127.0.0.1:PORT (spawned ranks), env:// (torchrun)
    threads: int  # torch CPU threads per rank
    device: str = "cpu"  # "cpu" (gloo), or "cuda": rank r on cuda:<its local rank> (NCCL for the model's collectives)
    # called as before_lookup(rank, layer_id) before each local table read (tests delay one rank with it);
    # picklable: a module-level function or an instance of a module-level class
    before_lookup: Callable[[int, int], None] | None = None


def make_rank_spec(model: str, tier: str, dtype: torch.dtype, options: RuntimeOptions, cache_dir: str | None,
                   config: EngineConfig, init_method: str, threads: int | None = None,
                   device: str = "cpu") -> RankSpec:
    """The RankSpec of a command line or LLM(...) call: CPU threads split over the node's ranks unless given."""
    if threads is None:
        threads = max(1, torch.get_num_threads() // config.tensor_parallel_size)
    return RankSpec(str(model), tier, dtype, options, cache_dir, config, config.max_model_len, init_method, threads,
                    device=device)


@dataclass(frozen=True)
class RankGroups:
    """A rank's process groups: ``control`` (gloo) carries the pickled messages, ``device`` the model's, the
    tables' and the sampler's collectives (gloo on the CPU; NCCL on CUDA, on the main stream only)."""

    control: object
    device: object
    torch_device: torch.device  # this rank's device


class RankZeroSampler:
    """Rank 0 samples; the other ranks take its ids from a broadcast on the group inside the step, so every rank
    remembers (and, with async scheduling, patches in) the same tokens. Keeps the last SAMPLED_HISTORY steps' ids."""

    def __init__(self, sampler: Sampler, rank: int, group):
        self.sampler, self.rank, self.group = sampler, rank, group
        self.history: collections.deque[list[int]] = collections.deque(maxlen=SAMPLED_HISTORY)

    def __call__(self, logits: torch.Tensor, specs: list[SampleSpec]) -> SampledTokens:
        if self.rank == 0:
            sampled = self.sampler(logits, specs)
        else:  # filled by the broadcast; only rank 0's logprobs are ever returned
            sampled = SampledTokens(torch.empty(len(specs), dtype=torch.long, device=logits.device), None, None, None)
        if specs:  # the same on every rank: the step is
            dist.broadcast(sampled.token_ids, src=0, group=self.group)  # [N] int64
        self.history.append(sampled.token_ids.tolist())
        return sampled


def init_group(spec: RankSpec, rank: int, timeout_s: float = GLOO_TIMEOUT_S, local_rank: int | None = None
               ) -> RankGroups:
    """Join the group of ``spec.config.tensor_parallel_size`` ranks (collectives give up after ``timeout_s``); on
    CUDA rank ``rank`` takes cuda:``local_rank`` (default: ``rank``) and NCCL, with NCCL_ENV set first."""
    world, timeout = spec.config.tensor_parallel_size, timedelta(seconds=timeout_s)
    if spec.device == "cpu":
        dist.init_process_group("gloo", init_method=spec.init_method, rank=rank, world_size=world, timeout=timeout)
        return RankGroups(dist.group.WORLD, dist.group.WORLD, torch.device("cpu"))
    os.environ.update(NCCL_ENV)
    dev = torch.device("cuda", rank if local_rank is None else local_rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=spec.init_method, rank=rank, world_size=world, timeout=timeout,
                            device_id=dev)
    return RankGroups(dist.new_group(backend="gloo", timeout=timeout), dist.group.WORLD, dev)


def build_rank_worker(rank: int, spec: RankSpec, groups: RankGroups) -> Worker:
    """Rank ``rank``'s Worker: the sharded model, its column shards of the tables, the rank-0 sampler. On CUDA every
    collective stays on the main stream (no lookup stream) and steps run eager (no CUDA graphs yet)."""
    world, dev, group = spec.config.tensor_parallel_size, groups.torch_device, groups.device
    torch.set_num_threads(spec.threads)
    loaded = load_model(spec.model, tier=spec.tier, dtype=spec.dtype, device=dev, engram_config=spec.options,
                        cache_dir=spec.cache_dir, progress=False)
    before = functools.partial(spec.before_lookup, rank) if spec.before_lookup is not None else None
    with torch.inference_mode():
        tp.apply_tensor_parallel(loaded.model, rank, world, group)
        if spec.options.wkv_tp == "column" and world > 1:
            shard_wkv_columns(loaded.model, rank, world, group)
        if world > 1:
            loaded.tables = engram_tp.open_column_shards(loaded, rank, world, group, before)
    max_model_len = spec.max_model_len or loaded.model_config.max_position_embeddings
    loaded.model_config = tp.local_model_config(loaded.model_config, world)
    config = spec.config
    if dev.type == "cuda":
        loaded.lookup_overlap = False  # a lookup ends in an all-gather: never on a side stream
        config = dataclasses.replace(config, enforce_eager=True)
    worker = Worker(loaded, config, max_model_len, dev, spec.dtype, progress=False)
    worker.sampler = RankZeroSampler(worker.sampler, rank, group)
    return worker


def rank_report(worker: Worker) -> tuple:
    """What a rank reports once built: ("ready", KV blocks, parameter bytes, table bytes by layer, its NCCL_ENV
    variables as it sees them)."""
    return ("ready", worker.memory.num_blocks, tp.parameter_bytes(worker.model),
            {lid: t.table.rows * t.table.row_bytes if isinstance(t, engram_tp.ColumnShard) else t.rows * t.row_bytes
             for lid, t in worker.tables.items()}, envs.values_of(NCCL_ENV))


def rank_main(rank: int, spec: RankSpec, conn) -> None:
    """A spawned rank's process: build the sharded Worker, report, then run what rank 0 broadcasts until "stop"."""
    try:
        groups = init_group(spec, rank)
        worker = build_rank_worker(rank, spec, groups)
        conn.send(rank_report(worker))
        with torch.inference_mode():
            serve_steps(rank, worker, groups, conn.recv if rank == 0 else None, conn.send if rank == 0 else None)
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        finally:
            raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def serve_steps(rank: int, worker: Worker, groups: RankGroups, receive: Callable[[], tuple] | None,
                reply: Callable[[tuple], None] | None) -> None:
    """Run broadcast messages until "stop": rank 0 takes each from ``receive`` and hands its answer to ``reply``."""
    while True:
        kind, payload = run_message(rank, worker, groups, receive() if rank == 0 else None)
        if kind == "stop":
            return
        if rank == 0:
            reply((kind, payload))


def run_message(rank: int, worker: Worker, groups: RankGroups, msg: tuple | None) -> tuple:
    """Broadcast rank 0's ``msg`` (the one pickled copy, on the control group), run it on every rank -> (kind,
    rank 0's answer)."""
    group = groups.control
    box = [msg]
    dist.broadcast_object_list(box, src=0, group=group)
    kind, payload = box[0]
    if kind == "stop":
        return kind, None
    if kind == "step":
        return "result", worker.execute(payload)
    if kind == "sampled":
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, list(worker.sampler.history), group=group)
        return kind, everyone
    return "stats", worker.stats()
