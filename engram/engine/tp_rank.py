"""One Worker process of the grid of pipeline stages x tensor-parallel ranks (engine/rank_groups.py):
``build_rank_worker`` loads the model (a pipeline stage: only its layers, parallel/pp.py's plan, ``local_allocation``),
shards it around the single-device model (parallel/tp.py; ``wkv_tp: "column"``: parallel/wkv_column.py), opens the
rank's column shard of its Engram layers' tables (parallel/engram_tp.py), wraps a stage's model (parallel/pp_stage.py)
and builds its Worker; the last stage's sampler is a ``RankZeroSampler``. ``serve_steps`` then runs what the stage's
leader receives until "stop"; a pipeline stage runs them through ``serve_stage`` (its steps' lookups started as soon as
it learns of them, engine/stage_inbox.py; the last stage's sampled ids relayed to the stages that read them,
parallel/pp_relay.py). ``rank_main`` is a spawned rank's process (engine/multiproc.py); under torchrun the ranks
other than 0 run ``serve_steps`` too (engine/torchrun.py). Messages, from the engine to every stage leader, broadcast
to its stage: ("step", StepDescription: only the stage's Engram row ids) -> the last stage's StepResult, ("stats",
None), ("sampled", None) -> the stage's ranks' recent sampled ids, ("stop", None)."""
from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from engram import envs
from engram.engine.config import EngineConfig
from engram.engine.early_lookups import EarlyLookups
from engram.engine.lookup import LookupExecutor
from engram.engine.rank_groups import (GLOO_TIMEOUT_S, NCCL_ENV, RankGroups, RankPlace, init_group as join_groups,
                                      leave_groups)
from engram.engine.sampler import SampledTokens, Sampler
from engram.engine.stage_inbox import StageInbox
from engram.engine.step import SampleSpec
from engram.engine.worker import Worker
from engram.model.loader import load_model
from engram.model.options import RuntimeOptions
from engram.parallel import engram_tp, tp
from engram.parallel.pp import local_allocation, model_plan
from engram.parallel.pp_relay import relay_for
from engram.parallel.pp_stage import StageLink, StageModel
from engram.parallel.wkv_column import shard_wkv_columns

__all__ = ["NCCL_ENV", "RankGroups", "RankSpec", "build_rank_worker", "init_group", "make_rank_spec", "rank_main",
           "run_message", "serve_steps"]

