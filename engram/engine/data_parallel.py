"""DataParallelEngine: M engine replicas (engine/dp_replica.py, one spawned process each, each a whole engine of
TP x PP Workers) behind LLMEngine's interface, so ``LLM.generate`` and the server drive it as they drive one engine.

The router, in the caller's process, checks each request as LLMEngine would (engine/request_check.py) and sends it
to the least-loaded replica: the fewest unfinished requests, ties to the lowest index. Replicas step on their own;
``step()`` returns whatever outputs have arrived (waiting at most STEP_WAIT_S for the first). ``stats()`` merges the
replicas' latest snapshots; ``step_trace`` numbers their step records in arrival order. The router waits on every
replica's pipe and process sentinel together: a replica that dies makes the next call raise ``ReplicaFailed`` (an
ExecutorFailed) naming it, its pid and exit code; the others are stopped and every later call raises again, so the
server fails what is in flight and exits non-zero. Replica placement (``plan_replicas``): on the CPU, side by side;
on CUDA, TP GPUs each when the node has M x TP, else (TP 1) all on one GPU, started one after another with
cumulative shares of ``gpu_memory_utilization`` so each profiles its KV cache into its own 1/M."""
from __future__ import annotations

import atexit
import collections
import dataclasses
import itertools
import logging
import time
import weakref
from multiprocessing import connection
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from engram import envs
from engram.engine.config import EngineConfig
from engram.engine.dp_replica import ReplicaInfo, ReplicaSpec, replica_main
from engram.engine.dp_stats import merge_stats
from engram.engine.executor import ExecutorFailed
from engram.engine.request_check import check_request
from engram.engine.step_trace import StepRecord, StepTrace
from engram.engine.stepping import StepError

_log = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0  # a replica not built by then fails the start (it may create tens of GiB of shared tables)
STOP_TIMEOUT_S = 10.0  # after "stop", replicas still alive are killed
STEP_WAIT_S = 0.05  # step() waits this long at most for the first replica message (new requests get in between)


class ReplicaFailed(ExecutorFailed):
    """A replica process died or its executor failed; the router is stopped and every later call raises this."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one replica runs."""

    visible_devices: str | None  # its CUDA_VISIBLE_DEVICES (None: inherited)
    gpu_memory_utilization: float  # the EngineConfig value it runs with
    after_previous: bool  # started only once the replica before it is ready (it profiles the GPU they share)


def plan_replicas(config: EngineConfig, device: torch.device, gpus: int | None = None) -> list[Placement]:
    """Each replica's Placement; ValueError naming the sizes when the node's GPUs cannot hold them."""
    # a replica's GPUs: one per rank of its grid (pipeline stages x tensor-parallel ranks)
    m, tp, util = (config.data_parallel_size, config.tensor_parallel_size * config.pipeline_parallel_size,
                   config.gpu_memory_utilization)
    if device.type != "cuda":
        return [Placement(None, util, False) for _ in range(m)]
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if gpus >= m * tp:
        visible = envs.values_of(["CUDA_VISIBLE_DEVICES"])["CUDA_VISIBLE_DEVICES"]
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        return [Placement(",".join(ids[i * tp:(i + 1) * tp]), util, False) for i in range(m)]
    if tp == 1:  # replica i may fill (i + 1) / M of util: the ones before it hold their i / M already
        return [Placement(None, util * (i + 1) / m, i > 0) for i in range(m)]
    raise ValueError(f"engine.data_parallel_size={m} x tensor_parallel_size={config.tensor_parallel_size}"
                     + (f" x pipeline_parallel_size={config.pipeline_parallel_size}"
                        if config.pipeline_parallel_size > 1 else "")
                     + f" needs {m * tp} GPUs (or TP 1 to share one); this node has {gpus}")


