"""The cross-layer sharing fields of a config, validated once for the PP planner and the runtime decoder.

``engram.parallel.pp_graph`` (``engram plan-pp``) and ``engram.model.model_config.ModelConfig`` (``load_model``)
read ``num_hidden_layers``, ``compress_ratios`` and the source lists through these functions, so a layout is
accepted by both or refused by both with the same message, ``<field>=<value>: <why>`` (ValueError).

Source-list rule (``source_layer_ids``): a list of ints, unique, ascending, each in ``[0, num_hidden_layers)``
and a layer that takes part in sharing (``compress_ratios[x] != 0``; without ``compress_ratios`` every layer
does); every participating layer reads the nearest source at or before it, so the first participating layer
must itself be a source. Our decoder has no ``compress_ratios``, so its ``kv_source_layer_ids`` starts at 0.

The runtime decoder implements KV sharing only: ``v41_attention_field`` names the first DeepSeek-V4.1
attention field (compressed KV, indexer, candidate blocks) a config sets, which the planner plans and the
runtime refuses to load.
"""
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
    """V4.1 ``compress_ratios`` cut to the ``n`` decoder layers (extra entries belong to MTP layers, which are
    not pipeline stages); None when absent. Entries are ints >= 0, 0 = sliding window only (no sharing)."""
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
    """Validate a source list (``kv_source_layer_ids``: kind ``kv``; ``index_source_layer_ids``: kind
    ``index``) of a decoder with ``n`` layers by the module's rule; the list as a tuple, None when ``ids`` is
    None. The value in a message is always shown as a list, whatever sequence type came in."""
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
    """The first of V41_ATTENTION_FIELDS that ``hf`` sets to something other than "none" (absent, null,
    -1 for the candidate source, 0 for the candidate blocks); None when the config uses none of them."""
    off = {"candidate_source_layer_id": -1, "candidate_topk_blocks": 0}
    for name in V41_ATTENTION_FIELDS:
        value = hf.get(name)
        if value is not None and value != off.get(name):
            return name
    return None
