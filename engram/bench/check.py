"""Output equivalence of two configurations of one model (``engram check``): two **arms** (``ArmSpec``: tier, dtype,
device, ``engram_config``, EngineConfig fields, substitute ``table_dirs``; validated before anything loads) run the same
**probes** (greedy, ``logprobs=2``, ``ignore_eos``; serial, concurrent or fixed-prefix). Identical tokens are ``equal``;
at a first difference a top-1 minus top-2 gap below ``near_tie`` is a ``near-tie``, else the request ``diverged`` and
the Engram rows it read are compared bytewise across the arms (docs/design.md, determinism policy)."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

PROBES = ("serial", "concurrent", "fixed-prefix")
EQUAL, NEAR_TIE, DIVERGED = "equal", "near-tie", "diverged"
ARM_KEYS = ("tier", "dtype", "device", "engram_config", "table_dirs")  # besides the EngineConfig fields
SHARED_DEVICE_UTILIZATION = 0.45  # arm a's gpu_memory_utilization when both arms share one CUDA device


def _engine_keys() -> tuple[str, ...]:
    from dataclasses import fields

    from engram.engine.config import EngineConfig

    return tuple(f.name for f in fields(EngineConfig))


@dataclass
class ArmSpec:
    """One arm's options, validated (``parse``). ``name`` is the option it came from (``a`` / ``b``)."""

    name: str
    tier: str = "gpu"
    dtype: str | None = None
    device: str | None = None
    engram_config: dict[str, Any] = field(default_factory=dict)
    table_dirs: dict[int, str] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields

    @classmethod
    def parse(cls, spec: str | dict[str, Any], name: str) -> "ArmSpec":
        """A JSON object (or dict) of arm keys -> ArmSpec; ValueError naming ``--<name>`` and the key."""
        from engram.config import parse_json_object
        from engram.engine.config import EngineConfig
        from engram.model.options import RuntimeOptions
        from engram.model.loader import DTYPES
        from engram.store.base import Tier

        opt = f"--{name}"
        raw = parse_json_object(spec, opt) if isinstance(spec, str) else dict(spec)
        engine_keys = _engine_keys()
        unknown = sorted(set(raw) - set(ARM_KEYS) - set(engine_keys))
        if unknown:
            raise ValueError(f"{opt}: unknown key(s) {unknown}; known: {sorted(ARM_KEYS + engine_keys)}")
        try:
            Tier.parse(raw.get("tier", "gpu"))
            if raw.get("dtype") is not None and raw["dtype"] not in DTYPES:
                raise ValueError(f"dtype={raw['dtype']!r} is not one of {sorted(DTYPES)}")
            if raw.get("device") is not None:
                _parse_device(raw["device"])
            engram_config = {} if raw.get("engram_config") is None else raw["engram_config"]
            if not isinstance(engram_config, dict):
                raise ValueError(f"engram_config={engram_config!r} must be a JSON object")
            RuntimeOptions.from_dict(engram_config)
            engine = {k: raw[k] for k in engine_keys if k in raw}
            EngineConfig.from_options(engine)
            table_dirs = _table_dirs({} if raw.get("table_dirs") is None else raw["table_dirs"])
        except (ValueError, TypeError) as e:
            raise ValueError(f"{opt}: {e}") from None
        return cls(name, raw.get("tier", "gpu"), raw.get("dtype"), raw.get("device"), engram_config, table_dirs,
                   engine)

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "dtype": self.dtype, "device": self.device, "engram_config": self.engram_config,
                "table_dirs": {str(k): v for k, v in self.table_dirs.items()}, **self.engine}


def _parse_device(text: Any):
    import torch

    try:
        if not isinstance(text, str):
            raise RuntimeError
        return torch.device(text)
    except RuntimeError:
        raise ValueError(f"device={text!r} is not a torch device such as \"cpu\" or \"cuda:1\"") from None


def _table_dirs(raw: Any) -> dict[int, str]:
    if not isinstance(raw, dict):
        raise ValueError(f"table_dirs={raw!r} must be a JSON object {{layer id: table directory}}")
    out = {}
    for key, d in raw.items():
        try:
            lid = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"table_dirs key {key!r} must be an Engram layer id (an integer)") from None
        if not isinstance(d, str) or not Path(d).is_dir():
            raise ValueError(f"table_dirs[{key!r}]={d!r} is not a directory")
        out[lid] = d
    return out


