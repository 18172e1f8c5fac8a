"""A tenant's named prefix through a daemon under ``namespace_per_uid`` (found with issue
34, item 5): the daemon keeps a tenant's blocks in its own namespaces, so keys computed from
the namespace as sent named nothing: pin, export and ``ls`` of a tenant's prefix found 0
blocks and an import reported itself not durable. The client keys chains as the daemon
stores them (the HELLO's namespace prefix); a real second uid."""
from __future__ import annotations

import os

import tierkv
from tierkv import Priority
from tierkv.transfer import Trust, export_prefix, import_bundle

from as_user import NOBODY, need_root, run_as
from helpers.daemons import DaemonThread
from daemon_helpers import SCOPE, make_config, pages_for, prompt


def every_page(header, tokens, chunks) -> None:
    for _ in chunks:  # a model check that looks at every block and finds them all right
        pass


def test_a_tenant_pins_exports_and_imports_its_named_prefix(workdir):
    need_root()
    os.chmod(workdir, 0o711)
    out_dir = workdir / "bundles"
    out_dir.mkdir()
    os.chown(out_dir, NOBODY, NOBODY)
    d = DaemonThread(make_config(workdir, namespace_per_uid=True, allowed_uids=(NOBODY,))).start()
    toks = prompt(16 * 6, seed=21)

    def tenant() -> dict:
        with tierkv.connect(d.config.socket) as t:
            assert t.namespace_prefix == f"uid{NOBODY}/"
            t.put(toks, pages_for(6, 21), SCOPE)
            last = t.block_keys(toks, SCOPE)[-1]
            t.save_manifest("mine", {"last_block_key": last.hex(), "blocks": 6, "tokens": len(toks),
                                     "model_version": SCOPE.model_version, "namespace": SCOPE.namespace})
            out = {"resident": t.chain_residency(last).blocks,
                   "pinned": t.set_priority_from(last, Priority.PINNED)}
            exported = export_prefix(t, "mine", out_dir / "mine.tkv")
            out["exported_blocks"] = exported.blocks
            t.invalidate(namespace=SCOPE.namespace)
            r = import_bundle(t, out_dir / "mine.tkv", name="again", trust=Trust(model_check=every_page))
            out["imported"] = [r.stored, r.durable, list(r.warnings)]
            again = t.get_manifest("again")
            out["again_resident"] = t.chain_residency(bytes.fromhex(again["last_block_key"])).blocks
            with t.acquire(toks, SCOPE) as lease:
                out["served_equal"] = lease.num_blocks == 6 and bool(lease.pages().eq(pages_for(6, 21)).all())
            return out

    try:
        got = run_as(NOBODY, tenant)
        assert got.get("ok") == {"resident": 6, "pinned": 6, "exported_blocks": 6, "imported": [6, True, []],
                                 "again_resident": 6, "served_equal": True}, got
        # The owner's own keys are its own: the tenant's blocks are not in its namespace.
        with tierkv.connect(d.config.socket) as c:
            assert c.namespace_prefix == f"uid{os.getuid()}/"
            assert c.lookup(toks, SCOPE).tokens_matched == 0
        d.call(d.daemon.check_integrity)
    finally:
        d.stop()
