"""Tenants under ``namespace_per_uid``, with a REAL second user: a forked child that drops
to uid 65534 (nobody) and uses the daemon through the library (issue 11, item 6).

Before: the child could not map the daemon's shared memory at all (the files are 0600 to
the daemon's user); a client of another uid saw every namespace in ``stats``, read and
overwrote other users' manifests, and ``invalidate`` without a namespace removed every
user's blocks."""
from __future__ import annotations

import json
import os
import stat

import torch
from click.testing import CliRunner

import tierkv
from tierkv import Priority, Scope, block_keys
from tierkv.cli import main
from tierkv.errors import NotFoundError
from tierkv.cli.common import OPS_STORE_OPTIONS
from tierkv.home import Home

from as_user import NOBODY, need_root, run_as
from helpers.daemons import DaemonThread
from daemon_helpers import LAYOUT, SCOPE, make_config, pages_for, prompt

OTHER = NOBODY - 1  # an uid the daemon does not admit


def test_another_uid_is_served_through_passed_descriptors_and_confined(workdir):
    need_root()
    os.chmod(workdir, 0o711)  # the socket directory's parent: others may pass through
    d = DaemonThread(make_config(workdir, namespace_per_uid=True, allowed_uids=(NOBODY,))).start()
    try:
        sock = d.config.socket
        assert stat.S_IMODE(os.stat(sock.parent).st_mode) == 0o711
        mine, theirs = prompt(64, seed=1), prompt(48, seed=2)
        # The daemon's own user (a tenant too) stores blocks and two named prefixes; the
        # same session imports everything the child will need.
        with tierkv.connect(sock) as c:
            c.put(mine, pages_for(4, 1), SCOPE)
            c.save_manifest("shared-name", {"owner": "root"})
            c.save_manifest("root-only", {"owner": "root"})
            with c.acquire(mine, SCOPE) as lease:
                lease.pages()
            c.list_manifests(), c.stats(), c.verify()
            try:
                c.get_manifest("nothing")
            except NotFoundError:
                pass
        for f in (workdir / "shm").iterdir():  # shared memory stays private to the daemon
            assert stat.S_IMODE(f.stat().st_mode) == 0o600

        def tenant() -> dict:
            out: dict = {"uid": os.getuid()}
            with tierkv.connect(sock) as t:
                t.put(theirs, pages_for(3, 2), SCOPE)  # through staging, mapped from a passed fd
                with t.acquire(theirs, SCOPE) as lease:  # pages read from the mapped device tier
                    out["pages_equal"] = bool(torch.equal(lease.pages(), pages_for(3, 2)))
                out["own_hit"] = t.lookup(theirs, SCOPE).tokens_matched
                out["root_hit"] = t.lookup(mine, SCOPE).tokens_matched
                out["manifests"] = sorted(t.list_manifests())
                for name in ("root-only",):
                    try:
                        t.get_manifest(name)
                        out["read_root_manifest"] = True
                    except NotFoundError as e:
                        out["read_root_manifest"] = False
                        out["not_found_message"] = e.message
                t.save_manifest("shared-name", {"owner": "nobody"})
                out["own_manifest"] = t.get_manifest("shared-name")
                st = t.stats()
                out["namespaces"] = sorted(st["namespaces"])
                out["has_model_versions"] = bool(st.get("model_versions"))
                one = t.stats(namespace_limit=1)  # its namespaces picked out before paging
                out["page"] = (sorted(one.namespaces), one.namespaces_next)
                out["layout_namespaces"] = sorted(ns for ls in st["layouts"].values() for ns in ls["namespaces"])
                out["invalidated"] = t.invalidate(model_version=SCOPE.model_version).removed_blocks
                try:
                    t.verify()
                    out["verify"] = "ran"
                except tierkv.TierKVError as e:
                    out["verify"] = type(e).__name__
            return out

        got = run_as(NOBODY, tenant)
        assert "ok" in got, got
        r = got["ok"]
        assert r["uid"] == NOBODY and r["pages_equal"] and r["own_hit"] == 48
        assert r["root_hit"] == 0  # cannot hit (or probe) another tenant's blocks
        assert r["manifests"] == [] and r["read_root_manifest"] is False
        assert r["not_found_message"].endswith("(known: none)")  # no other tenant's names
        assert r["own_manifest"] == {"owner": "nobody"}
        assert r["namespaces"] == [SCOPE.namespace] and not r["has_model_versions"]
        assert r["page"] == [[SCOPE.namespace], None] and r["layout_namespaces"] == [SCOPE.namespace]
        assert r["invalidated"] == 3  # its own 3 blocks, not root's 4
        assert r["verify"] == "NotPermittedError"
        with tierkv.connect(sock) as c:  # root's data is untouched
            assert c.lookup(mine, SCOPE).tokens_matched == 64
            assert c.get_manifest("shared-name") == {"owner": "root"}
            assert sorted(c.list_manifests()) == ["root-only", "shared-name"]
            assert sorted(c.stats()["namespaces"]) == [SCOPE.namespace]
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()


