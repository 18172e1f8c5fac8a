"""`tierkv doctor` and the checks `tierkv serve` runs at start (issue #37, items 7 and 9):
budgets the machine cannot back, socket directory and keyring modes, a live daemon's
budgets. Real file systems: a small tmpfs (root only) for the shared memory and the disk
tier; without root only the checks that need no mount run."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers.daemons import DaemonThread
from daemon_helpers import make_config, spawn_daemon
from helpers.mounts import tmpfs

import tierkv
from tierkv.cli import main
from tierkv.daemon.config import DaemonConfig
from tierkv.doctor import FAIL, OK, WARN, check_disk, check_keyring, check_shm, check_socket, daemon_checks

MiB = 1 << 20


def doctor(*args: object) -> tuple[int, dict]:
    r = CliRunner().invoke(main, ["doctor", *map(str, args), "--json"])
    assert r.exit_code in (0, 1), r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return r.exit_code, out


def statuses(out: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in out["checks"]}


def where(workdir: Path, **kw) -> tuple[str, ...]:
    args = {"home": workdir / "home", "socket": workdir / "run" / "d.sock", "shm-dir": workdir / "shm",
            "keys": workdir / "keys", "device": "cpu", "device-bytes": "1MiB", "host-bytes": "1MiB",
            "staging-bytes": "1MiB", "disk-bytes": "1MiB", **kw}
    return tuple(x for k, v in args.items() for x in (f"--{k}", str(v)))


def test_every_check_is_one_line_and_a_sound_setup_passes(workdir):
    (workdir / "shm").mkdir()
    code, out = doctor(*where(workdir))
    assert code == 0 and out["ok"] and out["source"] == "configuration"
    assert set(statuses(out)) == {"shm", "memlock", "odirect", "disk", "cuda", "kvikio", "socket", "keyring"}
    assert FAIL not in statuses(out).values()
    human = CliRunner().invoke(main, ["doctor", *where(workdir)])
    assert human.exit_code == 0
    lines = human.stdout.strip().splitlines()
    assert len(lines) == 1 + len(out["checks"]) and all(line.split()[0] in (OK, WARN) for line in lines[1:])


def test_budgets_no_file_system_can_back_fail_with_a_fix(workdir):
    """The issue's case: a host tier over the size of /dev/shm, a disk tier over the disk."""
    (workdir / "shm").mkdir()
    code, out = doctor(*where(workdir, **{"host-bytes": "1024TiB", "disk-bytes": "1024TiB"}))
    assert code == 1 and not out["ok"]
    checks = {c["name"]: c for c in out["checks"]}
    assert checks["shm"]["status"] == FAIL and "smaller than the budget" in checks["shm"]["detail"]
    assert "--host-bytes" in checks["shm"]["fix"] and "--disk-bytes" in checks["disk"]["fix"]
    assert checks["disk"]["status"] == FAIL and checks["socket"]["status"] == OK
    assert not (workdir / "home").exists() and not (workdir / "run").exists()  # checking creates nothing


def test_socket_directory_and_keyring_modes(workdir):
    run_dir, keys = workdir / "run", workdir / "keys"
    run_dir.mkdir(mode=0o700)
    os.chmod(run_dir, 0o755)
    cfg = DaemonConfig(home=workdir / "home", socket=run_dir / "d.sock")
    bad = check_socket(cfg)
    assert bad.status == FAIL and "mode 755" in bad.detail and "chmod 700" in bad.fix
    os.chmod(run_dir, 0o700)
    assert check_socket(cfg).status == OK
    assert check_keyring(keys).status == OK  # none yet
    assert CliRunner().invoke(main, ["keys", "generate", "--keys", str(keys)]).exit_code == 0
    assert check_keyring(keys).status == OK
    os.chmod(keys / "signing.key", 0o644)
    os.chmod(keys / "trusted", 0o777)
    bad = check_keyring(keys)
    assert bad.status == FAIL and "signing.key mode 0644" in bad.detail and "trusted mode 0777" in bad.detail
    assert "chmod 600" in bad.fix
    code, out = doctor(*where(workdir))
    assert code == 1 and statuses(out)["keyring"] == FAIL


