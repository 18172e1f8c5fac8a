"""The publish policy's decisions, case by case."""
from __future__ import annotations

import pytest

from tierkv import Priority
from tierkv.cluster import PublishPolicy
from tierkv.cluster.publish_policy import Event

N, P, E = Priority.NORMAL, Priority.PINNED, Priority.EPHEMERAL


@pytest.mark.parametrize("policy,event,prio,want", [
    (PublishPolicy(), Event.PUT, N, False),
    (PublishPolicy(), Event.PUT, P, True),
    (PublishPolicy(), Event.PUT, E, False),
    (PublishPolicy(), Event.PINNED, N, True),
    (PublishPolicy(), Event.MATERIALISED, N, True),
    (PublishPolicy(), Event.EVICTED, N, False),
    (PublishPolicy(publish_puts=True), Event.PUT, N, True),
    (PublishPolicy(publish_puts=True), Event.PUT, E, False),
    (PublishPolicy(publish_pinned=False), Event.PUT, P, False),
    (PublishPolicy(publish_materialised=False), Event.MATERIALISED, N, False),
    (PublishPolicy(write_back_evicted=True), Event.EVICTED, N, True),
])
def test_wants(policy, event, prio, want):
    assert policy.wants(event, "default", prio) is want


def test_local_only_namespace_is_neither_published_nor_fetched():
    p = PublishPolicy(publish_puts=True, write_back_evicted=True, local_only_namespaces=frozenset({"t"}))
    assert not any(p.wants(e, "t", P) for e in Event)
    assert not p.fetches("t") and p.fetches("u")


def test_policy_is_validated():
    with pytest.raises(ValueError):
        PublishPolicy(local_only_namespaces=frozenset({""}))
    with pytest.raises(ValueError):
        PublishPolicy(promote_priority=1)  # type: ignore[arg-type]
