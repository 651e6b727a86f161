"""DeepSeek-V4's MoE block (every layer): a router scores the routed experts (``sqrtsoftplus`` = sqrt(softplus(z)),
or sigmoid / softmax), picks ``num_experts_per_tok`` of them — by top-k of score + ``gate.bias`` (``moe``), or by the
frozen ``gate.tid2eid[token id]`` table (``hash_moe``) — and weighs them by their scores normalised to sum 1, times
``routed_scaling_factor``; a shared expert is added. Experts are SwiGLU with ``swiglu_limit`` clamps, names as in the
checkpoints: ``ffn.experts.E.w{1,2,3}``, ``ffn.shared_experts.w{1,2,3}``, ``ffn.gate.{weight,bias,tid2eid}``.

The routed experts are stored stacked (``RoutedExperts``: ``w13`` [E, 2I, H], ``w2`` [E, H, I]) and run by
``routed_experts``: one grouped GEMM per projection (``torch._grouped_mm`` over the assignments sorted by expert, no
host read in this code) where the backend takes the dtype and strides, else the plain per-expert loop
(``routed_reference``, the reference the grouped path is tested against)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram.model.deepseek_v4.config import V4Config

# dtypes torch._grouped_mm takes (CPU and CUDA); float64 and the rest run the reference loop
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): V4's clamped SwiGLU, one definition for every path."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Expert(nn.Module):
    """w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit)) (the shared expert)."""

    def __init__(self, hidden: int, inner: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class RoutedExperts(nn.Module):
    """The routed experts' weights, stacked: ``w13`` [E, 2I, H] (rows [0, I) are expert e's ``w1``, rows [I, 2I) its
    ``w3``) and ``w2`` [E, H, I] are the only storage (the two parameters). The state dict shows them per expert
    under the checkpoint names ``E.w1.weight`` [I, H], ``E.w2.weight`` [H, I], ``E.w3.weight`` [I, H], as views of
    the stacks: copying into a state-dict entry (``load_v4_weights``) or ``load_state_dict`` writes the stack, and no
    expert is held twice. The stacks, not per-expert parameters, survive ``.to(dtype / device)`` as one tensor each."""

    def __init__(self, n_experts: int, hidden: int, inner: int, limit: float):
        super().__init__()
        self.n_experts, self.inner, self.limit = n_experts, inner, limit
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * inner, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, inner))
        with torch.no_grad():  # nn.Linear's default bound, 1 / sqrt(fan_in), until weights are loaded
            self.w13.uniform_(-hidden ** -0.5, hidden ** -0.5)
            self.w2.uniform_(-inner ** -0.5, inner ** -0.5)

    def views(self, keep_vars: bool = True) -> dict[str, torch.Tensor]:
        """Checkpoint name (relative to this module) -> the view of the stack holding that expert's weight, in the
        order the per-expert modules had (expert by expert, w1 w2 w3)."""
        w13, w2 = (self.w13, self.w2) if keep_vars else (self.w13.detach(), self.w2.detach())
        i = self.inner
        out = {}
        for e in range(self.n_experts):
            out[f"{e}.w1.weight"], out[f"{e}.w2.weight"], out[f"{e}.w3.weight"] = w13[e, :i], w2[e], w13[e, i:]
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, t in self.views(keep_vars).items():
            destination[prefix + name] = t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        views = self.views(keep_vars=False)
        for name, target in views.items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
            elif tuple(state_dict[key].shape) != tuple(target.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(state_dict[key].shape)}"
                                  f", the shape in current model is {tuple(target.shape)}.")
            else:
                with torch.no_grad():
                    target.copy_(state_dict[key])
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in views)


def grouped_supported(x: torch.Tensor, experts: RoutedExperts) -> bool:
    """Whether ``routed_grouped`` runs for these operands: CPU or CUDA, x and both stacks of one dtype in
    GROUPED_DTYPES, and rows ``torch._grouped_mm`` accepts (it refuses strides that are not a multiple of 16 bytes:
    H and I must be multiples of 16 / itemsize; its output is then dense too)."""
    w13, w2 = experts.w13, experts.w2
    if x.device.type not in ("cpu", "cuda") or x.dtype not in GROUPED_DTYPES:
        return False
    if w13.dtype != x.dtype or w2.dtype != x.dtype or not (w13.is_contiguous() and w2.is_contiguous()):
        return False
    align = 16 // x.element_size()
    return x.shape[-1] % align == 0 and experts.inner % align == 0


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: RoutedExperts) -> torch.Tensor:
    """The routed half of the MoE: out[t] = Σ_j weights[t, j] · expert_{ids[t, j]}(x[t]).

    x [T, H]; weights [T, k] float (cast to x's dtype before multiplying); ids [T, k] int64, every entry in [0, E)
    (the router's top-k or ``tid2eid``; not checked here: a check would read the device) and repeats allowed (a
    token picking one expert twice gets it twice) -> [T, H] in x's dtype. ``routed_grouped`` runs where
    ``grouped_supported``, else ``routed_reference``; the two agree up to the GEMMs' summation order (the unit tests
    state the tolerances) and neither changes its inputs."""
    if grouped_supported(x, experts):
        return routed_grouped(x, weights, ids, experts)
    return routed_reference(x, weights, ids, experts)


def routed_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: RoutedExperts) -> torch.Tensor:
    """The plain torch path (``routed_experts``' contract): a loop over the experts some token picked, each on its
    tokens through w1 / w3 / w2 as separate linears, scattered back with index_add_. Reads the expert list to the
    host (``.tolist()``), so it is not CUDA-graph capturable; it is what float64 runs and the grouped path's oracle."""
    out = torch.zeros_like(x)
    i = experts.inner
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)  # tokens routed to e, and which of their k picks it is
        xe = x[rows]
        h = swiglu(F.linear(xe, experts.w13[e, :i]), F.linear(xe, experts.w13[e, i:]), experts.limit)
        out.index_add_(0, rows, F.linear(h, experts.w2[e]) * weights[rows, slot, None].to(x.dtype))
    return out