def test_serve_refuses_a_budget_the_machine_cannot_back(workdir):
    with pytest.raises(RuntimeError) as exc:
        spawn_daemon(workdir, "--disk-bytes", "1024TiB")  # the last --disk-bytes wins over the helper's
    message = str(exc.value)
    assert "rc 1" in message and "Error: cannot start: disk: disk tier 1048576.0 GiB" in message
    assert "lower --disk-bytes" in message and "Traceback" not in message
    assert not (workdir / "run" / "d.sock").exists() and not (workdir / "home").exists()


def test_doctor_checks_the_budgets_of_a_live_daemon(workdir, monkeypatch):
    cfg = make_config(workdir)
    d = DaemonThread(cfg).start()
    try:
        # The flags' budgets are not the daemon's: the daemon's are checked.
        code, out = doctor("--socket", cfg.socket, "--shm-dir", cfg.shm_dir, "--host-bytes", "1024TiB",
                           "--keys", workdir / "keys")
        # A daemon named by TIERKV_SOCKET alone does not replace an explicit --home (item 1).
        monkeypatch.setenv("TIERKV_SOCKET", str(cfg.socket))
        _, own = doctor("--home", workdir / "other", "--shm-dir", cfg.shm_dir, "--keys", workdir / "keys")
        _, env = doctor("--shm-dir", cfg.shm_dir, "--keys", workdir / "keys")
    finally:
        d.stop()
    assert code == 0, out
    assert out["source"] == f"the daemon at {cfg.socket}" and out["home"] == str(cfg.home)
    assert out["budgets"]["host_bytes"] == cfg.host_bytes and out["budgets"]["disk_bytes"] == cfg.disk_bytes
    assert own["source"] == "configuration" and own["home"] == str(workdir / "other")
    assert env["source"] == f"the daemon at {cfg.socket}" and env["home"] == str(cfg.home)


@pytest.fixture
def small_tmpfs(workdir):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with tmpfs(workdir / "fs", 16 * MiB) as path:
        yield path


def test_budgets_over_what_is_free_warn_and_over_the_file_system_fail(small_tmpfs, workdir):
    """A real 16 MiB tmpfs as the shared memory and as the disk tier's file system."""
    cfg = DaemonConfig(home=small_tmpfs / "home", socket=workdir / "run" / "d.sock", device="cpu",
                       device_bytes=1 * MiB, host_bytes=4 * MiB, staging_bytes=1 * MiB, disk_bytes=8 * MiB,
                       shm_dir=small_tmpfs)
    assert check_shm(cfg).status == OK and check_disk(cfg).status == OK
    (small_tmpfs / "filler").write_bytes(b"\1" * (9 * MiB))  # 7 MiB left
    assert check_shm(cfg).status == OK  # 6 MiB needed
    for check, budget in ((check_shm, {"host_bytes": 8 * MiB}), (check_disk, {"disk_bytes": 12 * MiB})):
        warned = check(dataclasses.replace(cfg, **budget))
        assert warned.status == WARN and "more is needed" in warned.detail, warned
        failed = check(dataclasses.replace(cfg, **{k: 32 * MiB for k in budget}))
        assert failed.status == FAIL and "smaller than the budget" in failed.detail, failed
    # serve starts on the warning and logs it.
    proc = spawn_daemon(workdir, "--shm-dir", str(small_tmpfs), "--host-bytes", "6MiB", "--device-bytes", "1MiB",
                        "--staging-bytes", "256KiB")
    tierkv.connect(workdir / "run" / "d.sock").close()  # serving: its SIGTERM handler is in place
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert "WARNING tierkv.serve: shm: host + staging + device tiers" in err.decode()
    assert [c.status for c in daemon_checks(cfg) if c.name == "socket"] == [OK]
