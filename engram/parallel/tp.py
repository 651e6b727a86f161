"""Tensor parallelism applied around the single-device EngramDecoder after construction (gpt-fast's tp.py shape): the
model file knows no ranks. ``apply_tensor_parallel(model, rank, world, group)`` shards the weights in place, before any
projection packing, and hooks one all-reduce after each row-parallel block; ``local_model_config`` is the config a
rank's KV cache is sized from. The Engram modules stay whole here (``wkv`` replicated: keys and values bitwise TP1's);
their tables are sharded by hash column in engram_tp.py, and ``wkv_tp: "column"`` splits ``wkv`` in wkv_column.py.

Head shards of a layer, TP2 with 4 query heads and 2 KV heads (rank r holds q heads [2r, 2r+2), KV head r):

    q_proj rows   | q0 q1 | q2 q3 |      o_proj cols  | q0 q1 | q2 q3 |  -> partial [T, H] -> all-reduce
    k/v_proj rows |  kv0  |  kv1  |      (kv_heads < N: each rank keeps the one KV head its q heads read)
    rank            0       1

The MLP is column-parallel (gate/up rows) then row-parallel (down columns, one all-reduce). The embedding is
vocab-parallel (a rank's rows, zeros elsewhere, one all-reduce); the LM head is vocab-parallel too, its logits
all-gathered so every rank samples the same full row. Reductions run in float64 or float32 (gloo has no bf16 sum
here); the split-K partials of the o/down projections are off at TP > 1 (the hooks pass ``partials=False``)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engram.model.decoder import EngramDecoder
from engram.model.model_config import ModelConfig

# the modules whose parameters are split over ranks (parameter_bytes counts these)
SHARDED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")
REDUCE_DTYPES = (torch.float64, torch.float32)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over the group, in float32 unless it is float64 or float32 already; same dtype back."""
    wide = x if x.dtype in REDUCE_DTYPES else x.float()
    dist.all_reduce(wide, group=group)
    return wide if wide.dtype == x.dtype else wide.to(x.dtype)


def warm_up_collectives(group, device: torch.device) -> None:
    """One collective of each kind the steps issue (all-reduce, all-gather, broadcast) on ``group``, on the current
    stream, before any CUDA graph is captured: NCCL makes its communicator at a group's first collective, which no
    capture may contain. Each size a graph holds then runs once eagerly in that graph's warm-up, just before its
    capture (runners/decode_inputs.py ``warm_up``); every rank captures the same buckets in the same order (the
    buckets come from the shared EngineConfig)."""
    x = torch.ones(8, dtype=torch.float32, device=device)
    dist.all_reduce(x, group=group)
    dist.all_gather([torch.empty_like(x) for _ in range(dist.get_world_size(group))], x, group=group)
    dist.broadcast(torch.zeros(8, dtype=torch.long, device=device), group=group, group_src=0)


def kv_heads_of(num_heads: int, num_kv_heads: int, rank: int, world: int) -> range:
    """The KV heads rank ``rank`` holds: its 1/N share when num_kv_heads >= N, else the one its query heads read."""
    if num_kv_heads >= world:
        n = num_kv_heads // world
        return range(rank * n, (rank + 1) * n)
    first_q = rank * (num_heads // world)
    return range(first_q // (num_heads // num_kv_heads), first_q // (num_heads // num_kv_heads) + 1)


def check_tp(cfg: ModelConfig, world: int) -> None:
    """ValueError naming the field when ``cfg`` cannot be split over ``world`` ranks."""
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor_parallel_size={world!r}: must be an int >= 1")
    if cfg.num_heads % world:
        raise ValueError(f"model.num_heads={cfg.num_heads} does not divide over tensor_parallel_size={world}")
    if cfg.num_kv_heads >= world and cfg.num_kv_heads % world:
        raise ValueError(f"model.num_kv_heads={cfg.num_kv_heads} does not divide over tensor_parallel_size={world}")
    if cfg.num_kv_heads < world and world % cfg.num_kv_heads:
        raise ValueError(f"model.num_kv_heads={cfg.num_kv_heads} < tensor_parallel_size={world} must divide it "
                         "(each rank then keeps one KV head)")
    if cfg.intermediate_size % world:
        raise ValueError(f"model.intermediate_size={cfg.intermediate_size} does not divide over "
                         f"tensor_parallel_size={world}")


def local_model_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The head counts one rank holds (its KV cache is sized from them)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world,
                               num_kv_heads=len(kv_heads_of(cfg.num_heads, cfg.num_kv_heads, 0, world)))


def apply_tensor_parallel(model: EngramDecoder, rank: int, world: int, group=None) -> EngramDecoder:
    """Shard ``model`` in place for rank ``rank`` of ``world`` (collectives on ``group``); returns it."""
    cfg = model.config
    check_tp(cfg, world)
    if world == 1:
        return model
    held = model.held_layers  # a pipeline stage's layers (decoder.keep_layers), else all
    for layer in model.model.layers[held.start:held.stop]:
        if layer.self_attn.qkv is not None or layer.mlp.gate_up is not None:
            raise ValueError(f"layer {layer.layer_id}: projections are packed; shard before pack_projections()")
        _shard_attention(layer.self_attn, cfg, rank, world, group)
        _shard_mlp(layer.mlp, rank, world, group)
    embed = None
    if model.model.embed_tokens is not None:  # the first stage's (and a tied LM head's)
        embed = VocabParallelEmbedding(model.model.embed_tokens.weight, rank, world, group)
        model.model.embed_tokens = embed
    if model.lm_head is not None:  # the last stage's
        head_weight = embed.weight if cfg.tie_word_embeddings else _vocab_rows(model.lm_head.weight, rank, world)
        model.lm_head = VocabParallelLMHead(head_weight, cfg.padded_vocab_size, world, group)
    return model


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """{"sharded": bytes of the SHARDED modules' parameters, "wkv": of the Engram ``wkv`` projections (whole unless
    ``wkv_tp`` is "column"), "total": every parameter} (tied weights once)."""
    seen: set[int] = set()
    out = {"sharded": 0, "wkv": 0, "total": 0}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel() * p.element_size()
            out["total"] += n
            if name.rsplit(".", 1)[-1] in SHARDED:
                out["sharded"] += n
            if name.rsplit(".", 1)[-1] == "wkv":
                out["wkv"] += n
    return out


# ----------------------------------------------------------------- the shards
def _rows(linear: nn.Linear, index: torch.Tensor) -> None:
    """Keep output rows ``index`` of ``linear`` (column parallel)."""
    linear.weight = nn.Parameter(linear.weight.detach()[index].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[index].contiguous(), requires_grad=False)
    linear.out_features = len(index)


def _cols(linear: nn.Linear, index: torch.Tensor, rank: int) -> None:
    """Keep input columns ``index`` of ``linear`` (row parallel); the bias stays on rank 0 only (added once)."""
    linear.weight = nn.Parameter(linear.weight.detach()[:, index].contiguous(), requires_grad=False)
    if linear.bias is not None and rank:
        linear.bias = nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)
    linear.in_features = len(index)


