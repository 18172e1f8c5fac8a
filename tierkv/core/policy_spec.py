"""Which eviction policy each tier uses: the ``eviction_policy`` setting, read in one place.

A tier's cost and its hits' worth differ (docs/operations.md, "Sizing the tiers"): ``leader``
(tierkv/core/policy_leader.py) has the better hits away from the trace ``arc`` was tuned on,
at about 8x ``arc``'s metadata per slot and several times its time per block touched, so an
operator may want it on a small host tier and not on a disk tier of a million slots. The
setting is either one policy for every tier (``"arc"``, as before) or a comma-separated list
of ``tier=policy`` pairs with at most one bare policy, the others' default (``"leader,
disk=arc"``; a tier not named and no bare policy: :data:`DEFAULT_POLICY`).
"""
from __future__ import annotations

from ..tiers.base import TierName
from .policy import DEFAULT_POLICY, POLICIES


def tier_policies(spec: str) -> dict[TierName, str]:
    """The policy of every tier named by ``spec`` (module docstring); ValueError, saying
    what is wrong and what is allowed, for anything else."""
    if not isinstance(spec, str):
        raise ValueError(f"eviction_policy must be a string such as \"arc\" or \"leader,disk=arc\", got {spec!r}")
    tiers = {t.value: t for t in TierName}
    default, named = "", {}
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise ValueError(f"eviction_policy {spec!r} has an empty part; give a policy ({', '.join(POLICIES)}) "
                         f"or tier=policy pairs, e.g. \"leader,disk=arc\"")
    for part in parts:
        tier, sep, name = (s.strip() for s in part.partition("="))
        if not sep:
            tier, name = "", tier
        if name not in POLICIES:
            raise ValueError(f"eviction_policy {spec!r}: unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        if not sep:
            if default:
                raise ValueError(f"eviction_policy {spec!r} names two policies for every tier ({default!r} and "
                                 f"{name!r}); give at most one, and tier=policy for the others")
            default = name
        elif tier not in tiers:
            raise ValueError(f"eviction_policy {spec!r}: unknown tier {tier!r}; the tiers are {', '.join(tiers)}")
        elif tiers[tier] in named:
            raise ValueError(f"eviction_policy {spec!r} names the {tier} tier twice")
        else:
            named[tiers[tier]] = name
    return {t: named.get(t, default or DEFAULT_POLICY) for t in TierName}


def describe(policies: dict[TierName, str]) -> str:
    """The shortest spec that gives ``policies``: one name when every tier agrees."""
    names = set(policies.values())
    if len(names) == 1:
        return names.pop()
    return ",".join(f"{t.value}={policies[t]}" for t in TierName)
