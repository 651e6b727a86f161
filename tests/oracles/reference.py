"""Synchronous reference driving of a LoadedModel: rows looked up inline, one sequence at a time.

``StepRows`` is the simplest ``engram_rows`` provider (hash the step, gather each layer's rows when the
layer asks); ``greedy_generate`` runs sequences alone through prefill + decode with their own KV cache.
No scheduler, no prefetch, no batching: it is what the engine's outputs are checked against, so it is a
test oracle and lives under tests/ (nothing in the package imports it).
"""
from __future__ import annotations

import torch

from engram.hashing import NgramHasher
from engram.model.inputs import make_step_inputs
from engram.model.kv_cache import KVCache


class StepRows:
    """``engram_rows`` for one step: compressed ids [T] (DEAD = -1), cu_seqlens [S+1] and each sequence's
    lookback [S, max_ngram-1] -> callable layer_id -> rows [T, n_cols, head_dim] in ``dtype``."""

    def __init__(self, tables: dict, hasher: NgramHasher, compressed_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                 lookback: torch.Tensor, dtype: torch.dtype):
        self.tables, self.dtype = tables, dtype
        self.row_ids = hasher.hash_step_reference(compressed_ids, cu_seqlens,
                                                  lookback)[0]  # torch code: {layer: [T, n_cols]}

    def __call__(self, layer_id: int) -> torch.Tensor:
        ids = self.row_ids[layer_id]  # [T, n_cols]
        # float64 models gather float32 and widen: exact for every row dtype, and not every gather kernel
        # (the Triton one) emits float64.
        wide = self.dtype == torch.float64
        rows = self.tables[layer_id].gather(ids.reshape(-1), dtype=torch.float32 if wide else self.dtype)
        return rows.to(self.dtype).view(ids.shape[0], ids.shape[1], -1)  # [T*n_cols, D] -> [T, n_cols, D]


def hasher_for(loaded) -> NgramHasher:
    """The NgramHasher of a LoadedModel (pad id compressed through its tokenizer)."""
    return NgramHasher.from_tokenizer(loaded.engram_config, loaded.compressed_tokenizer)


@torch.no_grad()
def prefill_logits(loaded, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of every position of one sequence, in one prefill step."""
    model, device = loaded.model, loaded.device
    n_blocks = -(-len(token_ids) // block_size)
    kv = KVCache.for_model(model.config, n_blocks, block_size, loaded.dtype, device)
    fields = engram_fields(loaded, token_ids, [], device, new_conv_states(loaded))
    step = make_step_inputs([token_ids], [0], [list(range(n_blocks))], block_size, fields.pop("engram_rows"),
                            device=device, logits_indices=torch.arange(len(token_ids), device=device), **fields)
    return model.compute_logits(model(step, kv))


def new_conv_states(loaded) -> dict | None:
    """Fresh single-sequence ShortConv states of a paper-variant model ({layer_id: state}); None for v41."""
    layers = loaded.model.engram_layers
    if not layers or not next(iter(layers.values())).has_state:
        return None
    return {lid: layer.new_state(1, dtype=loaded.dtype, device=loaded.device) for lid, layer in layers.items()}


def engram_fields(loaded, new_ids: list[int], past_ids: list[int], device, conv_state=None,
                  hasher: NgramHasher | None = None) -> dict:
    """engram_rows / dead_mask / conv_state of a single-sequence step whose earlier tokens were ``past_ids``
    (only the last max_ngram_size - 1 are read). ``hasher``: ``hasher_for(loaded)``, made here if None."""
    ecfg = loaded.engram_config
    if ecfg is None:
        return {"engram_rows": None}
    hasher = hasher or hasher_for(loaded)
    dead = ecfg.dead_token_ids
    window = ecfg.max_ngram_size - 1
    recent = past_ids[len(past_ids) - window:] if len(past_ids) > window else past_ids  # compress is per token
    comp_past = loaded.compressed_tokenizer.compress(torch.tensor(recent, dtype=torch.long), dead)
    lookback = torch.cat([hasher.initial_lookback(1)[0], comp_past.to(torch.long)])[-window:].unsqueeze(0)
    ids = torch.tensor(new_ids, dtype=torch.long)
    comp = loaded.compressed_tokenizer.compress(ids, dead).to(torch.long)
    cu = torch.tensor([0, len(new_ids)], dtype=torch.long)
    rows = StepRows(loaded.open_tables(), hasher, comp.to(device), cu.to(device), lookback.to(device), loaded.dtype)
    dead_mask = (comp == -1).to(device) if dead else None
    return {"engram_rows": rows, "dead_mask": dead_mask, "conv_state": conv_state}


@torch.no_grad()
def greedy_generate(loaded, prompt_ids: list[int], max_new_tokens: int, block_size: int = 16,
                    stop_at_eos: bool = True) -> list[int]:
    """Greedy continuation of one prompt: a prefill step, then one decode step per new token."""
    model, device = loaded.model, loaded.device
    total = len(prompt_ids) + max_new_tokens
    n_blocks = -(-total // block_size)
    kv = KVCache.for_model(model.config, n_blocks, block_size, loaded.dtype, device)
    table = [list(range(n_blocks))]
    seq, new, out = list(prompt_ids), list(prompt_ids), []
    past, states = 0, new_conv_states(loaded)  # paper variant: conv history carried across steps
    hasher = hasher_for(loaded) if loaded.engram_config is not None else None  # one per sequence, not per step
    for _ in range(max_new_tokens):
        fields = engram_fields(loaded, new, seq[:past], device, states, hasher)
        step = make_step_inputs([new], [past], table, block_size, fields.pop("engram_rows"), device=device, **fields)
        tok = int(model.compute_logits(model(step, kv)).argmax(-1)[0])
        past = len(seq)
        seq.append(tok)
        out.append(tok)
        new = [tok]
        if stop_at_eos and tok == loaded.eos_token_id:
            break
    return out