SAMPLED_HISTORY = 256  # steps of sampled ids each rank keeps for the "sampled" message


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its Worker (picklable: it crosses the spawn)."""

    model: str  # preset name or checkpoint directory
    tier: str  # table tier
    dtype: torch.dtype  # parameter and step dtype
    options: RuntimeOptions  # the --engram-config options (wkv_tp among them)
    cache_dir: str | None  # table cache directory (None: the default)
    config: EngineConfig  # the engine's config (tensor_parallel_size x pipeline_parallel_size = the world size)
    max_model_len: int | None  # None: the model's max_position_embeddings
    init_method: str  # rendezvous: tcp://127.0.0.1:PORT (spawned ranks), env:// (torchrun)
    threads: int  # torch CPU threads per rank
    device: str = "cpu"  # "cpu" (gloo), or "cuda": rank r on cuda:<its local rank> (NCCL for the model's collectives)
    # called as before_lookup(rank, layer_id) before each local table read (tests delay one rank with it);
    # picklable: a module-level function or an instance of a module-level class
    before_lookup: Callable[[int, int], None] | None = None
    # layers per pipeline stage, as the engine's plan chose them (every rank plans with it); None with one stage
    partition: tuple[int, ...] | None = None
    # called as wrap_lookup(rank, lookup_executor) -> the executor the rank's runners submit through (tests delay or
    # watch one microbatch's lookups with it); picklable like before_lookup
    wrap_lookup: Callable[[int, LookupExecutor], LookupExecutor] | None = None
    # False: the rank's graph runners run their graphs' callables uncaptured on the same static inputs, on any device
    # (Worker ``graph_capture``): how the CPU ranks take the graph path
    graph_capture: bool = True

    @property
    def world(self) -> int:
        return self.config.tensor_parallel_size * self.config.pipeline_parallel_size


def make_rank_spec(model: str, tier: str, dtype: torch.dtype, options: RuntimeOptions, cache_dir: str | None,
                   config: EngineConfig, init_method: str, threads: int | None = None,
                   device: str = "cpu", partition: tuple[int, ...] | None = None) -> RankSpec:
    """The RankSpec of a command line or LLM(...) call: CPU threads split over the node's ranks unless given."""
    if threads is None:
        threads = max(1, torch.get_num_threads() // (config.tensor_parallel_size * config.pipeline_parallel_size))
    return RankSpec(str(model), tier, dtype, options, cache_dir, config, config.max_model_len, init_method, threads,
                    device=device, partition=partition)


class RankZeroSampler:
    """The stage's first rank samples; the other ranks of the (last) stage take its ids from a broadcast on the group
    inside the step, so every rank remembers (and, with async scheduling, patches in) the same tokens. Keeps the last
    SAMPLED_HISTORY steps' ids. ``src``: the sampling rank's global rank."""

    def __init__(self, sampler: Sampler, rank: int, group, src: int = 0):
        self.sampler, self.rank, self.group, self.src = sampler, rank, group, src
        self.history: collections.deque[list[int]] = collections.deque(maxlen=SAMPLED_HISTORY)

    def __call__(self, logits: torch.Tensor, specs: list[SampleSpec]) -> SampledTokens:
        if self.rank == 0:
            sampled = self.sampler(logits, specs)
        else:  # filled by the broadcast; only rank 0's logprobs are ever returned
            sampled = SampledTokens(torch.empty(len(specs), dtype=torch.long, device=logits.device), None, None, None)
        if specs:  # the same on every rank: the step is
            dist.broadcast(sampled.token_ids, src=self.src, group=self.group)  # [N] int64
        self.history.append(sampled.token_ids.tolist())
        return sampled


def place_of(spec: RankSpec, rank: int) -> RankPlace:
    return RankPlace.of(rank, spec.config.tensor_parallel_size, spec.config.pipeline_parallel_size)


def init_group(spec: RankSpec, rank: int, timeout_s: float = GLOO_TIMEOUT_S, local_rank: int | None = None
               ) -> RankGroups:
    """Join the grid's groups as global rank ``rank`` (engine/rank_groups.py)."""
    return join_groups(spec.device, spec.init_method, place_of(spec, rank), timeout_s, local_rank)


def build_rank_worker(rank: int, spec: RankSpec, groups: RankGroups) -> Worker:
    """Rank ``rank``'s Worker: its stage's layers of the model, sharded over the stage's ranks, its column shards of
    the stage's tables, the rank-0 sampler on the last stage. A stage's plan is checked (the planner's message) before
    anything loads. On CUDA every collective stays on the main stream (no lookup stream) and steps run eager (no CUDA
    graphs yet)."""
    place, dev, group = groups.place, groups.torch_device, groups.device
    world = place.tp
    torch.set_num_threads(spec.threads)
    stage = alloc = None
    if place.pp > 1:
        plan = model_plan(spec.model, place.pp, spec.partition, spec.options.table_rows)
        stage = plan.stages[place.stage]
        alloc = local_allocation(plan, place.stage, spec.config.block_size, spec.dtype)
    loaded = load_model(spec.model, tier=spec.tier, dtype=spec.dtype, device=dev, engram_config=spec.options,
                        cache_dir=spec.cache_dir, progress=False, layers=None if stage is None else stage.layers)
    before = functools.partial(spec.before_lookup, rank) if spec.before_lookup is not None else None
    with torch.inference_mode():
        tp.apply_tensor_parallel(loaded.model, place.tp_rank, world, group)
        if spec.options.wkv_tp == "column" and world > 1:
            shard_wkv_columns(loaded.model, place.tp_rank, world, group)
        if world > 1:
            loaded.tables = engram_tp.open_column_shards(loaded, place.tp_rank, world, group, before)
    max_model_len = spec.max_model_len or loaded.model_config.max_position_embeddings
    loaded.model_config = tp.local_model_config(loaded.model_config, world)
    if stage is not None:  # linked after the Worker's memory profile, which must send nothing
        loaded.model = StageModel(loaded.model, stage, place.pp)
    config = spec.config
    in_graph = all(getattr(t, "gathers_on_device", False) for t in loaded.tables.values()) if world > 1 else True
    if dev.type == "cuda" and (place.pp > 1 or (spec.graph_capture and not in_graph)):
        # pipeline stages, and host or disk shards (reads and an all-gather no graph holds): eager, every
        # collective on the main stream (the Worker never puts a column shard's eager lookup on the lookup stream)
        loaded.lookup_overlap = False
        config = dataclasses.replace(config, enforce_eager=True)
    if world > 1:  # the communicator exists before the Worker captures graphs (or profiles memory)
        tp.warm_up_collectives(group, dev)
    wrap = functools.partial(spec.wrap_lookup, rank) if spec.wrap_lookup is not None else None
    if stage is not None:  # a stage starts each step's lookups as it learns of the step (engine/early_lookups.py)
        wrap = functools.partial(_early_lookups, wrap, place.pp + 1)
    worker = Worker(loaded, config, max_model_len, dev, spec.dtype, progress=False, wrap_lookup=wrap,
                    kv_layers=None if alloc is None else alloc.kv_cache_layers, graph_capture=spec.graph_capture)
    if stage is not None:
        loaded.model.link = StageLink(place.prev_rank, place.next_rank, dev, groups.pipe)
        needs_ids = [s == 0 or bool(local_allocation(plan, s).engram_layers) for s in range(place.pp)]
        loaded.model.relay = relay_for(place.stage, place.pp, place.tp, place.tp_rank, needs_ids, dev, groups.pipe)
    if place.is_last_stage:
        worker.sampler = RankZeroSampler(worker.sampler, place.tp_rank, group, src=place.leader)
    return worker


def _early_lookups(wrap: Callable | None, limit: int, lookup: LookupExecutor) -> EarlyLookups:
    """A stage's lookup executor: ``wrap``'s (tests) inside ``EarlyLookups`` (at most ``limit`` steps started ahead:
    the engine's microbatches in flight, one more with relayed tokens)."""
    return EarlyLookups(wrap(lookup) if wrap is not None else lookup, limit)


def rank_report(worker: Worker) -> tuple:
    """What a rank reports once built: ("ready", KV blocks, parameter bytes, table bytes by layer, its NCCL_ENV
    variables as it sees them, ``holdings``)."""
    return ("ready", worker.memory.num_blocks, tp.parameter_bytes(worker.model),
            {lid: t.table.rows * t.table.row_bytes if isinstance(t, engram_tp.ColumnShard) else t.rows * t.row_bytes
             for lid, t in worker.tables.items()}, envs.values_of(NCCL_ENV), holdings(worker))


def holdings(worker: Worker) -> dict:
    """What the rank allocated, by layer: "layers" whose weights it holds, "kv_layers" with a KV cache and "kv_bytes"
    of it, "engram_layers" with a table, "staging_bytes", and "modules": which of the embedding, final norm and LM
    head it holds."""
    decoder = getattr(worker.model, "decoder", worker.model)
    body = decoder.model
    return {"layers": list(decoder.held_layers), "kv_layers": sorted(worker.kv.k) if worker.kv is not None else [],
            "kv_bytes": worker.memory.kv_bytes, "engram_layers": sorted(worker.tables),
            "staging_bytes": worker.memory.staging_bytes,
            "modules": [name for name, m in (("embed_tokens", body.embed_tokens), ("norm", body.norm),
                                              ("lm_head", decoder.lm_head)) if m is not None]}


class PipeReader:
    """A stage leader's messages from the engine, read off its pipe by a thread as they come: the engine never waits
    for a busy stage to take a message (nor a stage for the engine: the pipe's buffer never fills both ways)."""

    def __init__(self, conn):
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(conn,), daemon=True, name="engram-pipe-reader").start()

    def _read(self, conn) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError) as e:  # the engine's end went away: the main loop raises it
                self._queue.put(("gone", e))
                return
            self._queue.put(msg)
            if msg[0] == "stop":
                return

    def get(self) -> tuple:
        return _arrived(self._queue.get())

    def get_ready(self) -> tuple | None:
        """The next message if one has arrived, else None (never waits)."""
        try:
            return _arrived(self._queue.get_nowait())
        except queue.Empty:
            return None


