"""deploy/grafana/tierkv.json names only metrics (and labels) a daemon exports (issue #37):
read from the Prometheus text of a real daemon after some traffic, plus the remote tier's
families, which a daemon without a cluster does not export."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import tierkv
from helpers.daemons import DaemonThread
from daemon_helpers import SCOPE, make_config, pages_for, prompt
from tierkv.daemon.metrics import remote_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tierkv.json"
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum", "_created")}
ADDED_BY_PROMETHEUS = {"instance", "job", "le"}


def exported(workdir) -> dict[str, set[str] | None]:
    """Sample name -> label names (None: no sample yet shows them), of everything a daemon's
    /metrics shows after traffic that evicts and fails a request."""
    d = DaemonThread(make_config(workdir, metrics_port=0)).start()
    try:
        with tierkv.connect(d.config.socket) as c:
            toks = prompt(64, seed=7)
            c.put(toks, pages_for(4, 7), SCOPE)
            many = prompt(16 * 300, seed=8)
            c.put(many, pages_for(300, 8), SCOPE)  # over the 1 MiB device tier: evictions by reason
            c.lookup(toks, SCOPE)
            with c.acquire(toks, SCOPE):
                pass
            try:
                c.get_manifest("no such prefix")  # an error reply: tierkv_request_errors{op,error}
            except tierkv.errors.NotFoundError:
                pass
            text = urllib.request.urlopen(f"http://127.0.0.1:{d.daemon.metrics_port}/metrics", timeout=10).read().decode()
    finally:
        d.stop()
    families = list(text_string_to_metric_families(text))
    families += list(remote_metrics({"available": True, "faults": {"timeout": 1}}))
    names: dict[str, set[str] | None] = {}
    for f in families:
        labels = {k for s in f.samples for k in s.labels} if f.samples else None
        for suffix in SUFFIXES.get(f.type, ("",)):
            names[f.name + suffix] = labels
    return names


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, expression, legend) of every query, the templating's included."""
    out = [(p["title"], t["expr"], t.get("legendFormat", "")) for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [(f"variable {v['name']}", v["query"], "") for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return out


def test_the_dashboard_names_only_exported_metrics_and_labels(workdir):
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "tierkv"
    names = exported(workdir)
    used: set[str] = set()
    for title, expr, legend in queries(dashboard):
        metrics = set(re.findall(r"\btierkv_[a-z0-9_]+", expr))
        assert metrics, f"{title}: {expr} names no tierkv metric"
        unknown = metrics - set(names)
        assert not unknown, f"{title}: {sorted(unknown)} are not exported"
        used |= metrics
        labels = set(re.findall(r"\bby \(([^)]*)\)", expr))
        wanted = {x.strip() for group in labels for x in group.split(",")} | set(re.findall(r"\{\{(\w+)\}\}", legend))
        if any(names[m] is None for m in metrics):
            continue  # a labelled family no sample showed (no refusal happened): its labels are unseen
        known = set().union(*(names[m] or set() for m in metrics)) | ADDED_BY_PROMETHEUS
        assert wanted <= known, f"{title}: labels {sorted(wanted - known)} are not on {sorted(metrics)}"
    # Every family the daemon exports on its own is on some panel (a new metric gets a panel).
    families = {re.sub(r"_(total|created|bucket|count|sum)$", "", n) for n in names}
    shown = {re.sub(r"_(total|created|bucket|count|sum)$", "", n) for n in used}
    assert families - shown <= {"tierkv_puts", "tierkv_blocks_stored", "tierkv_promotions", "tierkv_demotions",
                                "tierkv_evictions", "tierkv_acquire_asked_blocks", "tierkv_hit_rate",
                                "tierkv_remote_fetched_bytes", "tierkv_remote_misses", "tierkv_remote_verify_failures",
                                "tierkv_remote_reconnects", "tierkv_remote_published_blocks",
                                "tierkv_remote_published_bytes", "tierkv_remote_publish_failed_blocks",
                                "tierkv_remote_pulled_blocks"}, sorted(families - shown)