def test_a_uid_not_allowed_is_refused_for_real(workdir):
    """The kernel-reported uid of a real second user is refused (was: a mocked
    peer_credentials). The same daemon admits its own user and an allowed uid."""
    need_root()
    os.chmod(workdir, 0o711)
    d = DaemonThread(make_config(workdir, allowed_uids=(NOBODY,))).start()
    try:
        sock = d.config.socket
        with tierkv.connect(sock) as c:
            c.check_integrity()

        def connect() -> str:
            with tierkv.connect(sock) as t:
                t.ping()
            return "connected"

        refused = run_as(OTHER, connect)
        assert refused.get("error") == "DaemonUnavailableError", refused
        assert f"uid {OTHER}" in refused["message"]
        assert run_as(NOBODY, connect) == {"ok": "connected"}
        assert d.daemon.metrics is None or d.daemon.metrics.rejected.labels("uid")._value.get() >= 1
    finally:
        d.stop()


def test_the_client_refuses_a_listener_of_an_untrusted_uid(workdir):
    """Item 11: a fake listener run by another user got the client to map and overwrite
    pages of an arbitrary file. Now the client checks the listener's uid (SO_PEERCRED)
    before it sends or maps anything."""
    need_root()
    import socket

    from tierkv.errors import UntrustedDaemonError

    os.chmod(workdir, 0o711)
    fake_dir = workdir / "fake"
    fake_dir.mkdir()
    os.chown(fake_dir, NOBODY, NOBODY)
    path = fake_dir / "fake.sock"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fake daemon, as nobody: accept one client, report what it sent
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            srv = socket.socket(socket.AF_UNIX)
            srv.bind(str(path))
            os.chmod(path, 0o666)
            srv.listen()
            os.write(w, b"R")
            conn, _ = srv.accept()
            conn.settimeout(10)
            got = conn.recv(1 << 16)
            os.write(w, b"%d" % len(got))
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"R"
    try:
        try:
            tierkv.connect(path)
            raise AssertionError("the client trusted a listener of another uid")
        except UntrustedDaemonError as e:
            assert f"uid {NOBODY}" in e.message
        assert os.read(r, 16) == b"0"  # not one byte was sent to it
    finally:
        os.waitpid(pid, 0)
        os.close(r)


