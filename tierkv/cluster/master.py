"""Running a Mooncake master for tests, benchmarks and single-host trials.

Production masters are run by the operator (docs/cluster.md); this starts one with the
flags tierkv relies on: its own HTTP metadata server (no etcd), every listener on the
given host and on explicit ports, metric reporting off. The master keeps its object index
in memory only: a restart loses every remote object (nodes republish, see publish.py).
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from ..errors import TierKVError


class MasterError(TierKVError):
    default_hint = ("install mooncake-transfer-engine-non-cuda (pip) and libibverbs1 librdmacm1 libnuma1 (apt), "
                    "or start a master yourself and pass its address")


def master_binary() -> Path:
    """The ``mooncake_master`` executable: shipped inside the mooncake wheel, or on PATH."""
    try:
        import mooncake

        p = Path(mooncake.__file__).with_name("mooncake_master")
        if p.exists():
            return p
    except ImportError:
        pass
    found = shutil.which("mooncake_master")
    if found:
        return Path(found)
    raise MasterError("no mooncake_master executable found")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class MasterProcess:
    """One ``mooncake_master`` child. ``start`` waits until its RPC port accepts."""

    host: str = "127.0.0.1"
    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    _log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def command(self) -> list[str]:
        return [
            str(master_binary()), f"-rpc_address={self.host}", f"-rpc_port={self.rpc_port}",
            "-enable_http_metadata_server=true", f"-http_metadata_server_host={self.host}",
            f"-http_metadata_server_port={self.http_port}", f"-metrics_host={self.host}",
            f"-metrics_port={self.metrics_port}", "-enable_metric_reporting=false", "-logtostderr",
        ]

    def start(self, timeout_s: float = 20.0) -> "MasterProcess":
        if self.proc is not None and self.proc.poll() is None:
            return self
        if self._log is None and self.log_path is not None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open across restarts, closed by stop()
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MasterError(f"mooncake_master exited with status {self.proc.returncode} (log: {self.log_path})")
            if _accepts(self.host, self.rpc_port) and _accepts(self.host, self.http_port):
                return self
            time.sleep(0.1)
        self.stop()
        raise MasterError(f"mooncake_master did not listen on {self.address} within {timeout_s:g} s")

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "MasterProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), 0.2).close()
        return True
    except OSError:
        return False
