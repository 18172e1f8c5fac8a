"""The stats of the several layouts' stores one home holds, merged into one answer (the
daemon's STATS and ``tierkv stats --home`` of a many-layout home)."""
from __future__ import annotations

from typing import Any

_RATES = ("hit_rate", "hit_rate_by_tier", "acquire_hit_rate", "acquire_hit_rate_by_tier", "mean_lookup_ms")  # recomputed


def _sum(values: list[Any]) -> Any:
    """Numbers add up, mappings merge key by key, anything else keeps the first value."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sum(values)
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _sum([v[k] for v in values if k in v]) for k in keys}
    return values[0]


def merge_stats(per_layout: dict[str, dict[str, Any]], home: str) -> dict[str, Any]:
    """The stats of several layouts' stores (each StoreStats' JSON shape) as one: blocks,
    bytes and counters summed, rates recomputed from the sums, ``layout`` the only layout's
    or None, and ``layouts`` with each store's own figures (layout id -> its stats)."""
    from ..stats import Counters, acquire_rates

    stores = list(per_layout.values())
    out: dict[str, Any] = _sum(stores) if stores else {
        "blocks": 0, "leased_blocks": 0, "model_versions": {}, "namespaces": {}, "disk_read_path": "",
        "tiers": {t: {"blocks": 0, "used_bytes": 0, "capacity_bytes": 0} for t in ("device", "host", "disk")},
        **Counters().as_dict(),
    }
    for name in _RATES:
        out.pop(name, None)
    lookups, asked = int(out.get("lookups", 0)), int(out.get("lookup_blocks", 0))
    hits = dict(out.get("hits", {}))
    out["hit_rate"] = sum(hits.values()) / asked if asked else 0.0
    out["hit_rate_by_tier"] = {t: n / asked if asked else 0.0 for t, n in hits.items()}
    out.update(acquire_rates(dict(out.get("acquire_hits", {})), int(out.get("acquire_blocks", 0))))
    ms = sum(s.get("mean_lookup_ms", 0.0) * s.get("lookups", 0) for s in stores)
    out["mean_lookup_ms"] = ms / lookups if lookups else 0.0
    out["home"] = home
    out["layout"] = stores[0]["layout"] if len(stores) == 1 else {}
    out["layouts"] = per_layout
    return out
