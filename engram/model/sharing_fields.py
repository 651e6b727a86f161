"""The cross-layer sharing fields of a config, validated once for the PP planner and the runtime decoder, so both accept
or refuse a layout with the same ``<field>=<value>: <why>`` ValueError.

Source-list rule (``source_layer_ids``): unique ascending ints in ``[0, num_hidden_layers)``, each a layer that takes
part in sharing (``compress_ratios[x] != 0``; without it every layer); each participating layer reads the nearest source
at or before it, so the first must be a source. The runtime implements KV sharing only: ``v41_attention_field`` names a
DeepSeek-V4.1 attention field it refuses."""
from __future__ import annotations

from typing import Any

# DeepSeek-V4.1 attention fields the planner reads and the runtime decoder does not implement.
V41_ATTENTION_FIELDS = ("compress_ratios", "index_source_layer_ids", "candidate_source_layer_id",
                        "candidate_topk_blocks")


def field_error(name: str, value: Any, why: str) -> ValueError:
    """The ValueError of a bad config field: ``<name>=<value>: <why>``."""
    return ValueError(f"{name}={value!r}: {why}")


def is_int(x: Any) -> bool:
    """An int that is not a bool (JSON true/false must not pass as a layer id)."""
    return isinstance(x, int) and not isinstance(x, bool)


def num_hidden_layers(hf: dict[str, Any]) -> int:
    """``num_hidden_layers`` of a config's text fields: required, an int >= 1."""
    if "num_hidden_layers" not in hf:
        raise ValueError("config field 'num_hidden_layers' is required (looked at the top level and under text_config)")
    n = hf["num_hidden_layers"]
    if not is_int(n) or n < 1:
        raise field_error("num_hidden_layers", n, "must be an int >= 1")
    return n


def compress_ratios(hf: dict[str, Any], n: int) -> tuple[int, ...] | None:
    """V4.1 ``compress_ratios`` cut to the ``n`` decoder layers (the rest are MTP layers), ints >= 0; None if absent."""
    ratios = hf.get("compress_ratios")
    if ratios is None:
        return None
    if not isinstance(ratios, (list, tuple)) or not all(is_int(r) and r >= 0 for r in ratios):
        raise field_error("compress_ratios", ratios, "must be a list of ints >= 0 (0 = sliding window only)")
    if len(ratios) < n:
        raise field_error("compress_ratios", ratios, f"has {len(ratios)} entries but num_hidden_layers={n}")
    return tuple(ratios[:n])


def source_layer_ids(ids: Any, name: str, kind: str, n: int,
                     ratios: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """Validate a source list (kind ``kv`` or ``index``) of an ``n``-layer decoder by the module's rule -> a tuple."""
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)):
        raise field_error(name, ids, "must be a list of layer ids")
    ids = list(ids)
    for x in ids:
        if not is_int(x):
            raise field_error(name, ids, f"entry {x!r} is not an int")
    dup = sorted({x for x in ids if ids.count(x) > 1})
    if dup:
        raise field_error(name, ids, f"layer {dup[0]} is listed more than once")
    if ids != sorted(ids):
        raise field_error(name, ids, "must be sorted ascending")
    for x in ids:
        if not 0 <= x < n:
            raise field_error(name, ids, f"layer {x} is out of range [0, {n}) (num_hidden_layers={n})")
        if ratios is not None and ratios[x] == 0:
            raise field_error(name, ids, f"layer {x} is uncompressed (compress_ratios[{x}]=0) and cannot be a source")
    first = next((x for x in range(n) if ratios is None or ratios[x] != 0), None)  # first participating layer
    if first is not None and (not ids or ids[0] != first):
        where = f" (compress_ratios[{first}]={ratios[first]})" if ratios is not None else ""
        raise field_error(name, ids, f"layer {first} has no preceding {kind} source{where}")
    return tuple(ids)


def v41_attention_field(hf: dict[str, Any]) -> str | None:
    """The first of V41_ATTENTION_FIELDS ``hf`` sets to other than its "none" value, else None."""
    off = {"candidate_source_layer_id": -1, "candidate_topk_blocks": 0}
    for name in V41_ATTENTION_FIELDS:
        value = hf.get(name)
        if value is not None and value != off.get(name):
            return name
    return None
