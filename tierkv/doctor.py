"""What a deployment needs, checked against the configured budgets (``tierkv doctor``;
``tierkv serve`` runs the daemon's checks at start). Issue #37, items 7 and 9: budgets the
machine cannot back were accepted silently (a 64 GiB host tier over 24 GiB of /dev/shm, a
1 TiB disk tier on a 252 GB file system), and failed later in the middle of serving.

Each check is one function returning a :class:`Check`: ``ok``, ``warn`` (works, but
slower or only while the space lasts) or ``fail`` (cannot work on this machine), with
the fix. The rule for ``serve`` (docs/operations.md, "Checking a deployment"): a ``fail``
refuses the start, a ``warn`` is logged. A budget fails only when the file system or GPU is
smaller than it *in total* (no freeing of space can back it: a process writing a page of
a shared-memory pool past the end of its tmpfs's space is killed by SIGBUS); a budget above
what is *free now* only warns, since other files may go. The keyring check is ``doctor``'s only: the daemon
does not sign or trust bundles.
"""
from __future__ import annotations

import os
import resource
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .daemon.config import DaemonConfig
from .errors import TierKVError

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str  # shm, memlock, odirect, disk, cuda, kvikio, socket, keyring
    status: str  # OK, WARN or FAIL
    detail: str
    fix: str = ""  # what to do; empty when ok

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (what a new home or socket lands on)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _space(path: Path) -> tuple[int, int]:
    """(total, free to this user) bytes of the file system holding ``path``."""
    st = os.statvfs(_existing(path))
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _allocated(paths: list[Path]) -> int:
    return sum(p.lstat().st_blocks * 512 for p in paths if p.is_file())


def _uses_cuda(cfg: DaemonConfig) -> bool:
    import torch

    return (cfg.device or "cuda").startswith("cuda") and torch.cuda.is_available()


def _space_check(name: str, what: str, where: Path, budget: int, backed: int, fix: str) -> Check:
    """``budget`` bytes on the file system of ``where``, ``backed`` of them allocated already."""
    total, free = _space(where)
    detail = f"{what} {_gib(budget)} on {_existing(where)}: {_gib(free)} free of {_gib(total)}"
    if total < budget:
        return Check(name, FAIL, f"{detail}; the file system is smaller than the budget", fix)
    if free < budget - backed:
        return Check(name, WARN, f"{detail}; {_gib(budget - backed)} more is needed as the tier fills", fix)
    return Check(name, OK, detail)


def _regions_of(shm: Path, pid: int | None) -> list[Path]:
    """The shared-memory files of the process ``pid`` (a live daemon's tiers) in ``shm``."""
    from .tiers.shm import REGION_RE

    if pid is None or not shm.is_dir():
        return []
    matches = ((e, REGION_RE.match(e.name)) for e in os.scandir(shm))
    return [Path(e.path) for e, m in matches if m and int(m.group(2)) == pid]


def check_shm(cfg: DaemonConfig, daemon_pid: int | None = None) -> Check:
    """The shared-memory file system holds the host tier, the staging region and, without
    CUDA, the device tier; the daemon faults all of it in at start. ``daemon_pid``: a live
    daemon, whose regions there are already backed."""
    from .tiers.shm import default_shm_dir

    shm = Path(cfg.shm_dir or default_shm_dir())
    cuda = _uses_cuda(cfg)
    need = cfg.host_bytes + cfg.staging_bytes + (0 if cuda else cfg.device_bytes)
    return _space_check("shm", "host + staging" + ("" if cuda else " + device") + " tiers", shm, need,
                        _allocated(_regions_of(shm, daemon_pid)),
                        f"lower --host-bytes (and --staging-bytes), or grow {shm} (mount -o remount,size=N {shm}; "
                        "docker run --shm-size N), or pass --shm-dir on a larger tmpfs")


def check_disk(cfg: DaemonConfig) -> Check:
    segments = sorted(cfg.home.glob("**/segments/seg-*")) if cfg.home.is_dir() else []
    return _space_check("disk", "disk tier", cfg.home, cfg.disk_bytes, _allocated(segments),
                        "lower --disk-bytes, free space, or put --home on a larger file system")


def check_odirect(cfg: DaemonConfig) -> Check:
    from .tiers.diskio import probe_odirect

    where = _existing(cfg.home / "segments")
    if not os.access(where, os.W_OK):
        return Check("odirect", FAIL, f"{where} is not writable: the home cannot be created or written",
                     f"make {where} writable by this user, or choose another --home")
    if probe_odirect(where):
        return Check("odirect", OK, f"{where} accepts O_DIRECT: disk reads bypass the page cache")
    return Check("odirect", WARN, f"{where} refuses O_DIRECT (tmpfs, some overlays): disk reads go through the page "
                 "cache, a second copy of the pages", "put --home on ext4 or xfs")


