"""CHAIN_TOKENS, CHAIN_RESIDENCY and SET_PRIORITY_FROM: the client offers every store method
the operations CLI, tierkv.transfer and tierkv.gc call, with the embedded store's results;
``ls pin unpin gc export import`` give the same JSON through ``--socket`` as with ``--home``."""
from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

import tierkv
from tierkv import Priority, Scope, block_keys
from tierkv.cli import main
from tierkv.daemon.client import Client
from tierkv.errors import NotFoundError
from tierkv.store import Store

from helpers.daemons import DaemonThread
from daemon_helpers import LAYOUT, MiB, SCOPE, make_config, pages_for, prompt


def manifest_for(tokens: np.ndarray, scope: Scope, pinned: bool = False) -> dict:
    keys = block_keys(tokens, scope, LAYOUT.block_size)
    return {"kind": "prefix", "format": 1, "model_version": scope.model_version, "namespace": scope.namespace,
            "layout": LAYOUT.to_dict(), "tokens": len(tokens), "blocks": len(keys), "last_block_key": keys[-1].hex(),
            "tokens_sha256": hashlib.sha256(tokens.tobytes()).hexdigest(), "pinned": pinned, "options": {},
            "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def test_client_offers_every_store_method_the_tools_call():
    # What cli/ops.py, transfer.py and gc.py call on a store (ops' need() lists and the
    # library calls); each must exist on the client with the store's parameter names.
    used = {"acquire", "chain_residency", "chain_tokens", "check_integrity", "delete_manifest", "get_manifest",
            "invalidate", "list_manifests", "put", "save_manifest", "set_priority", "set_priority_from", "stats",
            "verify", "lookup", "release", "prefetch", "close"}
    for name in sorted(used):
        assert callable(getattr(Client, name, None)), f"Client lacks {name}"
        want = list(inspect.signature(getattr(Store, name)).parameters)
        got = list(inspect.signature(getattr(Client, name)).parameters)
        assert got == want, f"{name}: client parameters {got} differ from the store's {want}"


def test_chain_methods_match_the_embedded_store(daemon, workdir):
    embedded = tierkv.open(workdir / "embedded", LAYOUT, device="cpu", device_bytes=1 * MiB, host_bytes=2 * MiB,
                           disk_bytes=8 * MiB, shm_dir=workdir / "shm")
    try:
        with tierkv.connect(daemon.config.socket) as c:
            toks = prompt(80, seed=11)
            last = block_keys(toks, SCOPE, LAYOUT.block_size)[-1]
            for s in (embedded, c):
                s.put(toks, pages_for(5, 11), SCOPE)
            a, b = embedded.chain_tokens(last), c.chain_tokens(last)
            assert np.array_equal(a[0], b[0]) and a[1:] == b[1:] == (SCOPE.model_version, SCOPE.namespace)
            assert np.array_equal(b[0], toks)
            assert res(embedded.chain_residency(last)) == res(c.chain_residency(last))
            assert res(c.chain_residency(last))["blocks"] == 5
            assert embedded.set_priority_from(last, Priority.PINNED) == c.set_priority_from(last, Priority.PINNED) == 5
            assert res(c.chain_residency(b"\0" * 32))["blocks"] == 0
            with pytest.raises(NotFoundError):
                c.chain_tokens(b"\1" * 32)
            with pytest.raises(NotFoundError):
                embedded.chain_tokens(b"\1" * 32)
    finally:
        embedded.close()


def test_chain_methods_are_confined_to_the_callers_namespace(workdir):
    d = DaemonThread(make_config(workdir, namespace_per_uid=True)).start()
    try:
        with tierkv.connect(d.config.socket) as c:
            toks = prompt(32, seed=12)
            c.put(toks, pages_for(2, 12), SCOPE)
            own = block_keys(toks, Scope(SCOPE.model_version, f"uid{os.getuid()}/{SCOPE.namespace}"),
                             LAYOUT.block_size)[-1]
            _, _, ns = c.chain_tokens(own)
            assert ns == SCOPE.namespace  # the client sees its own name, not the daemon's prefix
            # A chain stored outside this uid's prefix (put by the daemon's operator directly).
            other = Scope(SCOPE.model_version, "uid999999/x")
            d.daemon.store.put(toks, pages_for(2, 13), other)
            foreign = block_keys(toks, other, LAYOUT.block_size)[-1]
            # Another tenant's chain reads as one that is not stored (as the store answers).
            with pytest.raises(NotFoundError):
                c.chain_tokens(foreign)
            assert res(c.chain_residency(foreign))["blocks"] == 0
            assert c.set_priority_from(foreign, Priority.PINNED) == 0
            assert res(d.daemon.store.chain_residency(foreign))["blocks"] == 2  # it is there, untouched
            assert d.daemon.store.set_priority_from(foreign, Priority.NORMAL) == 2
    finally:
        d.stop()


def res(r) -> dict:
    return r.as_dict() if hasattr(r, "as_dict") else dict(r)


def run_json(*args: str) -> dict:
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_ops_commands_through_the_socket_match_the_home(workdir):
    """ls, pin, unpin, gc, export, import with --socket, then the same with --home on the
    same home once the daemon is stopped: the same JSON."""
    cfg = make_config(workdir)
    d = DaemonThread(cfg).start()
    other = Scope("cd" * 32, "tenant-b")
    toks = prompt(64, seed=14)
    bundle = workdir / "docs.tkv"
    try:
        with tierkv.connect(cfg.socket) as c:
            c.put(toks, pages_for(4, 14), SCOPE)
            c.save_manifest("docs", manifest_for(toks, SCOPE))
            c.put(prompt(32, seed=15), pages_for(2, 15), other)
        sock = ("--socket", str(cfg.socket))
        via_socket = {
            "ls": run_json("ls", *sock),
            "pin": run_json("pin", "docs", *sock),
            "ls_pinned": run_json("ls", *sock),
            "unpin": run_json("unpin", "docs", *sock),
            "gc_dry": run_json("gc", "--dry-run", *sock),
            "export": run_json("export", "docs", "-o", str(bundle), *sock),
        }
        run_json("invalidate", "--namespace", SCOPE.namespace, *sock)
        imported = run_json("import", str(bundle), *sock)
        assert imported["stored_blocks"] == 4 and imported["name"] == "docs"
        with tierkv.connect(cfg.socket) as c, c.acquire(toks, SCOPE) as lease:
            assert lease.num_blocks == 4 and (lease.pages() == pages_for(4, 14)).all()
        assert via_socket["ls"]["prefixes"][0]["resident"]["blocks"] == 4
        assert via_socket["pin"]["blocks"] == 4 and via_socket["ls_pinned"]["prefixes"][0]["pinned"]
        assert via_socket["gc_dry"]["removed_blocks"] == 2  # tenant-b is named by no prefix
    finally:
        d.stop()
    home = ("--home", str(cfg.home))
    via_home = {
        "ls": run_json("ls", *home),
        "pin": run_json("pin", "docs", *home),
        "ls_pinned": run_json("ls", *home),
        "unpin": run_json("unpin", "docs", *home),
        "gc_dry": run_json("gc", "--dry-run", *home),
    }
    for k, v in via_home.items():
        a, b = json.dumps(v, sort_keys=True), json.dumps(via_socket[k], sort_keys=True)
        # Residency and freed bytes differ (the daemon's memory tiers hold copies of the
        # blocks); the rest must agree.
        if k == "gc_dry":
            for p in (v, via_socket[k]):
                p.pop("freed_bytes")
                for row in p["removed"]:
                    row.pop("freed_bytes")
        if k.startswith("ls") or k == "gc_dry":
            for p in (v, via_socket[k]):
                for row in p.get("prefixes", ()):
                    row["resident"] = row["resident"]["blocks"]
                    row.pop("created_at")
            a, b = json.dumps(v, sort_keys=True), json.dumps(via_socket[k], sort_keys=True)
        assert a == b, f"{k}: --home {a} != --socket {b}"
