"""``SpeculativeConfig``: vLLM's ``speculative_config`` keys (``method``, ``num_speculative_tokens``,
``prompt_lookup_max`` / ``prompt_lookup_min``, ``model``, ``draft_tensor_parallel_size``, ``disable_by_batch_size``),
validated at construction, and the **decode reservation** it implies.

The reservation is the most rows a step's decoding sequences can take with speculation on. A speculating sequence
verifies its last token and K drafts, K + 1 target rows, all of which get logits; a draft model also runs K rows of
its own for it inside the same step (its first pass over the known token, then one pass per further draft; after a
step that accepted every draft it first catches up on the last one, and then proposes one draft fewer, so never more
than K). So every per-step buffer is sized for ``max_num_seqs * rows_per_sequence`` decode rows::

    ngram        rows_per_sequence = K + 1                 (verify)
    draft_model  rows_per_sequence = (K + 1) + K = 2K + 1  (verify + the draft's forwards)

and the engine refuses at start a ``max_num_batched_tokens`` below it (``check_reservation``)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup, no extra model) | "draft_model" (a smaller model sharing the tokenizer)
    num_speculative_tokens: int  # K: drafts proposed per sequence per step, at most
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched against the sequence so far
    prompt_lookup_min: int | None = None  # ngram: shortest suffix tried (longest first)
    model: str | None = None  # draft_model: preset name or checkpoint directory (same tokenizer as the target)
    draft_tensor_parallel_size: int = 1  # draft_model: only 1 (the draft runs whole on the Worker's device)
    disable_by_batch_size: int | None = None  # no drafts in a step scheduled with at least this many running sequences

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{name}={getattr(self, name)!r}: {why}")

        if self.method not in METHODS:
            raise bad("method", f"must be one of {list(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise bad("num_speculative_tokens", "must be an int >= 1")
        if self.method == "ngram":
            if self.model is not None:
                raise bad("model", 'applies to method "draft_model"; the n-gram proposer has no model')
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                v = getattr(self, name)
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                    raise bad(name, "must be an int >= 1")
            if lo is None and hi is None:  # vLLM's default window
                lo = hi = 5
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if lo > hi:
                raise bad("prompt_lookup_min", f"must be <= prompt_lookup_max={hi}")
        else:
            if not self.model:
                raise bad("model", 'method "draft_model" needs the draft model (a preset or checkpoint directory)')
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise bad(name, 'applies to method "ngram"')
        if self.draft_tensor_parallel_size != 1:
            raise bad("draft_tensor_parallel_size", "must be 1: the draft model runs whole on the Worker's device")
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise bad("disable_by_batch_size", "must be an int >= 1 (or null)")

    @classmethod
    def from_dict(cls, options: dict[str, Any] | "SpeculativeConfig") -> "SpeculativeConfig":
        """From ``--speculative-config`` / ``LLM(speculative_config=...)``; a ``model`` without a ``method`` means
        "draft_model" (as in vLLM). Unknown keys raise, naming them."""
        if isinstance(options, SpeculativeConfig):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        opts = dict(options)
        if "method" not in opts:
            if not opts.get("model"):
                raise ValueError('speculative_config needs "method" ("ngram" or "draft_model") or a draft "model"')
            opts["method"] = "draft_model"
        if "num_speculative_tokens" not in opts:
            raise ValueError("speculative_config needs num_speculative_tokens (K, the drafts per step)")
        return cls(**opts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @property
    def verify_rows(self) -> int:
        """Target rows (with logits) of one speculating sequence: its last token and K drafts."""
        return self.num_speculative_tokens + 1

    @property
    def draft_rows(self) -> int:
        """Draft-model rows of one speculating sequence per step: K (0 for the n-gram proposer)."""
        return self.num_speculative_tokens if self.uses_draft_model else 0

    @property
    def budget_per_draft(self) -> int:
        """Step-budget tokens one draft costs: its verify row, plus its draft-model row."""
        return 2 if self.uses_draft_model else 1

    @property
    def rows_per_sequence(self) -> int:
        """Decode rows a speculating sequence reserves in a step's budget: K + 1, or 2K + 1 with a draft model."""
        return self.verify_rows + self.draft_rows


def decode_reservation(config) -> int:
    """Decode rows every per-step buffer is sized for: ``max_num_seqs`` (one a sequence) without speculation, else
    ``max_num_seqs * rows_per_sequence`` (module docstring)."""
    spec = config.speculative_config
    return config.max_num_seqs * (spec.rows_per_sequence if spec is not None else 1)


def logit_rows(config) -> int:
    """Rows a step turns into logits and samples, at most: ``max_num_seqs`` times K + 1 with speculation."""
    spec = config.speculative_config
    return config.max_num_seqs * (spec.verify_rows if spec is not None else 1)


def check_reservation(config) -> None:
    """ValueError at start when the step budget cannot hold the decode reservation, naming the options."""
    spec = config.speculative_config
    if spec is None:
        return
    need = decode_reservation(config)
    if need > config.max_num_batched_tokens:
        k = spec.num_speculative_tokens
        formula = "(1 + 2K)" if spec.uses_draft_model else "(K + 1)"
        raise ValueError(
            f"speculative decoding does not fit the step budget: speculative_config method={spec.method!r} with "
            f"num_speculative_tokens={k} reserves max_num_seqs={config.max_num_seqs} x {formula} = {need} decode rows "
            f"per step, but engine.max_num_batched_tokens={config.max_num_batched_tokens}; raise "
            f"max_num_batched_tokens to >= {need}, or lower max_num_seqs or num_speculative_tokens")
