"""The row-id trace (``EngineConfig.row_trace``, ``engram serve --row-trace FILE``): per collected step and per Engram
layer, the distinct row ids the step's tables had to produce (its planned ids, pending tokens' ids completed from the
tokens the step before sampled, deduplicated and ascending: what a deduplicating tier reads), with the step's id, kind
and token count. Benchmarks replay it offline (bench/page_replay.py).

``RowTraceWriter.record`` only queues references to the step's plan (plans are never mutated after launch); a writer
thread completes, deduplicates and appends them, so the step's critical path pays a queue put. Memory is bounded: at
most ``QUEUED_STEPS`` steps wait (a full queue makes ``record`` wait: the trace stays complete) and ``FLUSH_IDS`` ids
are buffered before a chunk is written. ``close`` (the engine's, at shutdown; also at interpreter exit) writes the rest.

File layout: successive ``.npy`` arrays (``numpy.save`` one after another)::

    header  uint8 [B]            JSON: format, version, layer_ids, table_rows, n_cols, id_dtype, table_files, engine
    then per chunk:
    steps   int64 [S, 3 + 2L]    step_id, kind (0 decode, 1 mixed, 2 prefill), tokens, ids per layer, distinct per layer
    ids     id_dtype [sum distinct]   step by step, layer by layer within a step, ascending within a (step, layer)
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

FORMAT, VERSION = "engram-row-trace", 1
KINDS = ("decode", "mixed", "prefill")  # the kind column's codes
QUEUED_STEPS = 64  # steps handed to the writer thread and not written yet, at most
FLUSH_IDS = 1 << 20  # distinct ids buffered before a chunk is written
KEPT_TOKENS = 64  # steps whose sampled tokens are kept for the pending ids of steps after them
_log = logging.getLogger(__name__)


def check_trace_path(path: str | os.PathLike) -> Path:
    """``path`` as a Path when a trace can be written there (it is not a directory, its directory exists and is
    writable); ValueError naming the path otherwise."""
    p = Path(path)
    if not str(path):
        raise ValueError("row trace path is empty")
    if p.is_dir():
        raise ValueError(f"row trace {str(p)!r}: is a directory; give a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"row trace {str(p)!r}: directory {str(parent)!r} does not exist")
    if (p.exists() and not os.access(p, os.W_OK)) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"row trace {str(p)!r}: not writable")
    return p


@dataclass(frozen=True)
class StepRows:
    """What the trace needs of a launched step's plan (references, not copies)."""

    row_ids: dict[int, torch.Tensor]  # Engram layer id -> [T, n_cols] int64 planned ids (pending rows: placeholders)
    pending_partials: torch.Tensor | None  # [L, P, n_cols] int64 host halves of the pending rows' ids; None: P = 0
    pending_rows: list[int]  # [P] packed rows of the pending tokens
    pending_sources: list[int]  # [P] index of each pending token among step ``pending_step_id``'s sampled tokens
    pending_step_id: int  # the step that sampled them (-1 without pending rows)


class RowTraceWriter:
    """Appends steps to a row trace file (see the module docstring). ``compress``: raw token ids -> compressed ids
    (DEAD = -1), the engine's; ``hasher``: the engine's NgramHasher (completes pending ids); ``header``: extra header
    fields (``table_files``, ``engine``)."""

    def __init__(self, path: str | os.PathLike, hasher, compress: Callable[[list[int]], list[int]],
                 header: dict[str, Any]):
        self.path = check_trace_path(path)
        self.hasher, self.compress = hasher, compress
        cfg = hasher.cfg if hasher is not None else None
        self.layer_ids = list(cfg.layer_ids) if cfg is not None else []
        table_rows = [cfg.table_rows(lid) for lid in self.layer_ids]
        self.id_dtype = np.dtype(np.uint32 if max(table_rows, default=0) <= np.iinfo(np.uint32).max else np.int64)
        try:
            self._file = open(self.path, "wb")
        except OSError as e:
            raise ValueError(f"row trace {str(self.path)!r}: cannot open for writing: {e.strerror}") from None
        head = {"format": FORMAT, "version": VERSION, "layer_ids": self.layer_ids, "table_rows": table_rows,
                "n_cols": cfg.n_cols if cfg is not None else 0, "id_dtype": self.id_dtype.name, **header}
        np.save(self._file, np.frombuffer(json.dumps(head).encode(), dtype=np.uint8))
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUED_STEPS)
        self._steps: list[list[int]] = []
        self._ids: list[np.ndarray] = []
        self._buffered = 0
        self._tokens: dict[int, np.ndarray] = {}  # step id -> its sampled tokens, compressed (the last KEPT_TOKENS)
        self.error: BaseException | None = None  # the writer thread's failure: the trace stops there
        self.steps_written = 0
        self._thread = threading.Thread(target=self._run, name="engram-row-trace", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _close, self._queue, self._thread)

    def record(self, step_id: int, kind: str, num_tokens: int, rows: StepRows | None, tokens: list[int]) -> None:
        """Queue a collected step: its id, kind, tokens computed, plan rows (None: no Engram layers) and the tokens it
        sampled (for the pending ids of later steps)."""
        if self.error is None:
            self._queue.put((step_id, KINDS.index(kind), num_tokens, rows, tokens))

    def close(self) -> None:
        """Write what is queued and buffered, then close the file (idempotent); a failure of the writer is logged."""
        self._finalizer()
        if self.error is not None:
            _log.error("row trace %s is incomplete: %s: %s", self.path, type(self.error).__name__, self.error)

    # ----------------------------------------------------------------- the writer thread
    def _run(self) -> None:
        closing = False
        try:
            while (item := self._queue.get()) is not None:
                self._add(*item)
            closing = True
            self._flush()
        except BaseException as e:  # the engine goes on; the trace ends here and close() says so
            self.error = e
            while not closing and self._queue.get() is not None:  # unblock record() until close()
                pass
        finally:
            self._file.close()

    def _add(self, step_id: int, kind: int, num_tokens: int, rows: StepRows | None, tokens: list[int]) -> None:
        self._tokens[step_id] = np.asarray(self.compress(list(tokens)), dtype=np.int64)
        while len(self._tokens) > KEPT_TOKENS:
            del self._tokens[next(iter(self._tokens))]
        per_layer = self._distinct(step_id, rows) if rows is not None else [np.empty(0, np.int64)] * len(
            self.layer_ids)
        counts = [int(rows.row_ids[lid].numel()) if rows is not None else 0 for lid in self.layer_ids]
        self._steps.append([step_id, kind, num_tokens, *counts, *(len(u) for u in per_layer)])
        for u in per_layer:
            self._ids.append(u.astype(self.id_dtype))
            self._buffered += len(u)
        if self._buffered >= FLUSH_IDS:
            self._flush()

    def _distinct(self, step_id: int, rows: StepRows) -> list[np.ndarray]:
        """Each layer's distinct ids of the step, ascending, pending rows' ids completed as the Worker does."""
        hashed = None
        if rows.pending_rows:
            sampled = self._tokens.get(rows.pending_step_id)
            if sampled is None:
                raise RuntimeError(f"step {step_id}: its pending tokens come from step {rows.pending_step_id}, whose "
                                   "sampled tokens the trace does not hold")
            compressed = torch.from_numpy(sampled[np.asarray(rows.pending_sources, dtype=np.int64)])  # [P]
            hashed = self.hasher.hash_pending(compressed, rows.pending_partials)  # [L, P, n_cols]
        out = []
        for i, lid in enumerate(self.layer_ids):
            ids = rows.row_ids[lid]  # [T, n_cols]
            if hashed is not None:
                ids = ids.index_copy(0, torch.tensor(rows.pending_rows, dtype=torch.int64), hashed[i])
            out.append(np.unique(ids.numpy().reshape(-1)))
        return out

    def _flush(self) -> None:
        if not self._steps:
            return
        np.save(self._file, np.asarray(self._steps, dtype=np.int64).reshape(len(self._steps), -1))
        np.save(self._file, np.concatenate(self._ids) if self._ids else np.empty(0, self.id_dtype))
        self._file.flush()
        self.steps_written += len(self._steps)
        self._steps, self._ids, self._buffered = [], [], 0