def check_same_model(a: ArmSpec, b: ArmSpec) -> None:
    """Both arms must load the same weights and tables: ValueError naming a loader key they disagree on."""
    from engram.model.options import RuntimeOptions

    oa, ob = RuntimeOptions.from_dict(a.engram_config), RuntimeOptions.from_dict(b.engram_config)
    for key in ("seed", "table_rows"):
        if getattr(oa, key) != getattr(ob, key):
            raise ValueError(f"--{b.name}: engram_config.{key}={getattr(ob, key)!r} differs from --{a.name}'s "
                             f"{getattr(oa, key)!r}; both arms must load the same model")


def _resolved_device(spec: ArmSpec):
    import torch

    dev = _parse_device(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--{spec.name}: device={spec.device!r}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def share_device(a: ArmSpec, b: ArmSpec) -> None:
    """On one CUDA device arm a's KV cache is capped at ``SHARED_DEVICE_UTILIZATION`` unless its spec sizes it."""
    da = _resolved_device(a)
    sized = ("gpu_memory_utilization", "kv_cache_memory", "num_kv_blocks")
    if da.type == "cuda" and da == _resolved_device(b) and not any(k in a.engine for k in sized):
        a.engine["gpu_memory_utilization"] = SHARED_DEVICE_UTILIZATION


def build_arm(model: str, spec: ArmSpec, cache_dir: str | None = None):
    """The arm's ``engram.LLM``, its ``table_dirs`` opened (fingerprint checked) in place of those layers' tables."""
    from engram.engine.llm import LLM
    from engram.model.tables import open_tables

    llm = LLM(model, tier=spec.tier, dtype=spec.dtype, engram_config=spec.engram_config, device=spec.device,
              cache_dir=cache_dir, **spec.engine)
    loaded = llm.loaded
    for lid, d in spec.table_dirs.items():
        if lid not in loaded.tables:
            raise ValueError(f"--{spec.name}: table_dirs layer {lid} is not an Engram layer of {model!r} "
                             f"(layers {sorted(loaded.tables)})")
        try:
            table = open_tables({lid: Path(d)}, loaded.engram_config, llm.tier, llm.device,
                                loaded.store_options)[lid]
        except ValueError as e:
            raise ValueError(f"--{spec.name}: table_dirs[{lid}]={d!r}: {e}") from None
        substitute_table(llm, lid, table)
    return llm


def substitute_table(llm, layer_id: int, table) -> None:
    """Serve ``table`` for ``layer_id`` from the next step on (via ``llm.loaded.tables``); the old one is closed."""
    tables = llm.loaded.tables
    if getattr(getattr(llm.engine.executor, "worker", None), "lookup", None) is None or \
            llm.engine.executor.worker.lookup.tables is not tables:
        raise RuntimeError("this executor does not read llm.loaded.tables; a table cannot be substituted")
    old, tables[layer_id] = tables[layer_id], table
    old.close()


# ----------------------------------------------------------------- probes
@dataclass
class Probe:
    name: str  # one of PROBES
    prompts: list[list[int]]  # token ids, request order

    def run(self, llm, max_tokens: int) -> list[tuple[list[int], list]]:
        """(output token ids, TokenLogprobs per output token) of every prompt, greedy, in prompt order."""
        from engram.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        batches = [[p] for p in self.prompts] if self.name == "serial" else [self.prompts]
        outs = [o for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]
        return [(list(o.outputs[0].token_ids), list(o.outputs[0].logprobs or [])) for o in outs]


def make_probes(prompts: Sequence[Sequence[int]], names: Sequence[str], prefix_tokens: int,
                suffix_tokens: int) -> list[Probe]:
    """``serial`` / ``concurrent``: ``prompts`` as they are; ``fixed-prefix``: a shared prefix, then each suffix."""
    prompts = [list(p) for p in prompts]
    prefix = [t for p in prompts for t in p][:prefix_tokens]
    made = {"serial": prompts, "concurrent": prompts,
            "fixed-prefix": [prefix + p[:suffix_tokens] for p in prompts]}
    return [Probe(n, made[n]) for n in names]


# ----------------------------------------------------------------- comparison
@dataclass
class Comparison:
    """One request of one probe compared across the arms."""

    probe: str
    request: int
    status: str  # EQUAL | NEAR_TIE | DIVERGED
    prompt_tokens: int
    position: int | None = None  # first differing output position (0 = first generated token)
    token_a: int | None = None  # None: that arm produced no token there (shorter output)
    token_b: int | None = None
    gap_a: float | None = None  # arm a's top-1 minus top-2 logprob at ``position``
    gap_b: float | None = None
    logit_gap_a: float | None = None  # arm a's logprob(token_a) - logprob(token_b), when both are in its top-2
    logit_gap_b: float | None = None  # arm b's logprob(token_b) - logprob(token_a), likewise
    top_a: list | None = None  # arm a's top-2 [(id, logprob), ...] at ``position``
    top_b: list | None = None
    logprob_a: float | None = None  # arm a's logprob of token_a at ``position``
    logprob_b: float | None = None
    rows: dict[str, Any] | None = None  # differing_rows(), for DIVERGED

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None or k in ("status", "position")}


