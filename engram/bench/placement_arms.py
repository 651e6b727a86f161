"""What an arm of ``engram bench placement`` is, checked before anything loads. An arm is a JSON object (``--a``, each
``--b``): ``tier`` (required), ``engram_config`` (``--engram-config`` keys over the shared ones) and ``engine``
(EngineConfig overrides). Each arm is its own engine, so arms differ only in what their JSON says. ``parse_arm`` returns
a hashable ``ArmSpec`` (SystemExit naming the option and key); a placement, a distinct (tier, table options) pair named
by ``placement_name``, opens its tables once."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

TIERS = ("gpu", "host", "disk")
ARM_KEYS = ("tier", "engram_config", "engine")
DEFAULT_A = '{"tier": "gpu"}'
DEFAULT_B = '{"tier": "host"}'
# the loader builds one model and one set of table files for the whole run from these; the tier is the arm's
SHARED_ENGRAM_KEYS = ("cpu_offload", "table_rows", "seed", "tables_in_memory")
# every arm decodes the same windows in the same KV budget: the run's options set these for all of them
SHARED_ENGINE_KEYS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory", "num_kv_blocks",
                      "seed")


@dataclass(frozen=True)
class ArmSpec:
    """One arm: its tier, its ``--engram-config`` overrides and its EngineConfig overrides."""

    tier: str
    engram_config: dict = field(default_factory=dict)  # over the shared --engram-config, as JSON spells it
    engine: dict = field(default_factory=dict)  # EngineConfig field -> value, over the run's EngineConfig

    def __hash__(self) -> int:  # dict fields: an arm is identified by its canonical JSON
        return hash(self.name)

    def to_dict(self) -> dict:
        out: dict = {"tier": self.tier}
        if self.engram_config:
            out["engram_config"] = dict(self.engram_config)
        if self.engine:
            out["engine"] = dict(self.engine)
        return out

    @property
    def name(self) -> str:
        return json.dumps(self.to_dict())


def merged_config(shared: dict, own: dict) -> dict:
    """An arm's --engram-config: the shared keys under its own, ``advanced`` knobs merged key by key."""
    merged = {**shared, **own}
    if "advanced" in shared and "advanced" in own:
        merged["advanced"] = {**shared["advanced"], **own["advanced"]}
    return merged


def parse_shared(text: str | None) -> dict:
    """--engram-config: what every arm shares (the tier, ``cpu_offload``, is each arm's own)."""
    from engram.bench.engine_steps import parse_engram_config, runtime_options

    raw = parse_engram_config(text)
    if "cpu_offload" in raw:
        raise SystemExit("--engram-config: key 'cpu_offload' is the tier, which each arm names (--a / --b: tier)")
    runtime_options(raw, "--engram-config")
    return raw


def parse_arm(text: str, option: str, shared: dict) -> ArmSpec:
    """An arm's JSON -> ArmSpec, every key checked; SystemExit naming ``option`` and the key otherwise."""
    import dataclasses

    from engram.bench.engine_steps import parse_engram_config, runtime_options
    from engram.engine.config import EngineConfig

    raw = parse_engram_config(text, option)
    unknown = [k for k in raw if k not in ARM_KEYS]
    if unknown:
        raise SystemExit(f"{option}: unknown key {unknown[0]!r}; an arm takes the keys {list(ARM_KEYS)}")
    if raw.get("tier") not in TIERS:
        raise SystemExit(f"{option}: key 'tier'={raw.get('tier')!r} must be one of {list(TIERS)}")
    own, engine = raw.get("engram_config", {}), raw.get("engine", {})
    for key, value in (("engram_config", own), ("engine", engine)):
        if not isinstance(value, dict):
            raise SystemExit(f"{option}: key {key!r}={value!r} must be a JSON object")
    taken = [k for k in own if k in SHARED_ENGRAM_KEYS]
    if taken:
        raise SystemExit(f"{option}: engram_config.{taken[0]} is shared by every arm: set it in --engram-config")
    runtime_options(merged_config(shared, own), option)
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    bad = [k for k in engine if k not in fields or k in SHARED_ENGINE_KEYS]
    if bad:
        why = "is set for every arm by the command's options" if bad[0] in fields else "is not an EngineConfig field"
        raise SystemExit(f"{option}: engine.{bad[0]} {why}")
    try:
        dataclasses.replace(EngineConfig(), **engine)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"{option}: {e}") from None
    def canonical(d: dict) -> dict:  # keys sorted at every depth: equal arms get one name, one engine
        return json.loads(json.dumps(d, sort_keys=True))

    return ArmSpec(raw["tier"], canonical(own), canonical(engine))


def placement_name(tier: str, store, base) -> str:
    """A placement's name: the tier, followed by the table options that differ from ``base`` (JSON), if any."""
    changed = {k: v for k, v in store.to_dict().items() if base.to_dict()[k] != v}
    return f"{tier} {json.dumps(changed)}" if changed else tier