def _head_index(heads: range, head_dim: int, device) -> torch.Tensor:
    """Rows of heads ``heads`` in a [n_heads * head_dim, ...] projection."""
    return torch.arange(heads.start * head_dim, heads.stop * head_dim, device=device)


def _shard_attention(attn: nn.Module, cfg: ModelConfig, rank: int, world: int, group) -> None:
    nq = cfg.num_heads // world
    dev = attn.q_proj.weight.device
    q_index = _head_index(range(rank * nq, (rank + 1) * nq), cfg.head_dim, dev)
    _rows(attn.q_proj, q_index)
    kv = kv_heads_of(cfg.num_heads, cfg.num_kv_heads, rank, world)
    if attn.owns_kv:
        kv_index = _head_index(kv, cfg.head_dim, dev)
        _rows(attn.k_proj, kv_index)
        _rows(attn.v_proj, kv_index)
    _cols(attn.o_proj, q_index, rank)
    attn.num_heads, attn.num_kv_heads = nq, len(kv)
    _reduce_after(attn, group)


def _shard_mlp(mlp: nn.Module, rank: int, world: int, group) -> None:
    n = mlp.intermediate_size // world
    index = torch.arange(rank * n, (rank + 1) * n, device=mlp.gate_proj.weight.device)
    _rows(mlp.gate_proj, index)
    _rows(mlp.up_proj, index)
    _cols(mlp.down_proj, index, rank)
    mlp.intermediate_size = n
    _reduce_after(mlp, group)


def _reduce_after(module: nn.Module, group) -> None:
    """The row-parallel block's output [T, H] is a partial sum: dense (no split-K partials), then all-reduced."""
    def dense_only(_module, args, kwargs):
        return args, {**kwargs, "partials": False}

    module.register_forward_pre_hook(dense_only, with_kwargs=True)
    module.register_forward_hook(lambda _module, _args, out: all_reduce(out, group))


def _vocab_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    chunk = -(-rows // world)
    return min(rows, rank * chunk), min(rows, (rank + 1) * chunk)


def _vocab_rows(weight: torch.Tensor, rank: int, world: int) -> nn.Parameter:
    lo, hi = _vocab_range(weight.shape[0], rank, world)
    return nn.Parameter(weight.detach()[lo:hi].contiguous(), requires_grad=False)


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the padded vocabulary; an id outside them embeds to zeros, and the all-reduce adds the one
    rank's row to zeros (exact)."""

    def __init__(self, weight: torch.Tensor, rank: int, world: int, group):
        super().__init__()
        self.lo, self.hi = _vocab_range(weight.shape[0], rank, world)
        self.weight = _vocab_rows(weight, rank, world)  # [hi - lo, H]
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)  # [T]
        local = (ids - self.lo).clamp(0, max(self.hi - self.lo - 1, 0))
        x = F.embedding(local, self.weight)  # [T, H]
        x = torch.where(mine.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
        return all_reduce(x, self.group)


class VocabParallelLMHead(nn.Module):
    """This rank's vocabulary rows [V/N, H] (the embedding's when tied); logits [N, V/N] all-gathered to [N, V]."""

    def __init__(self, weight: nn.Parameter, padded_vocab: int, world: int, group):
        super().__init__()
        self.weight = weight
        self.padded_vocab, self.chunk, self.world, self.group = padded_vocab, -(-padded_vocab // world), world, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)  # [N, hi - lo]
        if local.dtype not in REDUCE_DTYPES:
            local = local.float()
        local = F.pad(local, (0, self.chunk - local.shape[1]))  # [N, chunk]: equal sizes for the all-gather
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, : self.padded_vocab].to(hidden.dtype)  # [N, V]