def _gap(top: list) -> float | None:
    return top[0][1] - top[1][1] if len(top) >= 2 else None  # None: a one-token vocabulary, never a tie


def _logit_gap(top: list, own: int | None, other: int | None) -> float | None:
    lp = dict(top)
    return lp[own] - lp[other] if own in lp and other in lp else None


def compare(probe: str, request: int, prompt_tokens: int, a: tuple[list[int], list], b: tuple[list[int], list],
            near_tie: float) -> Comparison:
    """Classify one request from both arms' (ids, TokenLogprobs); a length difference is a divergence at the end."""
    (ta, la), (tb, lb) = a, b
    c = Comparison(probe, request, EQUAL, prompt_tokens)
    if ta == tb:
        return c
    k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    c.position, c.status = k, DIVERGED
    c.token_a, c.token_b = (ta[k] if k < len(ta) else None), (tb[k] if k < len(tb) else None)
    _logprobs_at(c, la, lb)
    if k < len(la) and k < len(lb):
        c.gap_a, c.gap_b = _gap(c.top_a), _gap(c.top_b)
        c.logit_gap_a, c.logit_gap_b = _logit_gap(c.top_a, c.token_a, c.token_b), _logit_gap(c.top_b, c.token_b,
                                                                                               c.token_a)
        gaps = [g for g in (c.gap_a, c.gap_b) if g is not None]
        if c.token_a is not None and c.token_b is not None and gaps and min(gaps) < near_tie:
            c.status = NEAR_TIE
    return c


def _logprobs_at(c: Comparison, la: list, lb: list) -> None:
    """Both arms' own logprob and top-k at ``c.position``, where each arm has one."""
    k = c.position
    if k < len(la):
        c.logprob_a, c.top_a = la[k].logprob, [tuple(x) for x in la[k].top]
    if k < len(lb):
        c.logprob_b, c.top_b = lb[k].logprob, [tuple(x) for x in lb[k].top]


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)  # bitwise: -0.0 differs from 0.0, a NaN equals only its own bits


def _same_token(x, y) -> bool:
    """Two TokenLogprobs bitwise equal: the token, its logprob and the whole top-k (ids and logprobs, in order)."""
    return (x.token_id == y.token_id and _bits(x.logprob) == _bits(y.logprob) and len(x.top) == len(y.top)
            and all(i == j and _bits(p) == _bits(q) for (i, p), (j, q) in zip(x.top, y.top)))


def compare_bitwise(probe: str, request: int, prompt_tokens: int, a: tuple[list[int], list],
                    b: tuple[list[int], list]) -> Comparison:
    """The same-batch rule: equal only when token ids, logprobs and top-k are bitwise equal at every position; else
    DIVERGED at the first position where anything differs (both tokens and logprobs named), a length difference at
    the end of the shorter."""
    (ta, la), (tb, lb) = a, b
    c = Comparison(probe, request, EQUAL, prompt_tokens)
    k = next((i for i, (x, y) in enumerate(zip(la, lb)) if not _same_token(x, y)), None)
    if k is None and ta == tb and len(la) == len(lb):
        return c
    if k is None:
        k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb), len(la), len(lb)))
    c.position, c.status = k, DIVERGED
    c.token_a, c.token_b = (ta[k] if k < len(ta) else None), (tb[k] if k < len(tb) else None)
    _logprobs_at(c, la, lb)
    c.gap_a, c.gap_b = _gap(c.top_a or []), _gap(c.top_b or [])
    return c