def data_parallel_engine(model: str, tier: str, dtype, engram_config: dict | None, device: torch.device,
                         cache_dir: str | None, config: EngineConfig, tokenizer,
                         build: Callable[[ReplicaSpec], Any]) -> "DataParallelEngine":
    """The replicas ``LLM(data_parallel_size=M, ...)`` asks for: each ``build(spec)`` (an LLM of the same arguments
    with data_parallel_size 1), its Placement, its share of this process's CPU threads, and the tables' shared copy on
    unless ``engram_config`` turns ``shared_memory`` off."""
    places = plan_replicas(config, device)
    options = dict(engram_config or {})
    options.setdefault("shared_memory", True)
    threads = max(1, torch.get_num_threads() // config.data_parallel_size) if device.type == "cpu" else None
    specs = []
    for i, place in enumerate(places):
        engine = dataclasses.replace(config, data_parallel_size=1, gpu_memory_utilization=place.gpu_memory_utilization)
        on = "cuda" if place.visible_devices is not None else str(device)
        specs.append(ReplicaSpec(i, model, tier, dtype, options, on, cache_dir, _fields(engine), build, threads=threads,
                                 log_level=logging.getLogger().getEffectiveLevel(),
                                 visible_devices=place.visible_devices))
    return DataParallelEngine(specs, places, tokenizer)


def _fields(config: EngineConfig) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


class DataParallelEngine:
    def __init__(self, specs: list[ReplicaSpec], placements: list[Placement], tokenizer):
        ctx = mp.get_context("spawn")
        self.tokenizer = tokenizer
        self._failure: str | None = None
        self.procs, self._conns, self.infos = [], [], []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._conns)
        atexit.register(self._finalizer)  # registered after multiprocessing's exit hook, so it runs before it
        for spec, place in zip(specs, placements):
            if place.after_previous:
                self._wait_ready(len(self.procs) - 1)
            parent, child = ctx.Pipe()
            # not a daemon: a replica starts its own TP ranks (daemons may have no children); the atexit hook stops
            # the replicas before multiprocessing's own joins them
            proc = ctx.Process(target=replica_main, args=(spec, child), daemon=False, name=f"engram-dp{spec.index}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self._conns.append(parent)
        for i in range(len(self.procs)):
            self._wait_ready(i)
        self.max_model_len = self.infos[0].max_model_len
        self._owner: dict[str, int] = {}  # unfinished request id -> its replica
        self._load = [0] * len(self.procs)  # unfinished requests per replica
        self._stats: list[dict | None] = [None] * len(self.procs)  # each replica's latest engine.stats()
        self._arrived: collections.deque = collections.deque()  # outputs received while waiting for a reply
        self.trace = StepTrace()
        self._step_ids = itertools.count()

    # ----------------------------------------------------------------- LLMEngine's interface
    def add_request(self, request_id: str, prompt: str | list[int], params=None) -> None:
        self._check_alive()
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already running")
        _, _, params = check_request(request_id, prompt, params, self.tokenizer, self.max_model_len)
        i = min(range(len(self._load)), key=lambda r: (self._load[r], r))
        self._owner[request_id] = i
        self._load[i] += 1
        self._send(i, ("add", [(request_id, prompt, params)]))

    def abort_request(self, request_id: str) -> bool:
        """Drop a request on its replica; False if it is unknown or finished (also once the router failed)."""
        i = self._owner.pop(request_id, None)
        if i is None:
            return False
        self._load[i] -= 1
        if self._failure is None:
            self._send(i, ("abort", [request_id]))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._owner) or bool(self._arrived)

    def num_unfinished(self) -> int:
        return len(self._owner)

    def step(self) -> list:
        """The outputs that arrived since the last call (waiting at most STEP_WAIT_S for one message); StepError for
        requests a replica failed (the others' outputs ride on it), ReplicaFailed when a replica is gone."""
        self._check_alive()
        outputs, failed, why = [], [], []
        if not self._arrived:
            self._poll(STEP_WAIT_S)
        while self._arrived:
            i, msg = self._arrived.popleft()
            if msg[0] == "step":
                outputs.extend(msg[1])
            elif msg[0] == "failed":  # (ids | None, message, outputs)
                ids = msg[1] if msg[1] is not None else [r for r, o in self._owner.items() if o == i]
                if msg[1] is None:
                    self._send(i, ("abort", ids))
                failed.extend(ids)
                why.append(f"replica {i}: {msg[2]}")
                outputs.extend(msg[3])
                for rid in ids:
                    self._retire(rid)
        for out in outputs:
            if out.finished:
                self._retire(out.request_id)
        if failed:
            raise StepError(RuntimeError("; ".join(why)), failed, outputs)
        return outputs

    def stats(self) -> dict[str, Any]:
        self._check_alive()
        return {**merge_stats(self._stats, self.infos), **self.trace.totals()}

    def reset_prefix_cache(self) -> int:
        """Every replica forgets its cached prefix blocks -> how many they dropped together."""
        for i in range(len(self.procs)):
            self._send(i, ("reset_prefix_cache", None))
        return sum(self._reply(i, "reset")[1] for i in range(len(self.procs)))

    def step_trace(self, since: int = -1) -> list[StepRecord]:
        """Every replica's step records after router step id ``since``, numbered in arrival order."""
        return self.trace.since(since)

    def close(self) -> None:
        """Stop every replica ("stop", then a kill after STOP_TIMEOUT_S)."""
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @property
    def loads(self) -> list[int]:
        """Unfinished requests per replica (what routing compares)."""
        return list(self._load)

    def replica_of(self, request_id: str) -> int | None:
        """The replica an unfinished request runs on."""
        return self._owner.get(request_id)

    @property
    def replica_stats(self) -> list[dict | None]:
        """Each replica's latest engine.stats() (None before its first step)."""
        return list(self._stats)

    # ----------------------------------------------------------------- the replicas' messages
    def _retire(self, request_id: str) -> None:
        i = self._owner.pop(request_id, None)
        if i is not None:
            self._load[i] -= 1

    def _poll(self, timeout: float | None) -> None:
        """Queue every message that is there (after waiting up to ``timeout`` for one); ReplicaFailed for a replica
        whose process ended."""
        connection.wait([*self._conns, *(p.sentinel for p in self.procs)], timeout)
        for i, conn in enumerate(self._conns):
            while conn.poll(0):  # also true at EOF, where _recv fails the replica
                self._take(i, self._recv(i))
        dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]  # after its last messages were read
        if dead:
            self._fail(dead[0], "its process ended")

    def _recv(self, i: int) -> tuple:
        try:
            return self._conns[i].recv()
        except (EOFError, OSError):
            self._fail(i, "its pipe closed")

    def _take(self, i: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            self._stats[i] = msg[2]
            for rec in msg[3]:
                self.trace.append(dataclasses.replace(rec, step_id=next(self._step_ids)))
            self._arrived.append((i, msg))
        elif kind == "fatal":
            self._fail(i, f"its executor failed: {msg[1]}")
        elif kind == "error":
            _log.error("data-parallel replica %d raised:\n%s", i, msg[1])
            self._fail(i, f"it raised {msg[1].strip().splitlines()[-1] if msg[1].strip() else '(no traceback)'}")
        else:  # "step", "failed" (for step()) and replies (for _reply)
            self._arrived.append((i, msg))

    def _reply(self, i: int, kind: str) -> tuple:
        """Wait for replica ``i``'s next ``kind`` message; step outputs arriving meanwhile stay queued for step()."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            for j, (r, msg) in enumerate(self._arrived):
                if r == i and msg[0] == kind:
                    del self._arrived[j]
                    return msg
            self._poll(1.0)
        self._fail(i, f"no {kind!r} reply in {START_TIMEOUT_S:g} s")

    def _wait_ready(self, i: int) -> None:
        if i < len(self.infos):
            return
        ready = connection.wait([self._conns[i], self.procs[i].sentinel], START_TIMEOUT_S)
        if self._conns[i] not in ready:
            self._fail(i, "it was not ready in time" if not ready else "its process ended while starting")
        msg = self._recv(i)
        if msg[0] != "ready":
            self._take(i, msg)
            self._fail(i, f"it sent {msg[0]!r} before 'ready'")
        info: ReplicaInfo = msg[1]
        self.infos.append(info)
        _log.info("data-parallel replica %d (pid %d) ready: %d KV blocks; shared tables created %d (%d B), mapped %d "
                  "(%d B)", i, info.pid, info.num_kv_blocks, info.shared.get("created", 0),
                  info.shared.get("created_bytes", 0), info.shared.get("mapped", 0), info.shared.get("mapped_bytes", 0))

    def _send(self, i: int, msg: tuple) -> None:
        self._check_alive()
        try:
            self._conns[i].send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self._fail(i, f"{msg[0]}: its pipe closed")

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise ReplicaFailed(self._failure)

    def _fail(self, i: int, why: str) -> None:
        p = self.procs[i]
        p.join(0.5)
        code = "still running" if p.is_alive() else f"exit code {p.exitcode}"
        self._failure = f"data-parallel replica {i} (pid {p.pid}, {code}) failed: {why}"
        _log.error("%s; stopping the other replicas", self._failure)
        self._finalizer()
        raise ReplicaFailed(self._failure)


def _stop(procs: list, conns: list) -> None:
    """Ask every replica to stop; kill those still alive after STOP_TIMEOUT_S."""
    for conn in conns:
        try:
            conn.send(("stop", None))
        except (BrokenPipeError, ConnectionResetError, OSError):  # that one is gone already
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()
