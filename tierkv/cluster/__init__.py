"""Cluster features: a node that shares pages through the remote tier
(:mod:`tierkv.cluster.remote`), the policy for what it publishes, and cache-aware routing."""
from __future__ import annotations

from .node import ClusterNode, PullResult
from .publish_policy import PublishPolicy
from .route import NodeAnswer, RouteResult, open_node, route

__all__ = ["ClusterNode", "NodeAnswer", "PublishPolicy", "PullResult", "RouteResult", "open_node", "route"]
