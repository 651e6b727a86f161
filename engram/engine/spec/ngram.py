"""The n-gram proposer (prompt lookup, engine side, CPU): match the last n tokens of a sequence against everything
before them, longest n first (``prompt_lookup_max`` down to ``prompt_lookup_min``), and propose the tokens that
followed an earlier occurrence (the latest with K tokens after it). No model, no device work: the drafts are ordinary token ids when the step
is packed, so the verify step's Engram rows are planned (and fetched ahead) like any other token's."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"NgramProposer: need 1 <= prompt_lookup_min={prompt_lookup_min} <= "
                             f"prompt_lookup_max={prompt_lookup_max}")
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int) -> tuple[int, int]:
        """The span [start, stop) of ``token_ids`` to propose: up to ``max_drafts`` tokens that followed an earlier
        occurrence of the longest matching suffix (n from n_max down to n_min) — the latest one with ``max_drafts``
        tokens after it, else the earliest; (0, 0) when none matches. A span, not ids: the engine takes the drafts'
        compressed ids from the same positions."""
        if max_drafts < 1 or len(token_ids) < self.n_min + 1:
            return 0, 0
        ids = np.asarray(token_ids, dtype=np.int64)  # [L]
        size = ids.size
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            # windows[i] = ids[i:i+n] for every start whose window ends before the suffix's last token
            windows = sliding_window_view(ids[:size - 1], n)  # [L - n, n]
            hits = np.flatnonzero((windows == ids[size - n:]).all(axis=1))
            if hits.size:
                # the latest match followed by max_drafts tokens, else the earliest (the longest continuation)
                full = hits[hits + n + max_drafts <= size]
                start = int(full[-1] if full.size else hits[0]) + n
                return start, min(start + max_drafts, size)
        return 0, 0
