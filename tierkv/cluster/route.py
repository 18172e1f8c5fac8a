"""Cache-aware routing: ask every node how much of a request it would serve from cache.

Each node answers with its own ``lookup`` (a daemon through ``tierkv.connect(socket)``,
or an embedded store or :class:`~tierkv.cluster.node.ClusterNode`), so the answer counts
whatever that node can serve, the remote tier included when the node has one. Nodes are
asked in parallel with a deadline; a node that fails or is late counts 0 tokens and is
never chosen. Ties go to the node listed first, so a fixed node order gives stable routes.

Security: a lookup answer reveals whether a prompt was cached. Route only with a scope
derived on the trusted side (the router's own tenant mapping), never one taken from a client.
"""
from __future__ import annotations

import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from ..errors import NotFoundError, TierKVError
from ..identity import Scope, as_token_array
from ..results import LookupResult


class Lookupable(Protocol):
    def lookup(self, tokens: Any, scope: Scope, block_extra: Any = None) -> LookupResult: ...


@dataclass(frozen=True)
class NodeAnswer:
    node: str
    cached_tokens: int
    tiers: tuple[str, ...]  # tier of each cached block on that node
    error: str | None
    seconds: float


@dataclass(frozen=True)
class RouteResult:
    best_node: str | None  # None when no node answered
    per_node: dict[str, int]  # node -> cached tokens (0 for nodes that failed)
    answers: tuple[NodeAnswer, ...]
    tokens: int  # length of the request

    def to_dict(self) -> dict[str, object]:
        return {
            "best_node": self.best_node, "per_node": dict(self.per_node), "tokens": self.tokens,
            "errors": {a.node: a.error for a in self.answers if a.error},
            "tiers": {a.node: _tier_counts(a.tiers) for a in self.answers if not a.error},
        }


def _tier_counts(tiers: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tiers:
        out[t] = out.get(t, 0) + 1
    return out


def route(tokens: Sequence[int] | np.ndarray, nodes: Mapping[str, Lookupable], scope: Scope,
          block_extra: Sequence[Sequence[str | bytes]] | None = None, timeout_s: float = 5.0) -> RouteResult:
    """The node that holds the longest cached prefix of ``tokens``, and what each holds.
    Never raises for a node's failure (it is reported in ``answers``)."""
    arr = as_token_array(tokens)
    names = list(nodes)

    def ask(name: str) -> NodeAnswer:
        t0 = time.perf_counter()
        try:
            res = nodes[name].lookup(arr, scope, block_extra)
            return NodeAnswer(name, int(res.tokens_matched), tuple(res.tiers), None, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - one bad node must not fail the route
            return NodeAnswer(name, 0, (), f"{type(e).__name__}: {e}", time.perf_counter() - t0)

    answers: list[NodeAnswer] = []
    pool = ThreadPoolExecutor(max(1, min(len(names), 16)), thread_name_prefix="tierkv-route")
    try:
        futures = [pool.submit(ask, n) for n in names]
        deadline = time.monotonic() + timeout_s
        for name, fut in zip(names, futures, strict=True):
            try:
                answers.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                answers.append(NodeAnswer(name, 0, (), f"no answer within {timeout_s:g} s", timeout_s))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    best: NodeAnswer | None = None
    for a in answers:
        if a.error is None and (best is None or a.cached_tokens > best.cached_tokens):
            best = a
    per_node = {a.node: a.cached_tokens for a in answers}
    return RouteResult(best.node if best else None, per_node, tuple(answers), len(arr))


def _layout_id(layout: Any) -> str:
    from ..home.directory import layout_id

    return layout_id(layout)


def open_node(spec: str | os.PathLike[str], connect: Callable[[Path], Any] | None = None,
              layout: Any = None, **store_options: Any) -> Any:
    """A lookup-able handle on a node: a socket path gives a daemon client
    (``tierkv.connect``); a store home directory gives an embedded store opened with its
    own layout (for tests and single-host use; it takes the home's lock; ``store_options``
    default to a CPU device tier and no host tier, as the operations tools open homes).
    ``layout`` (the request's page layout) picks that layout's store on a node holding
    several (a daemon serving several models, or the home it made); a node without it is
    asked as before (it holds no block of the request), and none is created. Raises
    NotFoundError otherwise."""
    import tierkv

    path = Path(spec)
    try:
        mode = path.stat().st_mode
    except OSError:
        raise NotFoundError(f"no tierkv node at {path}",
                            hint="pass a daemon socket (tierkv serve) or a store home") from None
    if stat.S_ISSOCK(mode):
        client = (connect or tierkv.connect)(path)
        if layout is not None and client.layout is None and _layout_id(layout) in getattr(client, "layouts", ()):
            client.close()
            client = tierkv.connect(path, layout=layout)
        return client
    if stat.S_ISDIR(mode):
        home = path
        if layout is not None:
            from ..home.directory import find_layouts

            home = next((h for h, lo in find_layouts(path) if lo == layout), path)
        return tierkv.open(home, None, **{"device": "cpu", "host_bytes": 0, **store_options})
    raise NotFoundError(f"{path} is neither a socket nor a store home")


@dataclass(frozen=True)
class ResolvedPrefix:
    tokens: list[int]
    namespace: str | None  # the namespace its blocks were stored under, when the manifest says
    node: str  # the node whose manifest gave it


def resolve_prefix(name: str, nodes: Mapping[str, Any], lm: Any) -> ResolvedPrefix:
    """The prefix materialised as ``name`` on any of ``nodes`` (the first whose manifest
    re-derives under ``lm``: same model version, unchanged sources), its token ids rebuilt
    from its sources with ``lm``'s tokenizer. Raises NotFoundError naming each node's reason."""
    from ..materialize import load_prefix

    reasons = []
    for node_name, node in nodes.items():
        try:
            loaded = load_prefix(node, lm, name)
        except TierKVError as e:
            reasons.append(f"{node_name}: {e.message}")
            continue
        except Exception as e:  # noqa: BLE001 - an unreachable node is one reason among others
            reasons.append(f"{node_name}: {type(e).__name__}: {e}")
            continue
        if isinstance(loaded, list):  # older load_prefix: the token ids alone
            return ResolvedPrefix(loaded, None, node_name)
        return ResolvedPrefix(list(loaded.tokens), getattr(loaded, "namespace", None), node_name)
    raise NotFoundError(f"no node can give prefix {name!r} ({'; '.join(reasons)})")
