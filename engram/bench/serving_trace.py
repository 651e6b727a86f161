"""The Engram row accesses of a corpus served by a continuous-batching engine, one trace per Engram layer.
``serving_schedule``: at most ``concurrency`` requests at once, in corpus order; a request admitted at step a prefills
whole at a, then feeds continuation token i at step a + 1 + i. ``layer_traces``: like the engine's plan, a step reads
each distinct row once, ascending; each access also has its n-gram order."""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass
class ServingSchedule:
    admit: np.ndarray  # [R] step at which each request is admitted and prefilled
    token_step: np.ndarray  # [T] step of every token, corpus order (request by request, prompt then continuation)
    steps: int

    def tokens_per_step(self) -> np.ndarray:
        """[steps] tokens fed at each step."""
        return np.bincount(self.token_step, minlength=self.steps)


def serving_schedule(prompt_lens: np.ndarray, continuation_lens: np.ndarray, concurrency: int) -> ServingSchedule:
    """Steps of the serving model above; ValueError naming the value for concurrency < 1 or an empty prompt."""
    p = np.asarray(prompt_lens, dtype=np.int64)
    c = np.asarray(continuation_lens, dtype=np.int64)
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: must be >= 1")
    if p.shape != c.shape or (p.size and p.min() < 1) or (c.size and c.min() < 0):
        raise ValueError(f"prompt lengths {p.tolist()[:8]} / continuation lengths {c.tolist()[:8]}: need equal "
                         f"counts, prompts >= 1 token, continuations >= 0")
    free = [0] * concurrency  # step from which each slot is free
    admit = np.empty(p.size, dtype=np.int64)
    last = 0
    for r in range(p.size):
        last = max(heapq.heappop(free), last)  # first come, first served
        admit[r] = last
        heapq.heappush(free, last + 1 + int(c[r]))
    lens = p + c
    start = np.concatenate([[0], np.cumsum(lens)[:-1]])  # first token of each request
    req = np.repeat(np.arange(p.size), lens)
    pos = np.arange(int(lens.sum())) - start[req]  # position inside the request
    token_step = admit[req] + np.maximum(pos - p[req] + 1, 0)  # prompt: admit; continuation i: admit + 1 + i
    steps = int(token_step.max()) + 1 if token_step.size else 0
    return ServingSchedule(admit=admit, token_step=token_step, steps=steps)


@dataclass
class LayerTrace:
    layer_id: int
    table_rows: int
    rows: np.ndarray  # [A] row ids: step after step, distinct and ascending within a step
    order: np.ndarray  # [A] n-gram order of each access (its column's)
    step_bounds: np.ndarray  # [steps + 1] index of each step's first access
    tokens_per_step: np.ndarray  # [steps]
    text_rows: np.ndarray  # [T, n_cols] every token's rows in corpus order (request after request), no dedup
    n_heads: int  # columns per n-gram order

    @property
    def lookups(self) -> int:
        """Row lookups before the per-step dedup: tokens x n_cols."""
        return int(self.text_rows.size)

    @property
    def accesses(self) -> int:
        return int(self.rows.size)


def compressed_sequences(encoded: list[tuple[np.ndarray, np.ndarray]], ctok, dead_token_ids=()) -> list[np.ndarray]:
    """Each request's prompt + continuation as one sequence of compressed ids (DEAD = -1)."""
    return [ctok.compress(np.concatenate([p, c]), dead_token_ids) for p, c in encoded]


def layer_traces(sequences: list[np.ndarray], schedule: ServingSchedule, hasher) -> list[LayerTrace]:
    """One ``LayerTrace`` per Engram layer of ``hasher.cfg`` for ``sequences`` served by ``schedule``."""
    import torch

    cfg = hasher.cfg
    ids = torch.from_numpy(np.concatenate(sequences).astype(np.int64))
    cu = torch.tensor(np.concatenate([[0], np.cumsum([s.size for s in sequences])]), dtype=torch.int64)
    if int(cu[-1]) != schedule.token_step.size:
        raise ValueError(f"sequences hold {int(cu[-1])} tokens but the schedule {schedule.token_step.size}")
    rows_by_layer = hasher.hash_packed_all(ids, cu, hasher.initial_lookback(len(sequences)))
    tokens_per_step = schedule.tokens_per_step()
    out = []
    for lid in cfg.layer_ids:
        text_rows = rows_by_layer.pop(lid).numpy()  # [T, n_cols]
        n_rows = cfg.table_rows(lid)
        step = np.repeat(schedule.token_step, cfg.n_cols)
        keys = step * n_rows + text_rows.reshape(-1)
        keys.sort()  # by (step, row); np.unique's hash path is ~10x slower on these sizes
        keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]  # distinct within a step
        del step
        step, row = np.divmod(keys, n_rows)
        del keys
        col = np.searchsorted(np.asarray(cfg.column_offsets(lid)), row, side="right") - 1
        out.append(LayerTrace(
            layer_id=lid, table_rows=n_rows, rows=row, order=(col // cfg.n_heads + 2).astype(np.int8),
            step_bounds=np.searchsorted(step, np.arange(schedule.steps + 1)), tokens_per_step=tokens_per_step,
            text_rows=text_rows, n_heads=cfg.n_heads))
    return out