def differing_rows(llm_a, llm_b, token_ids: Sequence[int], limit: int) -> dict[str, Any]:
    """Every Engram row ``token_ids`` reads, compared bytewise across both arms' tables -> counts and the first
    ``limit`` differences in (position, layer, column) order."""
    import torch

    from engram.hashing import NgramHasher

    loaded = llm_a.loaded
    ecfg = loaded.engram_config
    if ecfg is None:
        return {"compared": 0, "differing": 0, "rows": []}
    ctok = loaded.compressed_tokenizer
    hasher = NgramHasher.from_tokenizer(ecfg, ctok)
    cids = torch.tensor([ctok.compress(list(token_ids), ecfg.dead_token_ids)], dtype=torch.int64)
    found, compared = [], 0
    for lid in ecfg.layer_ids:
        ids = hasher.hash(cids, lid)[0]  # [T, n_cols]
        flat = ids.reshape(-1)
        ra = llm_a.loaded.tables[lid].gather_raw(flat).cpu()  # [T * n_cols, row_bytes] uint8
        rb = llm_b.loaded.tables[lid].gather_raw(flat).cpu()
        same = (ra == rb).all(dim=1) if ra.shape == rb.shape else torch.zeros(flat.numel(), dtype=torch.bool)
        compared += flat.numel()
        for pos, col in (~same).reshape(ids.shape).nonzero().tolist():
            found.append({"layer": lid, "position": pos, "column": col, "row": int(ids[pos, col])})
    found.sort(key=lambda r: (r["position"], r["layer"], r["column"]))
    return {"compared": compared, "differing": len(found),
            "distinct": len({(r["layer"], r["row"]) for r in found}), "rows": found[:limit]}


# ----------------------------------------------------------------- the whole check
@dataclass
class CheckReport:
    comparisons: list[Comparison]
    probes: list[str]

    @property
    def exit_code(self) -> int:
        """0 when every request is equal or a near-tie, 1 on any real divergence."""
        return 1 if any(c.status == DIVERGED for c in self.comparisons) else 0

    def summary_rows(self) -> list[dict[str, Any]]:
        """Per probe: requests, equal, near-ties, diverged (the readable table)."""
        rows = []
        for p in self.probes:
            cs = [c for c in self.comparisons if c.probe == p]
            rows.append({"probe": p, "requests": len(cs), "equal": sum(c.status == EQUAL for c in cs),
                         "near-ties": sum(c.status == NEAR_TIE for c in cs),
                         "diverged": sum(c.status == DIVERGED for c in cs)})
        return rows

    def difference_rows(self) -> list[dict[str, Any]]:
        """One row per near-tie or divergence: where, which tokens, the gaps, the differing Engram rows."""
        out = []
        for c in self.comparisons:
            if c.status == EQUAL:
                continue
            rows = c.rows or {}
            out.append({"probe": c.probe, "request": c.request, "status": c.status, "position": c.position,
                        "token a": c.token_a, "token b": c.token_b, "gap a": c.gap_a, "gap b": c.gap_b,
                        "rows differing": rows.get("differing"),
                        "first rows (layer:row@pos)": " ".join(f"{r['layer']}:{r['row']}@{r['position']}"
                                                             for r in rows.get("rows", [])[:4])})
        return out

    def to_dict(self) -> dict[str, Any]:
        verdict = {0: "equal" if all(c.status == EQUAL for c in self.comparisons) else "equal up to near-ties",
                   1: "diverged"}[self.exit_code]
        return {"verdict": verdict, "exit_code": self.exit_code, "probes": self.summary_rows(),
                "requests": [c.to_dict() for c in self.comparisons]}


def run_check(llm_a, llm_b, probes: Sequence[Probe], max_tokens: int, near_tie: float,
              row_limit: int = 32) -> CheckReport:
    """Run every probe on both arms, compare every request, and list the differing Engram rows of each divergence."""
    comparisons = []
    for probe in probes:
        outs_a, outs_b = probe.run(llm_a, max_tokens), probe.run(llm_b, max_tokens)
        for i, (prompt, a, b) in enumerate(zip(probe.prompts, outs_a, outs_b)):
            c = compare(probe.name, i, len(prompt), a, b, near_tie)
            if c.status == DIVERGED:
                c.rows = differing_rows(llm_a, llm_b, prompt + a[0][:c.position], row_limit)
            comparisons.append(c)
    return CheckReport(comparisons, [p.name for p in probes])
