"""Typed errors: one root, one subclass per condition a caller can act on.

Every error carries a hint that says what to do about it; `str(err)` includes it.
"""
from __future__ import annotations


class TierKVError(Exception):
    """Root of every error tierkv raises on purpose."""

    default_hint = ""
    # The default hint worded for the `tierkv` command, where default_hint names a library
    # call (tierkv.open(), tierkv.connect()) a command-line user never makes.
    cli_hint: str | None = None

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message

    def for_command_line(self) -> str:
        """``str(self)`` as the ``tierkv`` command prints it: a default hint that names a
        library call is replaced by the ``cli_hint`` of the class that declares it (not a
        subclass's, whose own default differs). Compared by text, so an error that came
        back from the daemon (its hint travels as text) is worded the same way."""
        for cls in type(self).__mro__:
            if cls.__dict__.get("default_hint") == self.hint:
                cli_hint = cls.__dict__.get("cli_hint")
                if cli_hint:
                    return f"{self.message} (hint: {cli_hint})"
                break
        return str(self)


class InvalidTokensError(TierKVError, ValueError):
    default_hint = "token ids must be integers in [0, 2**31) given as a 1-D sequence"


class PageFormatError(TierKVError, ValueError):
    default_hint = "pages must be [n_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] in the store's dtype"


class LayoutMismatchError(TierKVError):
    default_hint = "open the home with the layout it was created with, or use another --home"


class CodecMismatchError(LayoutMismatchError):
    """The home stores pages with another page codec (tierkv/codec.py) than the one asked for."""

    default_hint = "open the home with the page codec it was created with (or without one), or use another --home"


class ConfigError(TierKVError, ValueError):
    default_hint = "check the capacities and options passed to tierkv.open()"
    cli_hint = "check the command's options (tierkv COMMAND --help) and the config file"


class DeviceUnavailableError(ConfigError):
    """The torch device asked for does not exist here: CUDA on a CPU-only torch build or a
    machine without a GPU, or a GPU index past the last one."""

    default_hint = "pass --device cpu, or run where torch sees a GPU (torch.cuda.is_available())"


class DeploymentError(ConfigError):
    """This machine cannot back the configuration (tierkv/doctor.py): a budget larger than
    its file system or GPU, a socket directory the daemon may not use."""

    default_hint = "run `tierkv doctor` with the same options: one line per check, with its fix"


class UnsupportedModelError(ConfigError):
    """The model's cache is not plain per-layer K/V that tierkv can store and restore exactly
    (recurrent or linear-attention state, KV shared across layers, chunked or sparse
    attention, ...): refused at load rather than served with a wrong cache."""

    default_hint = "tierkv serves models whose layers are full or sliding-window attention (see docs/quickstart.md)"


class StoreLockedError(TierKVError):
    default_hint = "close the other process, or connect to its daemon with --socket"


class DaemonOwnsHomeError(StoreLockedError):
    default_hint = "pass --socket PATH (or tierkv.connect(PATH)) to go through the running daemon"
    cli_hint = "pass --socket PATH to go through the running daemon"


class ForkedStoreError(TierKVError):
    default_hint = "a store cannot be used across fork(); open it again in the child (use the 'spawn' start method)"


class DiskWriteError(TierKVError):
    default_hint = "the disk tier is marked degraded; free space or fix the device, the store keeps serving from memory"


class DiskReadError(TierKVError):
    """The disk tier could not be read where a wrong guess would delete data (at open: is
    this slot there?). Nothing was deleted; the store does not open until it can tell."""

    default_hint = "check the device or file system holding HOME/segments, then open the store again"


class IndexWriteError(TierKVError):
    """The index could not record a change (LMDB refused the write: a read-only, failing or
    full file system). Nothing of the change was committed; what was stored before stays
    readable and served."""

    default_hint = "check the file system holding HOME/index (read-only? failing?); the store keeps serving what it holds"


class IndexFullError(IndexWriteError):
    default_hint = "raise index_map_bytes (--index-map-size) or run `tierkv gc`"


class IndexNoSpaceError(IndexWriteError):
    """The file system holding the index is full (ENOSPC), before LMDB's map size was reached."""

    default_hint = "free space on the file system holding HOME/index, or move the home to a larger one"


class IndexReadError(TierKVError):
    """LMDB failed to read the index (an I/O error, or its reader table stayed full after
    clearing the slots of dead processes)."""

    default_hint = "check the file system holding HOME/index; `tierkv verify --home HOME` reports what is readable"


class IndexDamagedError(TierKVError):
    """The index file is damaged (truncated, invalid meta pages, a page LMDB cannot read) or
    missing while segments exist. Raised before LMDB maps the file, so it is never a signal."""

    default_hint = "run `tierkv verify --repair --home HOME` to rebuild the index from the segments"


class LayoutInUseError(TierKVError):
    """A page layout cannot be removed while clients of the daemon use it (or while it is
    being removed)."""

    default_hint = "stop the clients of that model first, then remove the layout"


class LeaseError(TierKVError):
    default_hint = "use a lease only between acquire() and release(), from the store that issued it"


class StagingExpiredError(LeaseError):
    """A COMMIT named staging slots the daemon took back: they were held longer than its
    ``staging_timeout_s`` (issue #34, item 10). Nothing of that commit was stored."""

    default_hint = ("write the pages and commit within the daemon's staging_timeout_s of staging them, then put "
                    "again; the operator sets staging_timeout_s")


class CapacityError(TierKVError):
    default_hint = "raise the tier capacity or ask for fewer blocks at once"


class NotFoundError(TierKVError):
    default_hint = "list what exists with `tierkv ls`"


class ModelVersionMismatchError(TierKVError):
    default_hint = "materialise the prefix again for this model, or pass the model it was made with"


class ProtocolError(TierKVError):
    default_hint = "client and daemon must speak the same protocol version; upgrade the older side"


class DaemonUnavailableError(TierKVError):
    default_hint = "start it with `tierkv serve`, or check the --socket path"


class NotPermittedError(TierKVError):
    """The daemon refuses this operation to this peer (e.g. a whole-store operation asked
    by a tenant under namespace_per_uid)."""

    default_hint = "run it as the daemon's user, or without namespace_per_uid"


class QuotaExceededError(CapacityError):
    """A per-uid or per-namespace quota of the daemon (connections, leases, staging,
    pinned bytes, unread replies) refuses this request; other tenants are unaffected."""

    default_hint = "release leases or staging slots first; the daemon's operator sets the quotas (docs/operations.md)"


class UntrustedDaemonError(TierKVError):
    """The process listening on the socket is not a daemon this client trusts (its uid is
    neither root, nor this user's, nor the one the client was told to expect)."""

    default_hint = "check the --socket path; pass daemon_uid= (tierkv.connect) when the daemon runs as another user"
    cli_hint = "check the --socket path: the command trusts a daemon run by root or by this user"


class InvalidNameError(TierKVError, ValueError):
    """A name (of a prefix, or a namespace) the store cannot hold: empty, too long, with
    '/', or not valid Unicode."""

    default_hint = "use 1-200 characters of valid UTF-8 without '/'"