def group_offsets(sorted_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Ascending expert ids [M] in [0, E) -> int32 [E], offs[e] = how many are <= e: expert e's rows are
    [offs[e-1], offs[e]) (offs[-1] read as 0), empty for an expert nobody picked, and offs[E-1] = M. searchsorted on the
    device, where bincount would read the ids' max to the host on CUDA."""
    experts = torch.arange(n_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
    return torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)


def routed_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: RoutedExperts) -> torch.Tensor:
    """The grouped-GEMM path (``routed_experts``' contract; operands as ``grouped_supported`` requires). The T·k
    (token, pick) assignments are sorted by expert (stable: token order within an expert), the tokens gathered in
    that order, and each projection is one ``torch._grouped_mm`` over the per-expert row ranges of
    ``group_offsets``; the outputs go back to assignment order by a permutation (index_copy_, no accumulation), are
    weighed, and each token's k picks summed in pick order. No host read in this code: on CUDA, bf16 on sm90 / sm100
    takes torch's grouped kernel (no sync); other dtypes / GPUs take torch's fallback, which reads ``offs`` to the
    host."""
    t, k = ids.shape
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)  # assignment a = token a // k, pick a % k
    offs = group_offsets(sorted_ids, experts.n_experts)
    xs = x.index_select(0, order // k)  # [T·k, H], grouped by expert
    h = torch._grouped_mm(xs, experts.w13.transpose(-2, -1), offs=offs)  # [T·k, 2I]: w1 x | w3 x
    i = experts.inner
    a = swiglu(h[:, :i], h[:, i:], experts.limit).contiguous()  # [T·k, I]
    y = torch._grouped_mm(a, experts.w2.transpose(-2, -1), offs=offs)  # [T·k, H]
    y = torch.empty_like(y).index_copy_(0, order, y)  # order is a permutation: every row written once
    return (y.view(t, k, x.shape[-1]) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)


class Gate(nn.Module):
    """Router: ``weight`` [E, H]; ``bias`` [E] float32 (top-k layers) or ``tid2eid`` [padded vocab, k] (hash layers)."""

    def __init__(self, cfg: V4Config, hashed: bool):
        super().__init__()
        self.hashed, self.top_k = hashed, cfg.num_experts_per_tok
        self.scoring, self.scale = cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.padded_vocab_size, cfg.num_experts_per_tok,
                                                          dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], token ids [T] -> (weights [T, k] in x's dtype's work type, expert ids [T, k])."""
        logits = F.linear(x, self.weight)  # [T, E]
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if self.hashed:
            ids = self.tid2eid[token_ids].long()  # [T, k]
        else:
            ids = torch.topk(scores + self.bias.to(scores.dtype), self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, ids


class MoE(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int):
        super().__init__()
        self.gate = Gate(cfg, cfg.mlp_layer_types[layer_id] == "hash_moe")
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                     cfg.swiglu_limit)
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: each token's routed experts (``routed_experts``) plus the shared expert."""
        weights, ids = self.gate(x, token_ids)  # [T, k] each
        return routed_experts(x, weights, ids, self.experts) + self.shared_experts(x)
