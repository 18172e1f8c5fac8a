"""Prometheus metrics of the daemon, served as text on <metrics_host>:<metrics_port> (127.0.0.1 by default).

Store-side numbers (lookups, hits by tier, occupancy, promotions, demotions, evictions,
quarantined blocks) are read from ``Store.stats()`` when scraped, by a collector, so they
cannot drift from the store's own counters. Request latency is measured by the server.
A private CollectorRegistry keeps the process-global default registry (and whatever an
embedding application registered there) out of it.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class StoreCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], daemon_stats: Callable[[], dict[str, Any]],
                 page_bytes: int) -> None:
        self._stats = stats
        self._daemon_stats = daemon_stats
        self._page = page_bytes

    def collect(self) -> Iterator[Any]:
        try:
            s = self._stats()
        except Exception:  # noqa: BLE001 - a closed store must not break the scrape
            log.debug("store stats unavailable", exc_info=True)
            return
        page = self._page
        c = CounterMetricFamily("tierkv_lookups", "Lookups served")
        c.add_metric([], s["lookups"])
        yield c
        c = CounterMetricFamily("tierkv_lookup_blocks", "Full blocks asked for by lookups")
        c.add_metric([], s["lookup_blocks"])
        yield c
        hits = CounterMetricFamily("tierkv_hit_blocks", "Blocks found by lookups, by the tier found in", labels=["tier"])
        for tier, n in s["hits"].items():
            hits.add_metric([tier], n)
        yield hits
        acq = CounterMetricFamily("tierkv_acquire_blocks", "Blocks leased by acquires, by source tier", labels=["tier"])
        for tier, n in s["acquire_hits"].items():
            acq.add_metric([tier], n)
        yield acq
        c = CounterMetricFamily("tierkv_acquire_asked_blocks", "Full blocks asked for by acquires")
        c.add_metric([], s.get("acquire_blocks", 0))
        yield c
        ev = CounterMetricFamily("tierkv_evictions", "Blocks evicted, by tier", labels=["tier"])
        for tier, n in s["evictions"].items():
            ev.add_metric([tier], n)
        yield ev
        yield from policy_metrics(s)
        for name, key, doc in (("tierkv_promotions", "promoted_bytes", "Pages copied up into the device tier"),
                               ("tierkv_demotions", "demoted_bytes", "Pages copied down a tier")):
            fam = CounterMetricFamily(name, doc)
            fam.add_metric([], s[key] // page if page else 0)
            yield fam
            fam = CounterMetricFamily(name.replace("tions", "ted") + "_bytes", doc + " (bytes)")
            fam.add_metric([], s[key])
            yield fam
        for name, key, doc in (("tierkv_quarantined_blocks", "quarantined", "Blocks quarantined (corrupt or mismatched)"),
                               ("tierkv_token_mismatches", "token_mismatch", "Hits rejected by the token-id check"),
                               ("tierkv_puts", "puts", "Put calls"), ("tierkv_blocks_stored", "blocks_stored", "Blocks stored")):
            fam = CounterMetricFamily(name, doc)
            fam.add_metric([], s[key])
            yield fam
        used = GaugeMetricFamily("tierkv_tier_used_bytes", "Bytes of pages held, by tier", labels=["tier"])
        cap = GaugeMetricFamily("tierkv_tier_capacity_bytes", "Capacity, by tier", labels=["tier"])
        blocks = GaugeMetricFamily("tierkv_tier_blocks", "Blocks held, by tier", labels=["tier"])
        for tier, t in s["tiers"].items():
            if "used_bytes" not in t:
                continue  # the remote tier: cluster-wide, its own metrics below
            used.add_metric([tier], t["used_bytes"])
            cap.add_metric([tier], t["capacity_bytes"])
            blocks.add_metric([tier], t["blocks"])
        yield from (used, cap, blocks)
        for name, value, doc in (("tierkv_blocks", s["blocks"], "Blocks in the store"),
                                 ("tierkv_leased_blocks", s["leased_blocks"], "Blocks under a lease")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        remote = s["tiers"].get("remote")
        if isinstance(remote, dict):
            yield from remote_metrics(remote)
        d = self._daemon_stats()
        for key, doc in (("leases", "Leases held by clients"), ("connections", "Client connections"),
                         ("staging_slots_used", "Staging slots in use")):
            g = GaugeMetricFamily(f"tierkv_daemon_{key}", doc)
            g.add_metric([], d.get(key, 0))
            yield g
        c = CounterMetricFamily("tierkv_daemon_fast_path_requests",
                                "Requests answered as their bytes arrived, before the connection's read loop woke")
        c.add_metric([], d.get("fast_path_requests", 0))
        yield c
        gc_stats = d.get("gc") or {}
        if gc_stats:  # the process's garbage-collector pauses (tierkv/daemon/gc_pauses.py)
            n = CounterMetricFamily("tierkv_daemon_gc_collections", "Garbage collections, by generation",
                                    labels=["generation"])
            worst = GaugeMetricFamily("tierkv_daemon_gc_pause_max_seconds",
                                      "Longest garbage-collector pause (the whole daemon stops), by generation",
                                      labels=["generation"])
            for gen, (count, ms) in enumerate(zip(gc_stats["collections"], gc_stats["pause_ms_max"])):
                n.add_metric([str(gen)], count)
                worst.add_metric([str(gen)], ms / 1000)
            yield n
            yield worst


def policy_metrics(s: Any) -> Iterator[Any]:
    """The eviction policy's figures (tierkv/policy.py): evictions by tier and reason, ghost
    hits, new blocks put in the cold segment, blocks no tier could take; lookup and
    acquire hit rates by tier."""
    ev = CounterMetricFamily("tierkv_evictions_by_reason", "Blocks evicted, by tier and reason "
                             "(ephemeral/pinned, or the policy segment: lru, cold, recent, frequent)",
                             labels=["tier", "reason"])
    for tier, reasons in (s.get("evicted_by") or {}).items():
        for reason, n in reasons.items():
            ev.add_metric([tier, reason], n)
    yield ev
    for name, key, doc in (("tierkv_ghost_hits", "ghost_hits", "Blocks stored again while remembered as evicted"),
                           ("tierkv_cold_admissions", "cold_admissions", "New blocks the policy placed in its cold segment")):
        fam = CounterMetricFamily(name, doc, labels=["tier"])
        for tier, n in (s.get(key) or {}).items():
            fam.add_metric([tier], n)
        yield fam
    fam = CounterMetricFamily("tierkv_admissions_refused", "Blocks of a put that no tier could take")
    fam.add_metric([], s.get("admissions_refused", 0))
    yield fam
    g = GaugeMetricFamily("tierkv_hit_rate", "Lookup blocks found, over blocks asked for, by tier found in", labels=["tier"])
    for tier, rate in (s.get("hit_rate_by_tier") or {}).items():
        g.add_metric([tier], rate)
    yield g
    g = GaugeMetricFamily("tierkv_acquire_hit_rate", "Blocks leased by acquires, over full blocks asked for, "
                          "by tier found in", labels=["tier"])
    for tier, rate in (s.get("acquire_hit_rate_by_tier") or {}).items():
        g.add_metric([tier], rate)
    yield g


REMOTE_COUNTERS = (
    ("hits", "tierkv_remote_hit_blocks", "Blocks fetched from the remote tier and verified"),
    ("fetched_bytes", "tierkv_remote_fetched_bytes", "Bytes fetched from the remote tier (verified objects)"),
    ("misses", "tierkv_remote_misses", "Blocks gone from the remote tier between the existence check and the fetch"),
    ("verify_failures", "tierkv_remote_verify_failures", "Remote objects that failed verification (a miss each)"),
    ("reconnects", "tierkv_remote_reconnects", "Times the remote tier came back up after being down"),
    ("published", "tierkv_remote_published_blocks", "Blocks this node published to the remote tier"),
    ("published_bytes", "tierkv_remote_published_bytes", "Bytes this node published to the remote tier"),
    ("publish_failed", "tierkv_remote_publish_failed_blocks", "Blocks not published (tier down, pool full)"),
    ("pulled_blocks", "tierkv_remote_pulled_blocks", "Blocks pulled from the remote tier into the local store"),
)


def remote_metrics(r: dict[str, Any]) -> Iterator[Any]:
    """tierkv_remote_* from the ``tiers.remote`` summary (ClusterNode.remote_summary)."""
    g = GaugeMetricFamily("tierkv_remote_up", "1 while the remote tier is up, 0 while degraded (served locally)")
    g.add_metric([], 1 if r.get("available") else 0)
    yield g
    for key, name, doc in REMOTE_COUNTERS:
        c = CounterMetricFamily(name, doc)
        c.add_metric([], int(r.get(key, 0) or 0))
        yield c
    f = CounterMetricFamily("tierkv_remote_faults", "Remote tier faults, by reason", labels=["reason"])
    for reason, n in (r.get("faults") or {}).items():
        f.add_metric([str(reason)], n)
    yield f


class DaemonMetrics:
    """The registry, the request counters and histogram, and the HTTP endpoint."""

    def __init__(self, stats: Callable[[], dict[str, Any]], daemon_stats: Callable[[], dict[str, Any]],
                 page_bytes: int) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StoreCollector(stats, daemon_stats, page_bytes))
        self.latency = Histogram("tierkv_request_seconds", "Daemon request latency, by opcode", ["op"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.errors = Counter("tierkv_request_errors", "Requests answered with an error, by opcode and error",
                              ["op", "error"], registry=self.registry)
        self.rejected = Counter("tierkv_rejected_connections", "Connections refused (peer uid, limits, bad frames)",
                                ["reason"], registry=self.registry)
        self.quota_refusals = Counter("tierkv_quota_refusals", "Requests refused by a per-uid quota, by quota",
                                      ["quota"], registry=self.registry)
        self._latency_of: dict[str, Any] = {}  # op -> its histogram child (labels() locks and looks up)
        self._server: Any = None
        self.port: int | None = None

    def observe_latency(self, op: str, seconds: float) -> None:
        """One request of ``op`` took ``seconds`` (called on the loop for every request)."""
        child = self._latency_of.get(op)
        if child is None:
            child = self._latency_of[op] = self.latency.labels(op)
        child.observe(seconds)

    def start(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve on ``host``:``port`` (0: any free port); returns the port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.port = int(server.server_port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
