"""Issue #37, one configuration story: every daemon setting by flag, TIERKV_* variable and
TOML file, flag > environment > file > default, and `tierkv config show` printing each
setting with where it came from, locally and from a live daemon (a real `tierkv serve`
process); `--metrics-host` binds the metrics endpoint where it says."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from tierkv.cli import main


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("TIERKV_"):
            monkeypatch.delenv(name)


def show(*args, env: dict[str, str] | None = None) -> dict:
    result = CliRunner().invoke(main, ["config", "show", *map(str, args), "--json"], env=env)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_flag_beats_environment_beats_file_beats_default(tmp_path):
    conf = tmp_path / "daemon.toml"
    conf.write_text('[store]\nhost_bytes = "2GiB"\ndisk_bytes = "1GiB"\neviction_policy = "lru"\n'
                    '[server]\nworkers = 3\n')
    env = {"TIERKV_WORKERS": "5", "TIERKV_DISK_BYTES": "3GiB", "TIERKV_WRITE_THROUGH": "off",
           "TIERKV_ALLOWED_UIDS": "1000, 1001"}
    got = show("--config", conf, "--home", tmp_path / "h", "--socket", tmp_path / "s.sock", "--disk-bytes", "4GiB",
               env=env)["settings"]
    assert got["store"]["disk_bytes"] == {"value": str(4 << 30), "source": "flag"}  # flag over env and file
    assert got["server"]["workers"] == {"value": "5", "source": "env TIERKV_WORKERS"}  # env over file
    assert got["store"]["host_bytes"] == {"value": str(2 << 30), "source": f"file {conf}"}
    assert got["store"]["eviction_policy"] == {"value": "lru", "source": f"file {conf}"}
    assert got["store"]["write_through"] == {"value": "False", "source": "env TIERKV_WRITE_THROUGH"}
    assert got["access"]["allowed_uids"]["value"] == "1000,1001"
    assert got["server"]["max_inflight"] == {"value": "32", "source": "default"}
    assert got["store"]["home"] == {"value": str(tmp_path / "h"), "source": "flag"}
    # TIERKV_HOME now beats the file's home too (it used to lose to it).
    conf.write_text(f'[store]\nhome = "{tmp_path / "file-home"}"\n')
    got = show("--config", conf, "--socket", tmp_path / "s.sock", env={"TIERKV_HOME": str(tmp_path / "env-home")})
    assert got["settings"]["store"]["home"] == {"value": str(tmp_path / "env-home"), "source": "env TIERKV_HOME"}


def test_a_bad_environment_value_is_one_line_naming_the_variable(tmp_path):
    result = CliRunner().invoke(main, ["config", "show", "--home", str(tmp_path)], env={"TIERKV_MAX_INFLIGHT": "many"})
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "TIERKV_MAX_INFLIGHT='many'" in result.stderr
    result = CliRunner().invoke(main, ["config", "show", "--home", str(tmp_path)], env={"TIERKV_WRITE_THROUGH": "maybe"})
    assert result.exit_code == 1 and "TIERKV_WRITE_THROUGH" in result.stderr


def test_an_eviction_policy_per_tier_by_flag_or_environment_and_a_bad_one_refused(tmp_path):
    """--eviction-policy and TIERKV_EVICTION_POLICY take one policy or one per tier
    (tierkv/core/policy_spec.py); a bad value is refused before anything starts, saying why."""
    base = ["--home", tmp_path / "h", "--socket", tmp_path / "s.sock"]
    got = show(*base, "--eviction-policy", "leader,disk=arc")["settings"]["store"]["eviction_policy"]
    assert got == {"value": "leader,disk=arc", "source": "flag"}
    got = show(*base, env={"TIERKV_EVICTION_POLICY": "host=leader"})["settings"]["store"]["eviction_policy"]
    assert got == {"value": "host=leader", "source": "env TIERKV_EVICTION_POLICY"}
    result = CliRunner().invoke(main, ["config", "show", *map(str, base), "--eviction-policy", "disk=lfu"])
    assert result.exit_code == 2 and "unknown policy 'lfu'" in result.output
    result = CliRunner().invoke(main, ["config", "show", *map(str, base)], env={"TIERKV_EVICTION_POLICY": "ssd=arc"})
    assert result.exit_code == 1 and "Traceback" not in result.output and "unknown tier 'ssd'" in result.stderr


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def test_a_live_daemon_reports_its_settings_and_serves_metrics_where_told(tmp_path):
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvcfg-"))  # AF_UNIX paths are short
    sock = d / "d.sock"
    conf = tmp_path / "daemon.toml"
    conf.write_text('[store]\nhost_bytes = "32MiB"\n')
    host = "127.0.0.2"  # not the default address: the endpoint must bind where --metrics-host says
    port = _free_port(host)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    env["TIERKV_WORKERS"] = "3"
    proc = subprocess.Popen([sys.executable, "-m", "tierkv", "serve", "--home", str(d / "home"), "--socket", str(sock),
                             "--config", str(conf), "--device", "cpu", "--device-bytes", "16MiB", "--disk-bytes",
                             "64MiB", "--shm-dir", str(d / "shm"), "--metrics-port", str(port), "--metrics-host", host],
                            env=env)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.1)
        # From an environment without TIERKV_WORKERS: the daemon's own settings and sources.
        got = show("--socket", sock)
        assert got["of"] == f"the daemon at {sock}"
        settings = got["settings"]
        assert settings["server"]["workers"] == {"value": "3", "source": "env TIERKV_WORKERS"}
        assert settings["store"]["host_bytes"] == {"value": str(32 << 20), "source": f"file {conf}"}
        assert settings["store"]["device_bytes"] == {"value": str(16 << 20), "source": "flag"}
        assert settings["metrics"]["host"] == {"value": host, "source": "flag"}
        # An explicit --home alone is shown as this command line resolves it, not the daemon's.
        local = show("--home", tmp_path / "other")
        assert local["of"].startswith("this command line") and local["settings"]["server"]["workers"]["source"] == "default"
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
            assert b"tierkv_" in r.read()
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_a_store_a_command_opens_itself_takes_the_environment_and_the_file(tmp_path, monkeypatch):
    """Direct mode (`--home`, no daemon): the store's budgets, policy and codec come from
    TIERKV_<NAME> over the file $TIERKV_CONFIG, and the command's own flags over both."""
    from tierkv import PageLayout
    from tierkv.cli.common import open_store

    conf = tmp_path / "tierkv.toml"
    conf.write_text('[store]\nhost_bytes = "8MiB"\ndisk_bytes = "32MiB"\neviction_policy = "lru"\n[server]\nworkers = 2\n')
    monkeypatch.setenv("TIERKV_CONFIG", str(conf))
    monkeypatch.setenv("TIERKV_DISK_BYTES", "64MiB")
    monkeypatch.setenv("TIERKV_PAGE_CODEC", "none")
    monkeypatch.setenv("TIERKV_SHM_DIR", str(tmp_path / "shm"))
    layout = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    with open_store(tmp_path / "home", layout, device="cpu", device_bytes=1 << 20, page_codec="int8") as store:
        cfg = store.config
        assert cfg.host_bytes == 8 << 20 and cfg.eviction_policy == "lru"  # the file
        assert cfg.disk_bytes == 64 << 20  # the environment over the file
        assert cfg.page_codec == "int8"  # the flag over the environment
        assert cfg.shm_dir == tmp_path / "shm"
    # serve reads the same file when --config is not given.
    got = show("--home", tmp_path / "h", "--socket", tmp_path / "s.sock")["settings"]
    assert got["server"]["workers"] == {"value": "2", "source": f"file {conf}"}
