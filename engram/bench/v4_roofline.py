"""Roofline of a DeepSeek-V4 decode step (roofline.py counts dense decoders): the least bytes one decode step of B
sequences must move, each once, at the copy bandwidth measured in the same run (``roofline.roofline``).

Bytes: every weight once, except that the routed experts count only the union the step's router chose in each layer
(``experts`` [layer]: distinct experts over the step's tokens) and the embedding only the step's rows (the LM head
whole); per sequence and layer the sliding window's keys its query reads (min(p, W-1), p its position) and its new
key written; in CSA layers all of the indexer's keys and the top-k entries it keeps (min(index_topk, entries)); in
HCA layers all entries (entries = (p + 1) // ratio, what the query sees); the Engram rows as stored (over the host
link on tier "host"). FLOPs: 2 x the weights a token multiplies by (everything but the routed experts, plus top-k
experts of each layer) per token, and the LM head. Compressor buffers and overlap slices (under ratio tokens a
sequence) and the router's tables are left out: a lower bound, as for the dense decoders."""
from __future__ import annotations

from dataclasses import dataclass

from engram.bench.roofline import StepCost
from engram.model.deepseek_v4.config import CSA, HCA, V4Config

__all__ = ["RoutingProbe", "V4Weights", "decode_cost", "v4_weights"]


@dataclass(frozen=True)
class V4Weights:
    """A V4 model's weights split the way the roofline reads them (bytes in their stored dtypes)."""

    dense_bytes: int  # every parameter but the routed experts and the embedding
    dense_params: int  # of which matmul-ish parameters a token is multiplied by (all of them but the LM head)
    embed_row_bytes: int  # one embedding row
    head_params: int  # LM head parameters (its FLOPs are counted per sampled row)
    expert_bytes: tuple[int, ...]  # per layer: one routed expert's bytes
    expert_params: tuple[int, ...]  # per layer: one routed expert's parameters


def v4_weights(model) -> V4Weights:
    """Split a DeepseekV4 causal LM's parameters (any device, meta included) by name: ``model.layers.L.ffn.experts.*``
    are the routed experts (``n_routed_experts`` of them in each layer), ``model.embed.weight`` the embedding, ``head``
    the LM head."""
    cfg = model.config
    experts_b, experts_p = [0] * cfg.num_layers, [0] * cfg.num_layers
    dense_b = dense_p = embed_row = head = 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if ".ffn.experts." in name:
            layer = int(parts[parts.index("layers") + 1])
            experts_b[layer] += p.numel() * p.element_size()
            experts_p[layer] += p.numel()
        elif name.endswith("embed.weight"):
            embed_row = p.shape[1] * p.element_size()
        else:
            dense_b += p.numel() * p.element_size()
            if name.startswith("head."):
                head += p.numel()
            else:
                dense_p += p.numel()
    e = cfg.n_routed_experts
    return V4Weights(dense_b, dense_p, embed_row, head, tuple(b // e for b in experts_b),
                     tuple(n // e for n in experts_p))


def decode_cost(cfg: V4Config, weights: V4Weights, positions: list[int], experts: list[int], itemsize: int,
                tier: str | None = "gpu") -> StepCost:
    """One decode step of ``len(positions)`` sequences, each decoding the token at its position p; ``experts``: the
    routed experts chosen in each layer (the union over the step's tokens); ``itemsize``: the caches' dtype."""
    if len(experts) != cfg.num_layers:
        raise ValueError(f"experts lists {len(experts)} layers, the model has {cfg.num_layers}")
    b, ring = len(positions), cfg.sliding_window - 1
    routed = sum(n * w for n, w in zip(experts, weights.expert_bytes))
    weight_bytes = weights.dense_bytes + routed + b * weights.embed_row_bytes
    keys = 0  # cache entries read or written, in units of head_dim / index_head_dim elements
    index_keys = 0
    for layer in range(cfg.num_layers):
        kind, ratio = cfg.layer_types[layer], cfg.ratio(layer)
        for p in positions:
            keys += min(p, ring) + 1
            if kind == CSA:
                entries = (p + 1) // ratio
                index_keys += entries
                keys += min(cfg.index_topk, entries)
            elif kind == HCA:
                keys += (p + 1) // ratio
    kv_bytes = (keys * cfg.head_dim + index_keys * cfg.index_head_dim) * itemsize
    e = cfg.engram
    engram_bytes = b * e.n_cols * e.row_bytes * len(e.layer_ids) if e is not None else 0
    on_link = e is not None and tier == "host"
    per_token = weights.dense_params + cfg.num_experts_per_tok * sum(weights.expert_params)
    flops = 2 * b * (per_token + weights.head_params)
    return StepCost(weight_bytes=weight_bytes, kv_bytes=kv_bytes, engram_bytes=engram_bytes,
                    memory_bytes=weight_bytes + kv_bytes + (0 if on_link else engram_bytes),
                    link_bytes=engram_bytes if on_link else 0, flops=flops)


class RoutingProbe:
    """``measure_decode``'s probe over an in-process engine of a DeepSeek-V4 model: runs one more decode step of the
    batch on the Worker's eager runner alone (graph replays run no Python hooks), with a forward hook on every layer's
    router (``ffn.gate``: (weights, expert ids [T, k])), and keeps ``experts``: the distinct experts chosen per layer
    in that step. Every timed step's roofline uses them: the same sequences, a few tokens on (after the timed and
    profiled steps)."""

    def __init__(self, engine):
        self.engine, self.experts = engine, None

    def __call__(self, step) -> None:
        worker = self.engine.executor.worker
        layers = worker.model.model.layers
        seen: list[set[int]] = [set() for _ in layers]
        hooks = [layer.ffn.gate.register_forward_hook(
            lambda mod, args, out, chosen=chosen: chosen.update(out[1].unique().tolist()))
            for layer, chosen in zip(layers, seen)]
        runners = worker.runners
        worker.runners = [r for r in runners if r.name == "eager"]
        try:
            step()
        finally:
            worker.runners = runners
            for h in hooks:
                h.remove()
        if not all(seen):
            raise RuntimeError(f"the routing probe's step ran no router in layers "
                               f"{[i for i, c in enumerate(seen) if not c]}: no forward was launched on the eager path")
        self.experts = [len(chosen) for chosen in seen]
