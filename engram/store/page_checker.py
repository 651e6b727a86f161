"""``PageChecker``: a table's page CRCs held in RAM (the disk tier) and the check of the pages a read returned
(the sidecar's format: page_crc.py); ``target``: "ram", or the node's shared copy (shared_host.py)."""
from __future__ import annotations

import numpy as np
import torch

from engram.store.format import TableManifest
from engram.store.load import HostTarget, load_file
from engram.store.page_crc import bad_pages, missing_page_crcs_error, page_error


class PageChecker:
    """The page CRCs of one table (uint32 [pages], resident) and the check of the pages a read returned."""

    def __init__(self, m: TableManifest, verify: bool = True, target: HostTarget = "ram") -> None:
        if not m.has_page_crcs:
            raise missing_page_crcs_error(m)
        self.path = m.values_path
        self.page_size = m.page_size
        raw = load_file(m, "page_crc", target, verify)  # uint8 [pages * 4], its chunk CRC32s checked
        self.crcs = raw.numpy().view("<u4").astype(np.uint32, copy=False)  # [pages]

    @property
    def nbytes(self) -> int:
        return self.crcs.nbytes

    def check(self, offsets: np.ndarray, buf: torch.Tensor | np.ndarray, size: int,
              crcs: np.ndarray | None = None) -> None:
        """Return when every page of a read (``buf``: a block of ``size`` bytes per offset; ``crcs``: the reader's) is
        intact, else raise CorruptPageError for the lowest bad page (``bad_pages``: how many)."""
        pages, got = bad_pages(buf.numpy() if isinstance(buf, torch.Tensor) else buf,
                               np.asarray(offsets, dtype=np.int64) // self.page_size, size // self.page_size,
                               self.crcs, self.page_size, got=crcs)
        if len(pages):
            i = int(pages.argmin())
            p = int(pages[i])
            err = page_error(self.path, p, self.page_size, int(self.crcs[p]), int(got[i]))
            err.bad_pages = len(pages)
            raise err
