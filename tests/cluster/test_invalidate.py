"""``invalidate`` through a cluster node reaches the remote tier's copies of the blocks the
node holds (issue 10, item 3). Before: local blocks only, so the next request on the same
node pulled the invalidated blocks straight back from the remote tier. What it cannot
reach (objects of blocks the node does not hold) is documented on ClusterNode.invalidate."""
from __future__ import annotations

from tierkv import Priority, Scope

from .kit import BS, SCOPE, pages_for, toks


def test_invalidate_removes_the_remote_copies_of_the_nodes_blocks(nodes, cluster):
    a, b = nodes("a"), nodes("b")
    t, other = toks(40, 4), toks(41, 2)
    other_scope = Scope(SCOPE.model_version, "keep")
    a.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)  # published (write-through of pins)
    a.put(other, pages_for(other, other_scope), other_scope, priority=Priority.PINNED)
    assert len(cluster.objects) == 6
    assert a.invalidate(namespace=SCOPE.namespace, dry_run=True).removed_blocks == 4
    assert len(cluster.objects) == 6  # a dry run removes nothing anywhere
    assert a.invalidate(namespace=SCOPE.namespace).removed_blocks == 4
    assert len(cluster.objects) == 2 and a.counters["invalidated_remote"] == 4
    # Neither node finds the invalidated blocks any more, locally or remotely.
    assert a.lookup(t, SCOPE).tokens_matched == 0 and b.lookup(t, SCOPE).tokens_matched == 0
    with a.acquire(t, SCOPE) as lease:
        assert lease.num_blocks == 0
    assert b.lookup(other, other_scope).tokens_matched == 2 * BS  # another namespace stays


def test_what_a_node_does_not_hold_stays_remote_and_a_down_tier_keeps_its_copies(nodes, cluster):
    a, b = nodes("a"), nodes("b")
    t = toks(42, 3)
    a.put(t, pages_for(t), SCOPE, priority=Priority.PINNED)
    # b never held these blocks: its invalidation cannot name them (documented), a's can.
    assert b.invalidate(namespace=SCOPE.namespace).removed_blocks == 0
    assert len(cluster.objects) == 3
    cluster.down = True
    assert a.invalidate(model_version=SCOPE.model_version).removed_blocks == 3  # local goes on
    cluster.down = False
    assert len(cluster.objects) == 3 and a.counters["invalidated_remote"] == 0
