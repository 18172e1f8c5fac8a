"""The daemon's local trust boundary: where its socket may live and who may talk to it.

* The socket's directory is private (created 0700, or refused when it exists and another
  user owns it or group/others can access it); the socket itself is 0600. With
  ``allowed_uids`` the other users must reach the socket: the directory is then 0711
  (others may pass through it, never list or create in it) and the socket 0666; the uid
  check below is then the gate, as it always is.
* Nothing already at the socket path is replaced, except the socket of a daemon that is
  gone (connecting is refused): a regular file, directory or symlink there means a
  misconfiguration or an attack, and the daemon refuses to start.
* Every peer's uid is read from the kernel (``SO_PEERCRED``) and must be the daemon's own
  uid or one listed in ``allowed_uids``.

The daemon's shared-memory files are 0600 to the daemon's user; an admitted peer gets them
as file descriptors with the HELLO reply (SCM_RIGHTS), so only admitted peers map them.
With ``namespace_per_uid`` each peer uid is a tenant confined to its own namespaces and
manifests (tierkv/home/tenancy.py).

The client checks the other direction (:func:`check_listener`): the process listening on
the socket must run as root, as the client's own user or as the uid it was told to expect,
before the client sends anything or maps what it is sent.
"""
from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, TierKVError, UntrustedDaemonError

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


def check_listener(sock: socket.socket, path: Path, daemon_uid: int | None = None) -> PeerCredentials:
    """Client side: the listener's credentials, if its uid is root, ours or ``daemon_uid``;
    UntrustedDaemonError otherwise (a fake listener must not get our requests, nor make us
    map and write what it hands us)."""
    creds = peer_credentials(sock)
    trusted = {0, os.getuid()} | ({daemon_uid} if daemon_uid is not None else set())
    if creds.uid not in trusted:
        raise UntrustedDaemonError(f"the listener on {path} runs as uid {creds.uid} (pid {creds.pid}), which this "
                                   f"client does not trust (root, {os.getuid()}"
                                   f"{'' if daemon_uid is None else f', {daemon_uid}'})")
    return creds


def prepare_socket_dir(directory: Path, shared: bool = False) -> None:
    """Create ``directory`` 0700 (0711 when ``shared``: other users pass through to the
    socket), or check that an existing one is ours and no wider than that."""
    mode = 0o711 if shared else 0o700
    try:
        directory.mkdir(mode=mode, parents=True)
        os.chmod(directory, mode)  # mkdir's mode is masked by the umask
    except FileExistsError:
        pass
    error = socket_dir_error(directory, shared)
    if error is not None:
        raise error


def socket_dir_error(directory: Path, shared: bool = False) -> SocketPathError | None:
    """Why the existing ``directory`` cannot hold the daemon's socket (not a directory, not
    this user's, wider than 0700, or 0711 when ``shared``), or None when it can. The rule
    ``prepare_socket_dir`` enforces and ``tierkv doctor`` reports."""
    mode = 0o711 if shared else 0o700
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        return SocketPathError(f"{directory} (the socket's directory) is not a directory")
    if st.st_uid != os.getuid():
        return SocketPathError(f"{directory} belongs to uid {st.st_uid}, not to this user ({os.getuid()})",
                               hint="put the socket in a directory you own, e.g. $XDG_RUNTIME_DIR/tierkv")
    if st.st_mode & (0o066 if shared else 0o077):
        return SocketPathError(f"{directory} has mode {stat.S_IMODE(st.st_mode):o}; the socket's directory must be "
                               f"{mode:04o}", hint=f"chmod {mode:o} {directory}, or put the socket in a private directory")
    return None


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


def bind_private_socket(path: Path, backlog: int = 128, shared: bool = False) -> socket.socket:
    """A listening AF_UNIX socket at ``path``, mode 0600 in a 0700 directory (``shared``,
    for ``allowed_uids``: 0666 in a 0711 directory; peers are then checked by uid)."""
    if len(os.fsencode(path)) >= 108:
        raise ConfigError(f"socket path {path} is too long for AF_UNIX (107 bytes at most)")
    prepare_socket_dir(path.parent, shared)
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
    os.chmod(path, 0o666 if shared else 0o600)
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