def test_a_tenant_maps_only_its_own_memory_and_cannot_spoil_another_s_pages(workdir):
    """Issue #34, item 1, with a real second uid: the tenant's mapped memory (everything its
    HELLO passed it) holds none of the owner's pages; scribbling over all of it changes
    nothing the owner reads, now or after a restart; the tenant's own put and lease work,
    also for a lease longer than its read window (cut to it: a shorter hit); and its pages
    stay out of reach once it disconnected."""
    need_root()
    os.chmod(workdir, 0o711)
    cfg = make_config(workdir, namespace_per_uid=True, allowed_uids=(NOBODY,), client_staging_bytes=64 * 1024)
    d = DaemonThread(cfg).start()
    window = 64 * 1024 // 8192  # read window slots (LAYOUT's page is 8 KiB)
    try:
        sock = d.config.socket
        mine, theirs, long_one = prompt(64, seed=11), prompt(48, seed=12), prompt(16 * (window + 3), seed=13)
        marker = pages_for(4, 11)  # the owner's pages, looked for in the tenant's memory
        with tierkv.connect(sock) as c:
            c.put(mine, marker, SCOPE)
            with c.acquire(mine, SCOPE) as lease:  # the owner's path is unchanged: zero copy
                assert lease.num_blocks == 4 and torch.equal(lease.pages(), marker)
            c.stats()

        def tenant() -> dict:
            out: dict = {}
            with tierkv.connect(sock) as t:
                t.put(theirs, pages_for(3, 12), SCOPE)
                with t.acquire(theirs, SCOPE) as lease:
                    out["own_pages_equal"] = bool(torch.equal(lease.pages(), pages_for(3, 12)))
                t.put(long_one, pages_for(window + 3, 13), SCOPE)
                with t.acquire(long_one, SCOPE) as lease:
                    out["long_lease_blocks"] = lease.num_blocks
                    out["long_prefix_equal"] = bool(torch.equal(lease.pages(), pages_for(window + 3, 13)[:lease.num_blocks]))
                pools = [p for p in (t.device_pool, t.host_pool, t.staging_pool) if p is not None]
                out["mapped_bytes"] = sum(p.numel() * p.element_size() for p in pools)
                raw = b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in pools)
                out["owner_page_seen"] = any(marker[i].numpy().tobytes()[:256] in raw for i in range(4))
                for p in pools:  # scribble on everything it can write
                    p.view(torch.uint8).fill_(0xA5)
                with t.acquire(theirs, SCOPE) as lease:  # its own bytes, copied afresh
                    out["own_after_scribble"] = bool(torch.equal(lease.pages(), pages_for(3, 12)))
            return out

        got = run_as(NOBODY, tenant)
        assert "ok" in got, got
        r = got["ok"]
        assert r["own_pages_equal"] and r["own_after_scribble"]
        assert r["long_lease_blocks"] == window and r["long_prefix_equal"]  # cut to the window
        assert r["mapped_bytes"] == 2 * 64 * 1024  # its read window and its staging, nothing else
        assert not r["owner_page_seen"]
        with tierkv.connect(sock) as c:  # the owner's pages are intact
            with c.acquire(mine, SCOPE) as lease:
                assert lease.num_blocks == 4 and torch.equal(lease.pages(), marker)
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
    d = DaemonThread(cfg).start()  # and after a restart
    try:
        with tierkv.connect(d.config.socket) as c:
            with c.acquire(mine, SCOPE) as lease:
                assert lease.num_blocks == 4 and torch.equal(lease.pages(), marker)
    finally:
        d.stop()


# ---- gc keeps every tenant's named prefixes (issue #34, item 5) ------------------------------
def _named_manifest(tokens, namespace: str) -> dict:
    """What materialize saves for a prefix (its keys computed by the client, under the
    namespace as the client names it)."""
    keys = block_keys(tokens, Scope(SCOPE.model_version, namespace), LAYOUT.block_size)
    return {"kind": "prefix", "model_version": SCOPE.model_version, "namespace": namespace, "pinned": True,
            "last_block_key": keys[-1].hex(), "blocks": len(keys), "tokens": len(tokens), "layout": LAYOUT.to_dict()}


NAMED, JUNK, LEGACY = prompt(64, seed=21), prompt(32, seed=22), prompt(32, seed=23)  # 4, 2 and 2 blocks


def _tenants_store_prefixes(sock) -> dict:
    """The daemon's own uid (a tenant too: uid0/) and uid 65534 each store a pinned named
    prefix in "default" and unnamed blocks in "scratch"; 65534 also 2 blocks in "older"."""
    with tierkv.connect(sock) as c:
        c.put(NAMED, pages_for(4, 1), Scope(SCOPE.model_version, "default"), priority=Priority.PINNED)
        c.save_manifest("docs", _named_manifest(NAMED, "default"))
        c.put(JUNK, pages_for(2, 2), Scope(SCOPE.model_version, "scratch"))
        c.get_manifest("docs"), c.list_manifests(), c.lookup(NAMED, SCOPE)

    def tenant() -> dict:
        with tierkv.connect(sock) as t:
            t.put(NAMED, pages_for(4, 3), Scope(SCOPE.model_version, "default"), priority=Priority.PINNED)
            t.save_manifest("docs", _named_manifest(NAMED, "default"))
            t.put(JUNK, pages_for(2, 4), Scope(SCOPE.model_version, "scratch"))
            t.put(LEGACY, pages_for(2, 5), Scope(SCOPE.model_version, "older"))
            out = {"namespace_seen": t.get_manifest("docs")["namespace"]}
            try:
                t.gc(dry_run=True)
                out["gc"] = "ran"
            except tierkv.TierKVError as e:
                out["gc"] = type(e).__name__
        return out

    got = run_as(NOBODY, tenant)
    assert "ok" in got, got
    return got["ok"]


def _served_to_tenant(sock) -> dict:
    def tenant() -> dict:
        with tierkv.connect(sock) as t:
            return {"named": t.lookup(NAMED, Scope(SCOPE.model_version, "default")).tokens_matched,
                    "junk": t.lookup(JUNK, Scope(SCOPE.model_version, "scratch")).tokens_matched,
                    "legacy": t.lookup(LEGACY, Scope(SCOPE.model_version, "older")).tokens_matched,
                    "manifests": sorted(t.list_manifests())}

    got = run_as(NOBODY, tenant)
    assert "ok" in got, got
    return got["ok"]


