"""Shared fixtures of the DeepSeek-V4 parity tests: a small random V4 (every layer type, both MLP types, hc_mult 4) built
by the float64 twin of transformers (tests/oracles/deepseek_v4_f64.py), saved with transformers' own save_pretrained,
optionally with Engram layers added to the checkpoint, and loaded by engram.model.loader.load_model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from engram.config import EngramConfig
from engram.model.deepseek_v4.decoder import pack_sequences
from engram.model.loader import load_model
from engram.model.presets import TOKENIZER_FILE
from engram.quant import quantize_mxfp8
from tests.oracles.deepseek_v4_f64 import reference_model
from tests.oracles.reference import engram_fields

VOCAB = 4096  # the built-in tokenizer's
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
               "compressed_sparse_attention"]
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, layer_types=LAYER_TYPES,
             mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
             partial_rotary_factor=0.5, sliding_window=32, o_groups=2, o_lora_rank=16, index_n_heads=16,
             index_head_dim=16, index_topk=8, max_position_embeddings=512, hc_sinkhorn_iters=6,
             rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                              "beta_fast": 32, "beta_slow": 1})
ENGRAM = EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=4, head_dim=32, vocab_size=(1009, 1511),
                      compressed_vocab_size=2901, pad_token_id=2, hidden_size=64, hc_mult=4)


def random_decoder(cfg) -> "DeepseekV4Model":
    """A float64 DeepseekV4Model of ``cfg`` (a V4Config) with every weight random and clearly nonzero (seed 0): norm
    weights 1 + N(0, 0.1), matrices N(0, 1/fan_in), sinks / mHC bases and scales / router biases N(0, 0.5), valid random
    ``tid2eid`` ids, compressor ``ape`` N(0, 1) so a slot's position matters; eval mode, no grads."""
    from engram.model.deepseek_v4.decoder import DeepseekV4Model

    torch.manual_seed(0)
    m = DeepseekV4Model(cfg).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
            else:  # sinks, mHC bases and scales, router biases
                p.normal_(0, 0.5)
        for layer in m.model.layers:
            if layer.ffn.gate.hashed:
                layer.ffn.gate.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, layer.ffn.gate.tid2eid.shape))
            if hasattr(layer.attn, "compressor"):
                layer.attn.compressor.ape.normal_(0, 1)
    return m.eval().requires_grad_(False)


def pool_step(step_id: int, seqs, starts: list[int], ns: list[int], tables):
    """The StepDescription of one packed step over ``seqs`` (feeding ``ns[i]`` zero tokens from ``starts[i]``) with
    the cache-group ``tables``: what the Worker's pool of V4 pages reads (no paged-KV, Engram or sampling fields)."""
    from engram.engine.step import StepDescription

    packed = pack_sequences([[0] * n for n in ns], starts)
    return StepDescription(step_id=step_id, seq_ids=[s.seq_id for s in seqs], start_positions=list(starts),
                           num_new_tokens=list(ns), token_ids=packed.token_ids, positions=packed.positions,
                           cu_seqlens=packed.cu_seqlens, context_lens=packed.context_lens,
                           block_tables=torch.zeros(len(ns), 0, dtype=torch.long), slot_mapping=packed.slot_mapping,
                           dead_mask=None, engram_row_ids={}, sample_rows=[], samples=[], group_tables=tables)


def hf_config(**overrides):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**SHAPE, **overrides})


