"""Tokens in flight (worker side of async scheduling): a step's inputs that the previous step sampled. The Worker keeps
the last launched step's sampled ids (``remember``) and turns a description's ``pending_*`` references into a
``PendingPatch`` of device tensors (rows, raw ids, Engram row ids finished by ``NgramHasher.hash_pending``, DEAD flags).
It is applied on the same stream after the inputs are uploaded and before anything reads them: no host synchronisation,
and the rows equal what the engine would have planned."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engram.engine.step import StepDescription
from engram.hashing import DEAD, NgramHasher
from engram.transfer import to_device


@dataclass
class PendingPatch:
    """Device tensors that replace a step's placeholders (P pending rows)."""

    rows: torch.Tensor  # [P] int64 packed rows
    token_ids: torch.Tensor  # [P] int64 raw ids (the previous step's sampled tokens)
    row_ids: dict[int, torch.Tensor]  # Engram layer id -> [P, n_cols] int64 row ids
    dead: torch.Tensor | None  # [P] bool DEAD tokens (None: the model has no DEAD ids)

    def patched(self, values: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """``values`` [T, ...] with rows ``rows`` replaced by ``fill`` [P, ...] (a new tensor)."""
        return values.index_copy(0, self.rows, fill)


KEPT_STEPS = 64  # relayed steps' ids kept at most (a pipeline needs the few of its microbatches in flight)


class PendingTokens:
    """The last launched step's sampled ids on the device, and the patches that consume them."""

    def __init__(self, hasher: NgramHasher | None, compress_map: np.ndarray | None, dead_token_ids,
                 device: torch.device):
        self.hasher = hasher
        self.device = torch.device(device)
        self.has_dead = bool(dead_token_ids)
        self._map = None
        if compress_map is not None:
            mapping = np.array(compress_map, dtype=np.int64)  # [vocab] raw id -> compressed id
            mapping[list(dead_token_ids)] = DEAD
            self._map = torch.from_numpy(mapping).to(self.device)
        self._step_id = -1
        self._tokens: torch.Tensor | None = None
        # a pipeline stage: ids of earlier steps, sampled on the last stage and relayed here (``keep``), by step id
        self._kept: dict[int, torch.Tensor] = {}

    @property
    def device_map(self) -> torch.Tensor | None:
        """[vocab] int64 on the device: raw id -> compressed id, DEAD ids -1 (None without Engram)."""
        return self._map

    @property
    def last_step_id(self) -> int:
        """The last step launched on this Worker (-1 before the first)."""
        return self._step_id

    def remember(self, step_id: int, token_ids: torch.Tensor) -> None:
        """The tokens [N] a launched step sampled (on the device; read by the engine later, or never)."""
        self._step_id, self._tokens = step_id, token_ids

    def keep(self, step_id: int, token_ids: torch.Tensor) -> None:
        """The tokens [N] step ``step_id`` sampled elsewhere (a pipeline's last stage: parallel/pp_relay.py), for the
        step that names it as its ``pending_step_id``; the oldest beyond KEPT_STEPS are forgotten."""
        self._kept[step_id] = token_ids
        while len(self._kept) > KEPT_STEPS:
            del self._kept[next(iter(self._kept))]

    def has(self, step_id: int) -> bool:
        """Whether step ``step_id``'s tokens are here (kept, or the last launched step's)."""
        return step_id in self._kept or self._own(step_id) is not None

    def _own(self, step_id: int) -> torch.Tensor | None:
        """The last launched step's tokens if it is ``step_id`` and sampled here (a stage before a pipeline's last
        samples nothing: its steps' ids come relayed, through ``keep``)."""
        own = self._tokens if step_id == self._step_id else None
        return own if own is not None and own.numel() else None

    def patch(self, step: StepDescription) -> PendingPatch | None:
        """The device patch of ``step``'s pending rows (None without); RuntimeError if they are neither the last
        step's nor a kept step's."""
        if not step.pending_rows:
            return None
        source = self._kept.get(step.pending_step_id)
        if source is None:
            source = self._own(step.pending_step_id)
        if source is None:
            raise RuntimeError(f"step {step.step_id}: its pending tokens come from step {step.pending_step_id}, "
                               f"but the last step launched on this Worker is {self._step_id}")
        sources, rows = to_device([step.pending_sources, step.pending_rows], self.device)  # one upload, [2, P]
        tokens = source[sources]  # [P]
        row_ids, dead = {}, None
        if self.hasher is not None:
            compressed = self._map[tokens]  # [P], DEAD = -1
            hashed = self.hasher.hash_pending(compressed, to_device(step.pending_partials, self.device))
            row_ids = {lid: hashed[i] for i, lid in enumerate(self.hasher.cfg.layer_ids)}
            dead = compressed == DEAD if self.has_dead else None
        return PendingPatch(rows, tokens, row_ids, dead)