def check_memlock(cfg: DaemonConfig) -> Check:
    """Page-locked memory: the host tier is registered with CUDA (cudaHostRegister), RDMA
    registers the remote segment."""
    rdma = cfg.remote_master is not None and cfg.remote_protocol == "rdma"
    if not (_uses_cuda(cfg) or rdma):
        return Check("memlock", OK, "not needed: no CUDA and no RDMA, nothing is page-locked")
    need = (cfg.host_bytes if _uses_cuda(cfg) else 0) + (cfg.remote_segment_bytes if rdma else 0)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= need or os.geteuid() == 0:
        return Check("memlock", OK, f"RLIMIT_MEMLOCK {'unlimited' if soft == resource.RLIM_INFINITY else _gib(soft)}"
                     f"{' (root)' if os.geteuid() == 0 else ''} for {_gib(need)} page-locked")
    return Check("memlock", WARN, f"RLIMIT_MEMLOCK {_gib(soft)} below the {_gib(need)} to page-lock: host tier copies "
                 "fall back to synchronous ones", "LimitMEMLOCK=infinity in the systemd unit, or `ulimit -l unlimited`")


def check_cuda(cfg: DaemonConfig) -> Check:
    import torch

    from .devices import resolve_device

    try:
        device = resolve_device(cfg.device or None)
    except TierKVError as e:
        return Check("cuda", FAIL, e.message, e.hint)
    if not device.startswith("cuda"):
        return Check("cuda", OK, "no GPU used: the device tier is in shared memory (cpu)")
    index = torch.device(device).index or 0
    total = torch.cuda.get_device_properties(index).total_memory
    free, _ = torch.cuda.mem_get_info(index)
    detail = f"{device}: device tier {_gib(cfg.device_bytes)}, {_gib(free)} free of {_gib(total)}"
    if cfg.device_bytes > total:
        return Check("cuda", FAIL, f"{detail}; the GPU is smaller than the budget", "lower --device-bytes")
    if cfg.device_bytes > free:
        return Check("cuda", WARN, f"{detail}; other processes hold the rest", "lower --device-bytes, or free the GPU")
    return Check("cuda", OK, detail)


def check_kvikio(cfg: DaemonConfig) -> Check:
    from .tiers.diskio import probe_kvikio

    if not _uses_cuda(cfg):
        return Check("kvikio", OK, "not needed without CUDA: disk reads go to shared memory with POSIX reads")
    module, path = probe_kvikio()
    if module is None:
        return Check("kvikio", WARN, "kvikio is not importable: disk reads into the GPU bounce through host memory",
                     "pip install 'tierkv[gpu]' (kvikio-cu13)")
    if path == "kvikio-compat":
        return Check("kvikio", WARN, "kvikio runs in compat mode (no GPUDirect Storage): reads bounce through host memory",
                     "install the nvidia-fs driver and cuFile for GPUDirect Storage, or accept the bounce")
    return Check("kvikio", OK, "kvikio with GPUDirect Storage")


def check_socket(cfg: DaemonConfig) -> Check:
    from .daemon.security import socket_dir_error

    directory = cfg.socket.parent
    shared = bool(cfg.allowed_uids)
    if not directory.exists():
        parent = _existing(directory)
        if os.access(parent, os.W_OK):
            return Check("socket", OK, f"{directory} will be created {0o711 if shared else 0o700:04o} at start")
        return Check("socket", FAIL, f"{directory} does not exist and {parent} is not writable",
                     "choose a --socket in a directory you own, e.g. $XDG_RUNTIME_DIR/tierkv/tierkv.sock")
    error = socket_dir_error(directory, shared)
    if error is not None:
        return Check("socket", FAIL, error.message, error.hint)
    return Check("socket", OK, f"{directory} is this user's, mode {stat.S_IMODE(directory.stat().st_mode):04o}")


def check_keyring(keys_dir: Path) -> Check:
    """The keyring decides which bundles ``import`` trusts: another user able to write it
    could add a trusted key; one able to read ``signing.key`` could sign as this user. The
    rule is tierkv.signing's, which every read and write of the keyring enforces too."""
    from .signing import keyring_problems

    if not keys_dir.exists():
        return Check("keyring", OK, f"{keys_dir}: no keyring yet (made 0700 on the first `tierkv keys generate`)")
    problems = keyring_problems(keys_dir)
    if problems:
        return Check("keyring", FAIL, "; ".join(f"{p} {what}" for p, what in problems),
                     f"chmod 700 {keys_dir} {keys_dir / 'trusted'}; chmod 600 {keys_dir / 'signing.key'}; "
                     f"chmod go-w and chown to yourself every file in {keys_dir / 'trusted'}")
    return Check("keyring", OK, f"{keys_dir}: private to this user")


DAEMON_CHECKS: tuple[Callable[[DaemonConfig], Check], ...] = (
    check_shm, check_memlock, check_odirect, check_disk, check_cuda, check_kvikio, check_socket)


def daemon_checks(cfg: DaemonConfig, daemon_pid: int | None = None) -> list[Check]:
    """Every check of what ``cfg`` needs from this machine (the keyring's aside)."""
    return [check_shm(cfg, daemon_pid) if check is check_shm else check(cfg) for check in DAEMON_CHECKS]