def engram_tensors(cfg: EngramConfig, seed: int = 5) -> dict[str, torch.Tensor]:
    """Random v41 Engram weights and MXFP8 tables of every Engram layer, under checkpoint names."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for lid in cfg.layer_ids:
        p = f"model.layers.{lid}.engram."
        width = cfg.n_cols * cfg.head_dim
        out[p + "wkv.weight"] = torch.randn(cfg.hidden_size * (cfg.hc_mult + 1), width, generator=g) * width ** -0.5
        out[p + "q_weight"] = 1 + 0.1 * torch.randn(cfg.hc_mult, cfg.hidden_size, generator=g)
        out[p + "k_weight"] = 1 + 0.1 * torch.randn(cfg.hc_mult, cfg.hidden_size, generator=g)
        values, scales = quantize_mxfp8(torch.randn(cfg.table_rows(lid), cfg.head_dim, generator=g))
        out[p + "embed.weight"], out[p + "embed.scale"] = values, scales
    return out


def write_checkpoint(directory: Path, ref, engram: EngramConfig | None = None) -> Path:
    """``ref`` saved by transformers' save_pretrained, the built-in tokenizer, and (``engram``) Engram tensors in a
    second safetensors file with the ``engram_*`` fields in config.json."""
    from safetensors.torch import save_file

    ref.save_pretrained(directory)
    shutil.copy(TOKENIZER_FILE, directory / "tokenizer.json")
    if engram is not None:
        save_file(engram_tensors(engram), str(directory / "engram.safetensors"))
        cfg = json.loads((directory / "config.json").read_text())
        cfg.update(engram.to_hf_fields())
        (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    return directory


class Pair:
    """A reference model and our load of its checkpoint."""

    def __init__(self, tmp: Path, engram: EngramConfig | None, **overrides):
        self.ref = reference_model(hf_config(**overrides))
        self.path = write_checkpoint(tmp / "ckpt", self.ref, engram)
        self.ours = load_model(self.path, dtype="float64", device="cpu", cache_dir=tmp / "cache", progress=False)
        self.model = self.ours.model
        if engram is not None:
            self._hook_engram()
        self.rows = None  # the reference's Engram rows of its next call (set by ``ref_logits``)

    def _hook_engram(self) -> None:
        """Run our Engram oracle (the v41 spec, token by token) before each Engram layer of the reference."""
        from tests.unit.test_module_v41 import reference_v41

        for lid, layer in self.model.engram_layers.items():
            def pre(module, args, kwargs, layer=layer, lid=lid):
                h = args[0]  # [1, T, hc, H]
                dead = self.rows["dead_mask"]
                return (reference_v41(layer, h[0], self.rows["engram_rows"](lid), dead).unsqueeze(0),), kwargs
            self.ref.model.layers[lid].register_forward_pre_hook(pre, with_kwargs=True)

    @torch.no_grad()
    def ref_logits(self, new: list[int], past: list[int], cache=None) -> torch.Tensor:
        """The reference's logits [len(new), vocab] for ``new`` after ``past`` (whose state ``cache`` holds)."""
        self.rows = engram_fields(self.ours, new, past, "cpu")
        pos = torch.arange(len(past), len(past) + len(new)).unsqueeze(0)
        return self.ref(torch.tensor([new]), position_ids=pos, cache=cache, use_cache=cache is not None).logits[0]

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """The reference's greedy continuation of ``ids`` (``n`` tokens), decoding with its own cache."""
        return self.greedy_logprobs(ids, n)[0]

    def greedy_logprobs(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        """``greedy`` and each chosen token's float64 logprob."""
        from transformers import DynamicCache

        cache, seq, out, lps, new = DynamicCache(config=self.ref.config), [], [], [], list(ids)
        for _ in range(n):
            logp = self.ref_logits(new, seq, cache)[-1].log_softmax(-1)
            tok = int(logp.argmax())
            seq, new = seq + new, [tok]
            out.append(tok)
            lps.append(float(logp[tok]))
        return out, lps

    @torch.no_grad()
    def our_logits(self, chunks: list[list[int]], pasts: list[list[int]], caches: list, all_rows: bool = True):
        """Our logits of one packed step (every row, or each sequence's last) and the new caches."""
        fields = _packed_fields(self.ours, chunks, pasts)
        step = pack_sequences(chunks, [len(p) for p in pasts], **fields)
        if all_rows:
            step.logits_indices = torch.arange(step.num_tokens)
        hidden, new = self.model(step, caches)
        return self.model.head(hidden), new  # float64 (compute_logits returns float32, for the sampler)


def _packed_fields(loaded, chunks, pasts) -> dict:
    """engram_rows / dead_mask of a packed step: each sequence's single-sequence rows, concatenated."""
    if loaded.engram_config is None:
        return {}
    per = [engram_fields(loaded, c, p, "cpu") for c, p in zip(chunks, pasts)]
    return {"engram_rows": lambda lid: torch.cat([f["engram_rows"](lid) for f in per]), "dead_mask": None}


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def decode_heavy_requests(n: int = 16, seed: int = 11) -> tuple[list[list[int]], list[int]]:
    """(prompts of 1..299 tokens, output lengths): the short prompts decode longest, so a run's late decode steps
    batch only short contexts (the V4 decode graphs' small spans) and its early ones long."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 300, (n,), generator=g).tolist()
    return [prompt(k, seed=500 + i) for i, k in enumerate(lens)], [6 + (300 - k) // 8 for k in lens]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())