def _arrived(msg: tuple) -> tuple:
    if msg[0] == "gone":
        raise EOFError(f"the engine's pipe closed ({msg[1]!r})")
    return msg


def rank_main(rank: int, spec: RankSpec, conn) -> None:
    """A spawned rank's process: build its Worker, report, then run what its stage leader receives until "stop"."""
    groups = worker = None
    try:
        groups = init_group(spec, rank)
        worker = build_rank_worker(rank, spec, groups)
        conn.send(rank_report(worker))
        leader = groups.place.is_leader
        with torch.inference_mode():
            reader = PipeReader(conn) if leader else None
            if groups.place.pp > 1:
                serve_stage(worker, groups, reader, conn.send if leader else None)
            else:
                serve_steps(rank, worker, groups, reader.get if leader else None, conn.send if leader else None)
    except BaseException:
        try:
            conn.send(("error", rank, traceback.format_exc()))
        finally:
            raise
    finally:
        worker = groups = None  # the last references to this rank's groups, before they are left
        leave_groups()


def serve_steps(rank: int, worker: Worker, groups: RankGroups, receive: Callable[[], tuple] | None,
                reply: Callable[[tuple], None] | None) -> None:
    """Run the stage's messages until "stop": its leader takes each from ``receive`` and hands its answer to ``reply``
    (a step's result: the last stage's only)."""
    place = groups.place
    while True:
        kind, payload = run_message(rank, worker, groups, receive() if place.is_leader else None)
        if kind == "stop":
            return
        if place.is_leader and (kind != "result" or place.is_last_stage):
            reply((kind, payload))


