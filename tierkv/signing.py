"""Signing keys for bundles: who made a bundle, and whether this user trusts them.

KV pages cannot be checked without the model that made them (a forged page with a valid
checksum is just as readable as a real one), so ``tierkv import`` trusts a bundle only when
it is signed by a key the importer trusts (or when ``--verify-model`` recomputes every one of
its blocks). Keys are Ed25519 (the ``cryptography`` package): small, fast, deterministic
signatures, no parameters to get wrong.

A keyring is a directory (the CLI picks it: ``--keys``, ``$TIERKV_KEYS`` or
``~/.config/tierkv/keys``)::

    signing.key        this user's private key, 32 bytes as hex, mode 0600
    trusted/NAME.pub   a trusted public key, 32 bytes as hex (``self.pub`` is one's own)

The keyring is refused (:class:`KeyringPermissionError`) when its directory, ``trusted/`` or
any key file is writable by group or others, or owned by a user other than the caller or
root, and ``signing.key`` when others can read it: the rule ssh applies to ``~/.ssh``. Issue
#34, item 8: with a world-writable keyring directory another user planted a trusted key and
root's ``tierkv import`` accepted a forged bundle. Checked on every read and every write,
not only by ``tierkv doctor``: a keyring someone else can write vouches for nothing.

Rejected: HMAC with a shared secret (every importer could then forge bundles of every
exporter; a public key can be handed out freely), and GPG (an external tool and keyring).
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import NotFoundError, TierKVError

KEY_BYTES = 32
SIGNATURE_BYTES = 64
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class KeyringError(TierKVError):
    default_hint = "manage keys with `tierkv keys generate | trust NAME KEY | list`"


class KeyringPermissionError(KeyringError):
    """Another user could write the keyring (and so add a trusted key or replace the signing
    key), or read the signing key."""


def keyring_problems(directory: Path) -> list[tuple[Path, str]]:
    """(path, what is wrong) for each part of the keyring at ``directory`` that another user
    could write (or, for ``signing.key``, read): the directory, ``trusted/``, the signing key
    and every file in ``trusted/``. Owned by the caller or root is fine (root can write
    anything anyway). Follows symbolic links: what matters is the file that is read. Empty
    when the keyring does not exist yet."""
    uid = os.geteuid()
    trusted = directory / "trusted"
    parts: list[tuple[Path, int]] = [(directory, 0o022), (trusted, 0o022), (directory / "signing.key", 0o077)]
    if trusted.is_dir():
        parts += [(p, 0o022) for p in sorted(trusted.iterdir())]
    out = []
    for path, bad in parts:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (uid, 0):
            out.append((path, f"owned by uid {st.st_uid}, not {uid}"))
        elif mode & bad:
            out.append((path, f"mode {mode:04o} ({'readable' if bad == 0o077 else 'writable'} by others)"))
    return out


def check_keyring(directory: Path) -> None:
    """KeyringPermissionError unless :func:`keyring_problems` finds nothing, with the
    chmod/chown that fixes it."""
    problems = keyring_problems(directory)
    if not problems:
        return
    fixes = []
    for path, what in problems:
        if what.startswith("owned"):
            fixes.append(f"chown {os.geteuid()} {path} (or remove it if you did not put it there)")
        else:
            fixes.append(f"chmod {'600' if path.name == 'signing.key' else 'go-w'} {path}")
    raise KeyringPermissionError(
        "refusing the keyring: another user could add a trusted key or sign as you: "
        + "; ".join(f"{p} {w}" for p, w in problems),
        hint="; ".join(fixes) + "; then check with `tierkv keys list` that every trusted key is one you added")


@dataclass(frozen=True)
class TrustedKey:
    name: str
    public_key: bytes

    @property
    def hex(self) -> str:
        return self.public_key.hex()


def parse_public_key(text: str) -> bytes:
    """A public key from its hex text; KeyringError when it is not 32 bytes of hex."""
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raw = b""
    if len(raw) != KEY_BYTES:
        raise KeyringError(f"not an Ed25519 public key (64 hex characters): {text.strip()[:80]!r}")
    return raw


class Keyring:
    """One user's signing key and trusted public keys, in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @property
    def signing_path(self) -> Path:
        return self.directory / "signing.key"

    @property
    def trusted_dir(self) -> Path:
        return self.directory / "trusted"

    def has_signing_key(self) -> bool:
        return self.signing_path.exists()

    def generate(self, overwrite: bool = False) -> bytes:
        """Create this user's signing key (0600) and trust it as ``self``; returns the public key."""
        if self.has_signing_key() and not overwrite:
            raise KeyringError(f"{self.signing_path} exists", hint="pass --force to replace it (old bundles stay "
                                                               "verifiable only where the old key is trusted)")
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_keyring(self.directory)
        key = Ed25519PrivateKey.generate()
        raw = key.private_bytes_raw()
        tmp = self.signing_path.with_name("signing.key.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, raw.hex().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.signing_path)
        public = key.public_key().public_bytes_raw()
        self.trust("self", public)
        return public

    def _signing_key(self) -> Ed25519PrivateKey:
        check_keyring(self.directory)
        try:
            text = self.signing_path.read_text()
        except FileNotFoundError:
            raise NotFoundError(f"no signing key at {self.signing_path}", hint="create one with `tierkv keys generate`") from None
        try:
            return Ed25519PrivateKey.from_private_bytes(bytes.fromhex(text.strip()))
        except ValueError:
            raise KeyringError(f"{self.signing_path} is not an Ed25519 private key") from None

    def public_key(self) -> bytes:
        return self._signing_key().public_key().public_bytes_raw()

    def sign(self, message: bytes) -> tuple[bytes, bytes]:
        """(public key, signature) of ``message`` with this user's signing key."""
        key = self._signing_key()
        return key.public_key().public_bytes_raw(), key.sign(message)

    def trust(self, name: str, public_key: bytes) -> Path:
        if not NAME_RE.match(name):
            raise KeyringError(f"bad key name {name!r}: 1-64 of A-Z a-z 0-9 _ . -")
        if len(public_key) != KEY_BYTES:
            raise KeyringError("an Ed25519 public key has 32 bytes")
        self.trusted_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_keyring(self.directory)
        path = self.trusted_dir / f"{name}.pub"
        # 0644 whatever the umask (a umask of 0 made it 0666, which the check then refuses);
        # written beside and renamed, so a reader never sees half a key.
        tmp = path.with_name(f".{name}.pub.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, public_key.hex().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return path

    def untrust(self, name: str) -> bool:
        path = self.trusted_dir / f"{name}.pub"
        if not NAME_RE.match(name) or not path.exists():
            return False
        check_keyring(self.directory)
        path.unlink()
        return True

    def trusted(self) -> list[TrustedKey]:
        """Every trusted key; a damaged key file is an error (never silently skipped)."""
        check_keyring(self.directory)
        if not self.trusted_dir.is_dir():
            return []
        out = []
        for p in sorted(self.trusted_dir.glob("*.pub")):
            out.append(TrustedKey(p.stem, parse_public_key(p.read_text())))
        return out


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
        return True
    except (InvalidSignature, ValueError):
        return False
