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
from typing import Any

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


# ---- the container recipe (deploy/container/Dockerfile) -----------------------------------
DOCKERFILE = ROOT / "deploy" / "container" / "Dockerfile"
CONTAINER_CONFIG = ROOT / "deploy" / "container" / "daemon.toml"


def parse_dockerfile(text: str) -> list[list[tuple[str, str]]]:
    """A Dockerfile as stages, each a list of (INSTRUCTION, arguments); continuation lines
    joined, comments dropped. Refuses an unknown instruction (a typo Docker would reject)."""
    known = {"FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "VOLUME", "EXPOSE", "LABEL",
             "HEALTHCHECK", "STOPSIGNAL", "ENTRYPOINT", "CMD", "SHELL"}
    stages: list[list[tuple[str, str]]] = []
    logical, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            logical.append(buf.strip())
            buf = ""
    for line in logical:
        op, _, args = line.partition(" ")
        assert op.upper() == op and op in known, f"unknown instruction {op!r}"
        if op == "FROM":
            stages.append([])
        assert stages, "an instruction before FROM"
        stages[-1].append((op, args.strip()))
    return stages


def check_recipe(recipe: Path, config: Path) -> tuple[list, str, dict, Any]:
    """What both container recipes must hold: two stages, COPY sources in the repository, a
    non-root user stopped by SIGTERM, `tierkv serve` as the entry point. Returns the stages,
    the build stage's RUN lines, the final stage's instructions and the configuration its CMD
    gives `tierkv serve` (with ``config`` in the place of /etc/tierkv/daemon.toml)."""
    from tierkv.cli.serve import build_config, serve, unset_empty_lists

    stages = parse_dockerfile(recipe.read_text())
    assert len(stages) == 2
    for op, args in (i for s in stages for i in s):
        if op == "COPY" and not args.startswith("--from"):
            for src in shlex.split(args)[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    run_lines = " ".join(a for op, a in stages[0] if op == "RUN")
    final = dict(stages[1])
    assert final["USER"] not in ("root", "0") and final["STOPSIGNAL"] == "SIGTERM"
    entry, cmd = json.loads(final["ENTRYPOINT"]), json.loads(final["CMD"])
    assert Path(entry[0]).name == "tierkv" and entry[1:] == ["serve"]
    args = [str(config) if a == "/etc/tierkv/daemon.toml" else a for a in cmd]
    params = dict(serve.make_context("serve", args).params)
    config_file, socket = params.pop("config_file"), params.pop("socket_path")
    params.pop("log_level")
    params["socket"] = socket
    unset_empty_lists(params)
    return stages, run_lines, final, build_config(params, config_file)


PINNED_TORCH = re.compile(r"torch==([\w.]+)")


def test_container_recipe_copies_what_exists_and_runs_serve_as_a_user():
    _, run_lines, final, cfg = check_recipe(DOCKERFILE, CONTAINER_CONFIG)
    # torch is the version the test command pins, from the CPU index (no CUDA build).
    pinned = PINNED_TORCH.search((ROOT / "scripts" / "test.sh").read_text()).group(1)
    assert f"torch=={pinned}" in run_lines and "download.pytorch.org/whl/cpu" in run_lines
    assert str(cfg.home) in json.loads(final["VOLUME"]) and str(cfg.socket) in final["ENV"]
    assert cfg.device == "cpu" and cfg.metrics_port == 9464
    # The memory tiers fit in the --shm-size the header asks for.
    shm = int(re.search(r"--shm-size (\d+)g", DOCKERFILE.read_text()).group(1)) << 30
    assert cfg.device_bytes + cfg.host_bytes + cfg.staging_bytes <= shm
    # The build context holds what the recipe copies (.dockerignore).
    ignore = (ROOT / ".dockerignore").read_text()
    for src in ("pyproject.toml", "setup.py", "README.md", "tierkv", "kernels", "deploy/container/daemon.toml"):
        assert f"!{src}" in ignore


@pytest.mark.slow
def test_container_recipe_builds(tmp_path):
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "info"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("no Docker daemon answers here (the recipe is still checked by the test above)")
    r = subprocess.run([docker, "build", "-f", str(DOCKERFILE), "-t", "tierkv-test:cpu", str(ROOT)],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    r = subprocess.run([docker, "run", "--rm", "--entrypoint", "tierkv", "tierkv-test:cpu", "--version"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("tierkv "), r.stderr


def test_cuda_container_recipe_installs_the_gpu_extra_and_serves_from_the_gpu():
    """deploy/container/Dockerfile.cuda: the same shape as the CPU recipe, with torch's CUDA
    build, tierkv's `gpu` extra (kvikio), the device tier on cuda:0 and metrics published."""
    recipe = ROOT / "deploy" / "container" / "Dockerfile.cuda"
    stages, run_lines, final, cfg = check_recipe(recipe, ROOT / "deploy" / "container" / "daemon-cuda.toml")
    for op, args in (i for s in stages for i in s):
        if op == "COPY" and not args.startswith("--from"):
            for src in shlex.split(args)[:-1]:
                assert f"!{src}" in (ROOT / ".dockerignore").read_text(), f"COPY {src}: not in the build context"
    pinned = PINNED_TORCH.search((ROOT / "scripts" / "test.sh").read_text()).group(1)
    assert f"torch=={pinned}" in run_lines and "download.pytorch.org/whl/cu" in run_lines
    assert '"/src[gpu]"' in run_lines
    assert cfg.device == "cuda:0" and cfg.metrics_port == 9464 and cfg.metrics_host == "0.0.0.0"
    assert str(cfg.home) in json.loads(final["VOLUME"]) and str(cfg.socket) in final["ENV"]
    text = recipe.read_text()
    assert "--gpus all" in text and "--ipc host" in text and "-p 9464:9464" in text
    shm = int(re.search(r"--shm-size (\d+)g", text).group(1)) << 30
    assert cfg.host_bytes + cfg.staging_bytes <= shm  # the device tier is GPU memory