def serve_stage(worker: Worker, groups: RankGroups, reader: PipeReader | None,
                reply: Callable[[tuple], None] | None) -> None:
    """A pipeline stage's loop until "stop" (``reader``, ``reply``: the leader's): messages in order through a
    ``StageInbox``, each step's lookups started as soon as the stage learns of it (with a message, or before the
    stage waits for the previous stage's streams)."""
    place = groups.place
    def start(step) -> None:  # at once, or (tokens in flight not here yet) once they are
        if not step.pending_rows:
            worker.lookup.start(step)
        elif worker.pending.has(step.pending_step_id):
            worker.lookup.start(step, worker.pending.patch(step))

    inbox = StageInbox(groups.control, place.leader, place.is_leader, start,
                       reader.get if reader else None, reader.get_ready if reader else None)
    worker.model.intake = inbox.intake  # the stage's model: parallel/pp_stage.py StageModel
    relay = worker.model.relay
    while True:
        msg = inbox.next()
        if msg[0] == "step" and relay.receives and msg[1].pending_rows:  # its tokens in flight: wait for them here
            for sid, ids in relay.receive_through(msg[1].pending_step_id).items():
                worker.pending.keep(sid, ids)
        kind, payload = run_local(worker, groups, msg)
        if kind == "stop":
            relay.drain()
            return
        if kind == "result":
            relay.expect(payload.step_id, len(msg[1].samples))
            if place.is_last_stage:  # its own ids too: the step after next in this microbatch names this one
                worker.pending.keep(payload.step_id, torch.tensor(payload.token_ids, dtype=torch.long,
                                                                  device=groups.torch_device))
                relay.send(payload.token_ids)
                for step in inbox.ahead:  # a step learned of early that waited for these tokens starts now
                    if step.pending_step_id == payload.step_id:
                        start(step)
        if place.is_leader and (kind != "result" or place.is_last_stage):
            reply((kind, payload))


def run_message(rank: int, worker: Worker, groups: RankGroups, msg: tuple | None) -> tuple:
    """Broadcast the stage leader's ``msg`` (the one pickled copy, on the stage's control group), run it on every rank
    of the stage -> (kind, the leader's answer)."""
    box = [msg]
    dist.broadcast_object_list(box, src=groups.place.leader, group=groups.control)
    return run_local(worker, groups, box[0])


def run_local(worker: Worker, groups: RankGroups, msg: tuple) -> tuple:
    """Run ``msg``, which every rank of the stage holds, on this rank -> (kind, the answer)."""
    group = groups.control
    kind, payload = msg
    if kind == "stop":
        return kind, None
    if kind == "step":
        return "result", worker.execute(payload)
    if kind == "sampled":
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, list(getattr(worker.sampler, "history", ())), group=group)
        return kind, everyone
    out = worker.stats()
    if isinstance(worker.lookup, EarlyLookups):  # a pipeline stage: how many steps' lookups started early
        out["early_lookups"] = dict(worker.lookup.counts)
        relay = worker.model.relay  # and how many sampled-id messages it relayed
        out["relay"] = {"sent": relay.sent, "received": relay.received}
    return "stats", out
