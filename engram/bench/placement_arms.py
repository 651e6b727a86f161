"""What an arm of `engram bench placement` is, and how it is checked before anything loads.

An arm is a JSON object (``--a``, each ``--b``) with the keys ``tier`` ("gpu" | "host" | "disk",
required), ``lookup_overlap`` (bool, default false), ``wkv_run_ahead`` (bool, default true: with
``lookup_overlap``, whether the rows' projections run ahead on the lookup stream too),
``async_scheduling`` (bool, default: the engine's auto choice, which is on where the tables gather device
ids; asked for on host-read tables, a decode step is launched before the step before it is read and waits
for its tokens inside the launch) and ``options`` (a
JSON object of table options, engram.store.StoreOptions keys such as ``cache_rows``, ``io``,
``queue_depth``; default none) and ``switches`` (a JSON object of kernel switches set while the arm's
engine is built and measured, engram.model.kernel_switches names: ``pdl``, ``first_lookup_alone``,
``cublaslt``, ``disk_decode_in_graph``; default none).
``parse_arm`` turns it into an ``ArmSpec`` (hashable: one engine per distinct arm) or stops the command
(SystemExit) naming the option (``--a``, ``--b[1]`` for the first ``--b``) and the offending key: any
other key, a missing or unknown tier, a non-bool ``lookup_overlap``, ``wkv_run_ahead`` or
``async_scheduling``, ``options`` not an object, an unknown switch or a non-bool switch value.

What the arms share goes in ``--engram-config`` (loader and table options): ``parse_engram_options``
reads it as RuntimeOptions and refuses ``cpu_offload``, ``lookup_overlap`` and ``wkv_run_ahead``
(``ARM_OPTIONS_IN_CONFIG``),
which the arms decide. Its table options are the base that an arm's ``options`` override for that arm's
tables: ``arm_store_options`` applies them and lets StoreOptions validate the result (unknown keys,
values, combinations), SystemExit naming the option and ``options.<key>`` otherwise.

A placement is a distinct (tier, store options) pair; its tables are opened once and shared by every
arm on it. ``placement_name`` names it: the tier, followed by the store options that differ from
``--engram-config``'s as JSON, if any (``disk {"cache_rows": 500}``).

``ARM_LABELS``: the labels under which ``stats.run_interleaved`` records an arm's engine in a
comparison (A and its A/A control A' share A's engine).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engram.model import kernel_switches

TIERS = ("gpu", "host", "disk")
ARM_KEYS = ("tier", "lookup_overlap", "wkv_run_ahead", "async_scheduling", "options", "switches")
DEFAULT_A = '{"tier": "gpu"}'
DEFAULT_B = '{"tier": "host", "lookup_overlap": true}'
ARM_OPTIONS_IN_CONFIG = ("cpu_offload", "lookup_overlap", "wkv_run_ahead")  # set per arm, not shared

ARM_LABELS = {"A": ("A", "A'"), "B": ("B",)}  # the samples of an arm's engine in a comparison, by label


@dataclass(frozen=True)
class ArmSpec:
    """Where an arm's tables live and whether its lookups overlap earlier layers."""

    tier: str
    lookup_overlap: bool = False
    options: tuple = ()  # the arm's table options as sorted (key, value) pairs (hashable); () for none
    async_scheduling: bool | None = None  # None: the engine's auto choice
    wkv_run_ahead: bool = True
    switches: tuple = ()  # kernel switches set while the arm's engine is built and run, sorted pairs

    def to_dict(self) -> dict:
        out = {"tier": self.tier, "lookup_overlap": self.lookup_overlap}
        if not self.wkv_run_ahead:
            out["wkv_run_ahead"] = False
        if self.async_scheduling is not None:
            out["async_scheduling"] = self.async_scheduling
        if self.options:
            out["options"] = dict(self.options)
        if self.switches:
            out["switches"] = dict(self.switches)
        return out

    @property
    def name(self) -> str:
        return json.dumps(self.to_dict())


def parse_arm(text: str, option: str) -> ArmSpec:
    """An arm's JSON -> ArmSpec; SystemExit naming ``option`` and the offending key otherwise."""
    from engram.config import parse_json_object

    try:
        raw = parse_json_object(text, option)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    unknown = [k for k in raw if k not in ARM_KEYS]
    if unknown:
        raise SystemExit(f"{option}: unknown key {unknown[0]!r}; an arm takes exactly the keys {list(ARM_KEYS)} "
                         f"(shared loader and table options go in --engram-config)")
    if "tier" not in raw:
        raise SystemExit(f"{option}: key 'tier' is missing (one of {list(TIERS)})")
    if raw["tier"] not in TIERS:
        raise SystemExit(f"{option}: key 'tier'={raw['tier']!r} must be one of {list(TIERS)}")
    overlap = raw.get("lookup_overlap", False)
    if not isinstance(overlap, bool):
        raise SystemExit(f"{option}: key 'lookup_overlap'={overlap!r} must be true or false")
    run_ahead = raw.get("wkv_run_ahead", True)
    if not isinstance(run_ahead, bool):
        raise SystemExit(f"{option}: key 'wkv_run_ahead'={run_ahead!r} must be true or false")
    asynchronous = raw.get("async_scheduling")
    if asynchronous is not None and not isinstance(asynchronous, bool):
        raise SystemExit(f"{option}: key 'async_scheduling'={asynchronous!r} must be true or false")
    options = raw.get("options", {})
    if not isinstance(options, dict):
        raise SystemExit(f"{option}: key 'options'={options!r} must be a JSON object of table options")
    switches = raw.get("switches", {})
    try:
        if not isinstance(switches, dict):
            raise ValueError(f"{switches!r} must be a JSON object of kernel switches")
        kernel_switches.check(switches)
    except ValueError as e:
        raise SystemExit(f"{option}: key 'switches': {e}") from None
    return ArmSpec(raw["tier"], overlap, tuple(sorted(options.items())),  # checked over the shared ones: run()
                   asynchronous, run_ahead, tuple(sorted(switches.items())))


def _store_options(options: dict, base, option: str):
    """``base`` (StoreOptions, None: the defaults) with ``options`` applied, validated by StoreOptions;
    SystemExit naming ``option`` and the key otherwise."""
    from engram.store.options import PREFIX, StoreOptions

    try:
        return (base or StoreOptions()).replace(**options)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"{option}: " + str(e).replace(PREFIX, "options", 1)) from None


def arm_store_options(arm: ArmSpec, base, option: str):
    """The StoreOptions the arm's tables open with: --engram-config's, with the arm's ``options`` applied."""
    return _store_options(dict(arm.options), base, option)


def placement_name(tier: str, store, base) -> str:
    """A placement's name: the tier, followed by the store options that differ from ``base`` (JSON), if any."""
    changed = {k: v for k, v in store.to_dict().items() if base.to_dict()[k] != v}
    return f"{tier} {json.dumps(changed)}" if changed else tier


def parse_engram_options(text: str | None):
    """--engram-config -> RuntimeOptions, refusing the keys the arms set."""
    from engram.commands.options import parse_engram_config
    from engram.engine.options import RuntimeOptions

    try:
        raw = parse_engram_config(text)
        taken = [k for k in ARM_OPTIONS_IN_CONFIG if k in raw]
        if taken:
            raise ValueError(f"key {taken[0]!r} is set per arm here (--a / --b: tier, lookup_overlap, "
                             "wkv_run_ahead), not shared")
        return RuntimeOptions.from_dict(raw)
    except ValueError as e:
        raise SystemExit(f"--engram-config: {e}") from None
