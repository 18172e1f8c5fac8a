"""A restarted daemon reads back what its device tier held when it stopped (warm start,
tierkv/core/warm_start.py): a real ``tierkv serve`` process, stopped with SIGTERM and
started again, serves the next acquire from its device tier, with the exact bytes; started
with ``--no-warm-at-open``, from disk."""
from __future__ import annotations

import signal

import pytest
import torch

import tierkv

from daemon_helpers import SCOPE, pages_for, prompt, spawn_daemon, wait_for


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.stderr.read().decode()[-2000:]


@pytest.mark.parametrize("warm", [True, False])
def test_a_restarted_daemon_serves_its_last_device_tier_from_memory(workdir, warm):
    sock = workdir / "run" / "d.sock"
    prompts = [(prompt(48, seed=70 + i), pages_for(3, 70 + i)) for i in range(2)]
    proc = spawn_daemon(workdir, "--shm-dir", str(workdir / "shm"))
    try:
        with tierkv.connect(sock) as c:
            for toks, pages in prompts:
                assert c.put(toks, pages, SCOPE).durable
            assert c.stats()["tiers"]["device"]["blocks"] == 6
    finally:
        _stop(proc)

    proc = spawn_daemon(workdir, "--shm-dir", str(workdir / "shm"), *(() if warm else ("--no-warm-at-open",)))
    try:
        with tierkv.connect(sock) as c:
            if warm:
                assert wait_for(lambda: c.stats()["tiers"]["device"]["blocks"] == 6, timeout=30), c.stats()["tiers"]
            before = c.stats()
            [warm_start] = before["daemon"]["warm_start"].values()  # the one layout's
            assert warm_start["state"] == ("done" if warm else "off")
            assert warm_start["warmed_blocks"] == (6 if warm else 0)
            for toks, pages in prompts:
                with c.acquire(toks, SCOPE) as lease:
                    assert lease.tokens_matched == 48
                    assert torch.equal(lease.pages(), pages)
            after = c.stats()
        from_device = after["acquire_hits"]["device"] - before["acquire_hits"]["device"]
        from_disk = after["acquire_hits"]["disk"] - before["acquire_hits"]["disk"]
        assert (from_device, from_disk) == ((6, 0) if warm else (0, 6))
    finally:
        _stop(proc)
