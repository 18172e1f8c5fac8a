"""The daemon's local trust boundary: where its socket may live and who may talk to it.

* The socket's directory is private (created 0700, or refused when it exists and another
  user owns it or group/others can access it); the socket itself is 0600.
* Nothing already at the socket path is replaced, except the socket of a daemon that is
  gone (connecting is refused): a regular file, directory or symlink there means a
  misconfiguration or an attack, and the daemon refuses to start.
* Every peer's uid is read from the kernel (``SO_PEERCRED``) and must be the daemon's own
  uid or one listed in ``allowed_uids``.

The daemon trusts a peer that passes these checks: such a peer could read the daemon's
shared-memory tiers anyway. Namespaces are still derived on the daemon side when
``namespace_per_uid`` is set (see server.py).
"""
from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, TierKVError

_UCRED = struct.Struct("3i")  # struct ucred { pid_t pid; uid_t uid; gid_t gid; }


class SocketPathError(TierKVError):
    default_hint = "remove what is at the socket path by hand if it is yours, or choose another --socket"


class PeerRejectedError(TierKVError):
    default_hint = "run the client as the daemon's user, or add its uid to allowed_uids in the daemon's config"


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connecting process's pid, uid and gid as the kernel recorded them at connect."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid, uid, gid)


def peer_allowed(creds: PeerCredentials, allowed_uids: tuple[int, ...]) -> bool:
    return creds.uid == os.getuid() or creds.uid in allowed_uids


def prepare_socket_dir(directory: Path) -> None:
    """Create ``directory`` 0700, or check that an existing one is ours and private."""
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise SocketPathError(f"{directory} (the socket's directory) is not a directory")
    if st.st_uid != os.getuid():
        raise SocketPathError(f"{directory} belongs to uid {st.st_uid}, not to this user ({os.getuid()})",
                              hint="put the socket in a directory you own, e.g. $XDG_RUNTIME_DIR/tierkv")
    if st.st_mode & 0o077:
        raise SocketPathError(f"{directory} has mode {stat.S_IMODE(st.st_mode):o}; the socket's directory must be 0700",
                              hint=f"chmod 700 {directory}, or put the socket in a private directory")


def socket_is_live(path: Path, timeout: float = 1.0) -> bool:
    """True when a process accepts connections on ``path`` (a live daemon)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        return True  # e.g. a full backlog: someone is there
    finally:
        s.close()


def clear_socket_path(path: Path) -> bool:
    """Make ``path`` free for bind. Returns True when a stale socket was removed.
    Raises SocketPathError when anything else is there or a daemon is alive on it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise SocketPathError(f"{path} is a symlink; refusing to start over it")
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket; refusing to start over it")
    if st.st_uid != os.getuid():
        raise SocketPathError(f"the socket {path} belongs to uid {st.st_uid}; refusing to replace it")
    if socket_is_live(path):
        raise SocketPathError(f"a daemon is already serving on {path}",
                              hint="stop it first, or connect to it with tierkv.connect()")
    path.unlink()  # the socket of a daemon that is gone
    return True


def bind_private_socket(path: Path, backlog: int = 128) -> socket.socket:
    """A listening AF_UNIX socket at ``path``, mode 0600, in a 0700 directory."""
    if len(os.fsencode(path)) >= 108:
        raise ConfigError(f"socket path {path} is too long for AF_UNIX (107 bytes at most)")
    prepare_socket_dir(path.parent)
    clear_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # umask during bind so the socket is never, even briefly, wider than 0600. The 0700
    # directory already keeps other users out; this is the second lock.
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def write_pid_file(path: Path) -> None:
    """Write our pid atomically (temp file, fsync, rename)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
