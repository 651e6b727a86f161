"""Where a Worker process sits in the grid of ``pipeline_parallel_size`` stages x ``tensor_parallel_size`` ranks, and
the process groups it joins. Global rank r is tensor-parallel rank ``r % T`` of stage ``r // T``; each stage's first
rank is its leader (it receives the engine's messages and broadcasts them to its stage). Groups: ``control`` (gloo)
carries a stage's pickled messages, ``device`` its model's, tables' and sampler's collectives (gloo on the CPU, NCCL on
CUDA, main stream only), ``pipe`` the point-to-point streams between stages (parallel/pp_stage.py). With one stage the
stage is the world, as tensor parallelism alone always had it."""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

GLOO_TIMEOUT_S = 60.0  # a collective whose peer is gone gives up (the executor has usually stopped it first)
# set in every rank before NCCL starts: NVLink multicast (NVLS) stays off, as the GPU machines used here require
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class RankPlace:
    """One rank's place in the grid."""

    rank: int  # global rank
    stage: int  # pipeline stage, 0 = first
    tp_rank: int  # tensor-parallel rank inside the stage
    tp: int  # ranks per stage
    pp: int  # stages

    @classmethod
    def of(cls, rank: int, tp: int, pp: int) -> "RankPlace":
        if not 0 <= rank < tp * pp:
            raise ValueError(f"rank {rank} outside the {pp} x {tp} grid")
        return cls(rank, rank // tp, rank % tp, tp, pp)

    @property
    def leader(self) -> int:
        """Global rank of this stage's first rank."""
        return self.stage * self.tp

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """The same tensor-parallel rank of the stage before (None on the first stage)."""
        return self.rank - self.tp if self.stage > 0 else None

    @property
    def next_rank(self) -> int | None:
        """The same tensor-parallel rank of the stage after (None on the last stage)."""
        return self.rank + self.tp if self.stage < self.pp - 1 else None

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp, (stage + 1) * self.tp))


@dataclass(frozen=True)
class RankGroups:
    """A rank's process groups (see the module docstring) and its device."""

    control: object
    device: object
    torch_device: torch.device  # this rank's device
    place: RankPlace
    pipe: object = None  # point-to-point between stages (the world group); None with one stage


def init_group(device: str, init_method: str, place: RankPlace, timeout_s: float = GLOO_TIMEOUT_S,
               local_rank: int | None = None) -> RankGroups:
    """Join the world of ``place.tp * place.pp`` ranks and this rank's stage groups (collectives give up after
    ``timeout_s``); on CUDA rank r takes cuda:``local_rank`` (default: r) and NCCL, with NCCL_ENV set first. Every
    rank creates every stage's groups, in stage order (torch.distributed's rule for ``new_group``)."""
    world, timeout, rank = place.tp * place.pp, timedelta(seconds=timeout_s), place.rank
    if device == "cpu":
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        if place.pp == 1:
            return RankGroups(dist.group.WORLD, dist.group.WORLD, torch.device("cpu"), place)
        stages = [dist.new_group(place.stage_ranks(s), timeout=timeout) for s in range(place.pp)]
        return RankGroups(stages[place.stage], stages[place.stage], torch.device("cpu"), place, dist.group.WORLD)
    os.environ.update(NCCL_ENV)
    dev = torch.device("cuda", rank if local_rank is None else local_rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, timeout=timeout,
                            device_id=dev)
    if place.pp == 1:
        return RankGroups(dist.new_group(backend="gloo", timeout=timeout), dist.group.WORLD, dev, place)
    control = [dist.new_group(place.stage_ranks(s), backend="gloo", timeout=timeout) for s in range(place.pp)]
    devices = [dist.new_group(place.stage_ranks(s), timeout=timeout) for s in range(place.pp)]
    return RankGroups(control[place.stage], devices[place.stage], dev, place, dist.group.WORLD)


def leave_groups() -> None:
    """Leave torch.distributed for good: destroy every process group, then collect what is left of them while the
    interpreter is fully alive. The caller drops its own references to its groups, and to everything holding one (a
    Worker: its model, tables and sampler), first. A gloo group's run-loop threads stop only when its last reference
    goes; one still running at interpreter exit may then free its last collective's tensors, which takes the GIL, and
    the process aborts ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