def test_gc_home_keeps_every_tenant_s_named_prefix(workdir):
    """`gc --home` removed uid 65534's pinned named prefix and deleted its manifest: the
    manifest said `default`, its blocks lived under `uid65534/default`."""
    need_root()
    os.chmod(workdir, 0o711)
    cfg = make_config(workdir, namespace_per_uid=True, allowed_uids=(NOBODY,))
    d = DaemonThread(cfg).start()
    try:
        seen = _tenants_store_prefixes(cfg.socket)
        assert seen["namespace_seen"] == "default"  # the tenant sees its namespace as it named it
    finally:
        d.stop()
    # A manifest saved before the daemon recorded the effective namespace (as sent: "older"),
    # but naming a stored chain: the chain says where its blocks are.
    legacy_key = block_keys(LEGACY, Scope(SCOPE.model_version, f"uid{NOBODY}/older"), LAYOUT.block_size)[-1]
    with Home.open(cfg.home, **OPS_STORE_OPTIONS) as h:
        h.save_manifest(f"uid{NOBODY}:legacy", {"model_version": SCOPE.model_version, "namespace": "older",
                                                "last_block_key": legacy_key.hex()})
    r = CliRunner().invoke(main, ["gc", "--home", str(cfg.home), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["removed_blocks"] == 4 and out["deleted_manifests"] == []  # both uids' scratch, nothing named
    kept = {k["name"]: k["namespace"] for k in out["kept_prefixes"]}
    assert kept == {"uid0:docs": "uid0/default", f"uid{NOBODY}:docs": f"uid{NOBODY}/default",
                    f"uid{NOBODY}:legacy": f"uid{NOBODY}/older"}
    assert next(k["blocks"] for k in out["kept_prefixes"] if k["name"].endswith(":legacy")) == 2
    human = CliRunner().invoke(main, ["gc", "--home", str(cfg.home), "--dry-run"])
    assert human.exit_code == 0 and f"uid{NOBODY}:docs" in human.output and "prefixes kept" in human.output
    d = DaemonThread(cfg).start()
    try:
        assert _served_to_tenant(cfg.socket) == {"named": 64, "junk": 0, "legacy": 32, "manifests": ["docs", "legacy"]}
        with tierkv.connect(cfg.socket) as c:
            assert c.lookup(NAMED, Scope(SCOPE.model_version, "default")).tokens_matched == 64
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
    with Home.open(cfg.home, **OPS_STORE_OPTIONS) as h:  # the daemon records where the blocks are
        assert h.get_manifest(f"uid{NOBODY}:docs")["namespace"] == f"uid{NOBODY}/default"


def test_gc_socket_keeps_every_tenant_s_named_prefix_and_is_the_daemon_user_s(workdir):
    """`gc --socket` from the daemon's own uid removed nothing and said nothing (its
    connection saw only its own tenant's namespaces, and no model version). Now the daemon
    runs it over every store: the same rule and result as `gc --home`; a tenant may not."""
    need_root()
    os.chmod(workdir, 0o711)
    cfg = make_config(workdir, namespace_per_uid=True, allowed_uids=(NOBODY,))
    d = DaemonThread(cfg).start()
    try:
        seen = _tenants_store_prefixes(cfg.socket)
        assert seen["gc"] == "NotPermittedError"  # another tenant's blocks are not a tenant's to remove
        r = CliRunner().invoke(main, ["gc", "--socket", str(cfg.socket), "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["removed_blocks"] == 6 and out["deleted_manifests"] == []  # scratch of both, 65534's older
        assert {(x["namespace"], x["blocks"]) for x in out["removed"]} == {
            ("uid0/scratch", 2), (f"uid{NOBODY}/scratch", 2), (f"uid{NOBODY}/older", 2)}
        kept = {k["name"]: k["namespace"] for k in out["kept_prefixes"]}
        assert kept == {"uid0:docs": "uid0/default", f"uid{NOBODY}:docs": f"uid{NOBODY}/default"}
        human = CliRunner().invoke(main, ["gc", "--socket", str(cfg.socket), "--dry-run"])
        assert human.exit_code == 0 and f"uid{NOBODY}:docs" in human.output, human.output
        assert _served_to_tenant(cfg.socket) == {"named": 64, "junk": 0, "legacy": 0, "manifests": ["docs"]}
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
