"""The deployment pieces in deploy/ (issue #37): the systemd unit and its config file are
what `tierkv serve` accepts, and the Grafana dashboard names only metrics the daemon
exports."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "systemd" / "tierkv.service"
CONFIG = ROOT / "deploy" / "systemd" / "daemon.toml"
DASHBOARD = ROOT / "deploy" / "grafana" / "tierkv.json"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file: section -> key -> values (a key may repeat). Comments are whole
    lines starting with # or ; (systemd has no inline comments: a '#' after a value is
    part of the value, which is why the test refuses one)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for n, line in enumerate(text.replace("\\\n", " ").splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            assert line.endswith("]"), f"line {n}: {line}"
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"line {n}: {line}"
        key, value = (part.strip() for part in line.split("=", 1))
        assert "#" not in value, f"line {n}: systemd would keep the comment as part of {key}'s value"
        current.setdefault(key, []).append(value)
    return sections


def test_systemd_unit_runs_serve_on_its_runtime_and_state_directories():
    from tierkv.cli.serve import build_config, serve
    from tierkv.daemon.config import read_config_file

    unit = parse_unit(UNIT.read_text())
    assert set(unit) == {"Unit", "Service", "Install"}
    service = {k: v[-1] for k, v in unit["Service"].items()}
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"  # SIGHUP: re-read the config file
    assert service["KillSignal"] == "SIGTERM" and service["User"] and service["LimitMEMLOCK"] == "infinity"
    assert service["RuntimeDirectory"] == "tierkv" and service["RuntimeDirectoryMode"] == "0700"
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "tierkv" and argv[1] == "serve"
    args = [str(CONFIG) if a == "/etc/tierkv/daemon.toml" else a for a in argv[2:]]
    ctx = serve.make_context("serve", args)  # the flags the command accepts, as it parses them
    params = dict(ctx.params)
    config_file, socket = params.pop("config_file"), params.pop("socket_path")
    params.pop("log_level")
    cfg = build_config({**params, "socket": socket, "local_only_namespaces": None}, config_file)
    # The daemon's socket in the unit's RuntimeDirectory, its home in its StateDirectory.
    assert cfg.socket.parent == Path("/run") / service["RuntimeDirectory"]
    assert cfg.home == Path("/var/lib") / service["StateDirectory"]
    assert read_config_file(CONFIG)["metrics_port"] == cfg.metrics_port == 9464


def test_systemd_analyze_verifies_the_unit(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    tierkv = Path(sys.executable).with_name("tierkv")
    if not tierkv.exists():
        pytest.skip("no tierkv console script next to this Python")
    unit = tmp_path / "tierkv.service"
    unit.write_text(UNIT.read_text().replace("/opt/tierkv/venv/bin/tierkv", str(tierkv)))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "tierkv.service" not in r.stderr, r.stderr
