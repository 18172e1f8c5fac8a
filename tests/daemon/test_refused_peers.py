"""Refused connections cost everyone (issue #34, item 11): with ``allowed_uids`` the socket
is 0666, and ~11,000 refused connects a second from a uid not admitted slowed an admitted
client's acquire p50 from 0.2 ms to 15.6 ms and wrote 1.1 MiB/s of WARNING lines. Now a
refused peer costs one cheap close at accept (gate.py) and refusals are logged at most once
per interval. A real second uid (a forked child as 65533) hammers a real daemon process."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import statistics
import threading
import time

import tierkv
from tierkv.daemon.gate import RefusalLog
from tierkv.daemon.security import PeerCredentials

from as_user import NOBODY, need_root, run_as
from daemon_helpers import SCOPE, pages_for, prompt, spawn_daemon

OTHER = NOBODY - 1  # a uid the daemon does not admit
HAMMER_S = 6.0
RATE = 12_000  # refused connects a second, as in the report


def acquire_p50(c, toks, n: int = 400) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        lease = c.acquire(toks, SCOPE)
        times.append(time.perf_counter() - t0)
        lease.release()
    return statistics.median(times)


def test_refused_connects_of_another_uid_barely_slow_an_admitted_client(workdir):
    need_root()
    os.chmod(workdir, 0o711)  # others pass through to the socket's directory (0711) and socket (0666)
    log = workdir / "daemon.log"
    proc = spawn_daemon(workdir, "--allowed-uid", str(NOBODY), "--shm-dir", str(workdir / "shm"), log_path=log)
    sock = workdir / "run" / "d.sock"
    try:
        with tierkv.connect(sock) as c:
            toks = prompt(64, seed=1)
            c.put(toks, pages_for(4, 1), SCOPE)
            acquire_p50(c, toks, 200)  # warm
            quiet = acquire_p50(c, toks)
            r_ready, w_ready = os.pipe()

            def hammer() -> dict:
                connects = refused_with_reason = 0
                os.write(w_ready, b"1")
                start = time.monotonic()
                end = start + HAMMER_S
                while time.monotonic() < end:
                    if connects % 100 == 0:  # paced at the rate of the report (as fast as it can go when slower)
                        time.sleep(max(0.0, start + connects / RATE - time.monotonic()))
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    try:
                        s.connect(str(sock))
                        connects += 1
                        if connects % 1000 == 1:  # now and then: the reason came with the close
                            s.settimeout(5)
                            refused_with_reason += b"PeerRejectedError" in s.recv(4096)
                    except OSError:
                        pass
                    finally:
                        s.close()
                return {"connects": connects, "with_reason": refused_with_reason}

            out: dict = {}
            t = threading.Thread(target=lambda: out.update(run_as(OTHER, hammer, timeout_s=HAMMER_S + 30)))
            t.start()
            assert os.read(r_ready, 1) == b"1"
            time.sleep(0.5)
            t0 = time.monotonic()
            loaded = acquire_p50(c, toks)
            measured_s = time.monotonic() - t0
            t.join(HAMMER_S + 40)
            assert "ok" in out, out
            connects = out["ok"]["connects"]
            assert measured_s < HAMMER_S - 0.5, "the latency was not measured under load"
            # Generous against noise on a shared machine; before the gate: x78 (0.2 -> 15.6 ms).
            assert loaded < 5 * quiet + 0.001, f"acquire p50 {quiet * 1e3:.3f} ms -> {loaded * 1e3:.3f} ms " \
                                               f"under {connects / HAMMER_S:.0f} refused connects/s"
            assert connects >= HAMMER_S * RATE / 2, f"only {connects} refused connects: no real load"
            assert out["ok"]["with_reason"] >= 1  # a refused client still learns why
            c.check_integrity()
        lines = [line for line in log.read_text().splitlines() if "refused" in line]
        # One line at the first refusal, then at most one per 10 s interval.
        assert 1 <= len(lines) <= HAMMER_S / 10 + 2, lines[:5]
        assert any(f"uid {OTHER}" in line for line in lines)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_refusals_are_logged_at_once_then_summed_up_per_interval(caplog):
    loop = asyncio.new_event_loop()
    now = [0.0]
    refusals = RefusalLog(loop, 10.0, clock=lambda: now[0])
    creds = PeerCredentials(pid=1, uid=OTHER, gid=OTHER)
    try:
        with caplog.at_level(logging.WARNING, logger="tierkv.daemon.server"):
            refusals.refused(creds)  # the first: at once, with its pid and uid
            for i in range(1000):
                now[0] = i * 0.005
                refusals.refused(creds)
            now[0] = 10.0
            refusals.flush()  # what the timer it set does
            now[0] = 30.0
            refusals.refused(creds)  # after a quiet interval: at once again
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 3, lines
        assert f"uid {OTHER}" in lines[0] and "pid 1" in lines[0]
        assert "refused 1000 more connections" in lines[1] and f"uid {OTHER}: 1000" in lines[1]
    finally:
        refusals.close()
        loop.close()
