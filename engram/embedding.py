"""EngramEmbedding: a trainable in-memory Engram table addressed by ``NgramHasher``'s global row ids, for
training end to end; serving reads the same ids from ``engram.store`` tiers.
"""
from __future__ import annotations

import torch
from torch import nn

from engram.config import EngramConfig
from engram.quant import ROW_TORCH_DTYPES, quantize_mxfp8


class EngramEmbedding(nn.Module):
    """Trainable table of one Engram layer: ``weight`` [table_rows, head_dim] (float32 unless ``dtype``).

    ``check_bounds`` validates row ids on every call (one host sync on GPU); turn it off in training loops
    whose ids come straight from ``NgramHasher``.
    """

    def __init__(self, cfg: EngramConfig, layer_id: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, init_std: float = 1.0, check_bounds: bool = True):
        super().__init__()
        if init_std < 0:
            raise ValueError(f"EngramEmbedding.init_std={init_std} must be >= 0")
        self.cfg, self.layer_id = cfg, layer_id
        self.num_rows = cfg.table_rows(layer_id)  # raises ValueError for a non-Engram layer
        self.check_bounds = check_bounds
        self.embedding = nn.Embedding(self.num_rows, cfg.head_dim, dtype=dtype, device=device)
        nn.init.normal_(self.embedding.weight, std=init_std)

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        """row_ids [..., n_cols] int64 global rows -> [..., n_cols, head_dim] in the table's dtype."""
        if row_ids.shape[-1:] != (self.cfg.n_cols,):
            raise ValueError(f"EngramEmbedding layer {self.layer_id}: row_ids has shape {tuple(row_ids.shape)}, "
                             f"expected [..., n_cols={self.cfg.n_cols}]")
        if self.check_bounds and row_ids.numel():
            lo, hi = torch.stack([row_ids.min(), row_ids.max()]).tolist()  # one host sync
            if lo < 0 or hi >= self.num_rows:
                raise ValueError(f"EngramEmbedding layer {self.layer_id}: row ids span [{lo}, {hi}] but the "
                                 f"table has {self.num_rows} rows")
        return self.embedding(row_ids)

    @torch.no_grad()
    def export_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The table in ``cfg.row_dtype`` for ``engram.store.write_table``: (values [R, D], scales or None).

        MXFP8 gives float8_e4m3fn values and uint8 scales [R, D/32]; other dtypes give (values, None).
        """
        w = self.embedding.weight.detach()
        if self.cfg.row_dtype == "mxfp8":
            return quantize_mxfp8(w)
        return w.to(ROW_TORCH_DTYPES[self.cfg.row_dtype]).clone(), None