def _close(q: queue.Queue, thread: threading.Thread) -> None:
    q.put(None)
    thread.join()


@dataclass
class RowTrace:
    """A row trace read back (``read_row_trace``)."""

    header: dict[str, Any]
    steps: np.ndarray  # [S, 3 + 2L] int64, the columns of the module docstring
    ids: np.ndarray  # [sum distinct] int64

    @property
    def layer_ids(self) -> list[int]:
        return list(self.header["layer_ids"])

    @property
    def step_ids(self) -> np.ndarray:
        return self.steps[:, 0]

    @property
    def kinds(self) -> list[str]:
        return [KINDS[k] for k in self.steps[:, 1]]

    def planned(self, i: int) -> np.ndarray:
        """[S] ids planned for layer index ``i`` per step (before dedup)."""
        return self.steps[:, 3 + i]

    def distinct(self, i: int) -> np.ndarray:
        """[S] distinct ids of layer index ``i`` per step."""
        return self.steps[:, 3 + len(self.layer_ids) + i]

    def layer(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer index ``i``'s (rows [A] int64 step after step, step bounds [S + 1])."""
        n_layers = len(self.layer_ids)
        counts = self.steps[:, 3 + n_layers:].reshape(-1)  # [S * L], step-major: the ids array's blocks
        starts = np.concatenate([[0], np.cumsum(counts)])
        mine = np.arange(i, counts.size, n_layers)  # this layer's block of every step
        rows = np.concatenate([self.ids[starts[k]:starts[k + 1]] for k in mine]) if mine.size else self.ids[:0]
        return rows, np.concatenate([[0], np.cumsum(counts[mine])])


def read_row_trace(path: str | os.PathLike) -> RowTrace:
    """The trace at ``path``; ValueError naming the file and byte offset of anything malformed (a truncated chunk: the
    engine did not close it)."""
    path = Path(path)
    steps, ids = [], []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            header = json.loads(np.load(f, allow_pickle=False).tobytes())
        except (ValueError, EOFError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: byte 0: not a row trace header ({e})") from None
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise ValueError(f"{path}: byte 0: format {header.get('format')!r} version {header.get('version')!r}, "
                             f"expected {FORMAT!r} version {VERSION}")
        width = 3 + 2 * len(header["layer_ids"])
        while f.tell() < size:
            at = f.tell()
            try:
                s = np.load(f, allow_pickle=False)
                i = np.load(f, allow_pickle=False)
            except (ValueError, EOFError) as e:
                raise ValueError(f"{path}: byte {at}: truncated or malformed chunk ({e})") from None
            if s.ndim != 2 or s.shape[1] != width or i.size != int(s[:, 3 + len(header["layer_ids"]):].sum()):
                raise ValueError(f"{path}: byte {at}: chunk of steps {s.shape} and {i.size} ids does not match "
                                 f"{width} columns")
            steps.append(s)
            ids.append(i.astype(np.int64))
    return RowTrace(header, np.concatenate(steps) if steps else np.empty((0, width), np.int64),
                    np.concatenate(ids) if ids else np.empty(0, np.int64))
