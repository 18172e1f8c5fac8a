"""Check an LMDB index file before this process maps it, so that a damaged index is a clear
error (IndexDamagedError) and never a signal.

LMDB trusts its file: a ``data.mdb`` cut short of a page in use makes the mapping fault
(SIGBUS), and a page it cannot parse trips an assertion (SIGABRT). Both kill the process that
mapped the file, so nothing in this process may touch a file that has not passed:

1. **Meta pages** (in this process, plain reads, no mapping). Pages 0 and 1 of ``data.mdb``
   each hold a meta record (LMDB 0.9, 64-bit, little endian)::

       page header 16 bytes: u64 pgno | u16 pad | u16 flags (P_META = 0x08) | u16 lower | u16 upper
       +16 u32 magic 0xBEEFC0DE   +20 u32 version (1)   +24 u64 address   +32 u64 map size
       +40 MDB_db free (its u32 md_pad is the page size)   +88 MDB_db main
       +136 u64 last used page number   +144 u64 transaction id

   Both must be valid (LMDB refuses the file otherwise); LMDB uses the one with the larger
   transaction id. Its free-page tree (which the walk below cannot read, and LMDB reads at
   the first write) is walked here with plain reads: every page in the file and naming
   itself. Anything else (bad magic or version, a page size that is not a power of two in
   4 KiB..64 KiB, a file shorter than two pages, a tree page past the end) is damage. The
   file may end before the meta's last page number: LMDB counts pages a transaction took
   and gave back before committing ("loose" pages), which it never wrote.
2. **A walk in a child process** (``python -I -c``, only lmdb imported): every named
   database, every key and value, read-only and without the lock table. A page LMDB cannot
   parse kills or fails the child, which here becomes IndexDamagedError. The walk costs about
   what opening the store costs anyway (it reads every record), so it runs at every open.

An empty or missing ``data.mdb`` is a new index, unless segment files exist beside it: then
the index was lost and opening would reclaim every segment as unreferenced, so that is
damage too (``tierkv verify --repair`` rebuilds it from the segments).
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import IndexDamagedError, TierKVError

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
P_META = 0x08
WALK_TIMEOUT_S = 600.0
_PAGE_HEAD = struct.Struct("<QHHHH")
_META = struct.Struct("<IIQQ")  # magic, version, address, map size (at +16)
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class MetaPage:
    page_size: int
    map_size: int
    last_page: int
    txnid: int
    free_root: int  # root page of LMDB's free-page tree (P_INVALID when empty)
    main_root: int  # root page of the main tree (it names the named databases)


@dataclass(frozen=True)
class IndexFileReport:
    """What the pre-open check found: ``new`` (no data yet) or the meta in use and, when the
    walk ran, the entries of each named database."""

    new: bool
    meta: MetaPage | None = None
    entries: dict[str, int] | None = None


def _parse_meta(raw: bytes) -> MetaPage | None:
    """A meta page's fields, or None when it is not a valid meta page."""
    if len(raw) < 152:
        return None
    _, _, flags, _, _ = _PAGE_HEAD.unpack_from(raw, 0)
    magic, version, _, map_size = _META.unpack_from(raw, 16)
    page_size = _U32.unpack_from(raw, 40)[0]
    last_page, txnid = _U64.unpack_from(raw, 136)[0], _U64.unpack_from(raw, 144)[0]
    if magic != MAGIC or version != DATA_VERSION or not flags & P_META:
        return None
    if page_size < 4096 or page_size > 65536 or page_size & (page_size - 1):
        return None
    free_root, main_root = _U64.unpack_from(raw, 40 + 40)[0], _U64.unpack_from(raw, 88 + 40)[0]
    return MetaPage(page_size, map_size, last_page, txnid, free_root, main_root)


def read_metas(data: Path) -> tuple[MetaPage | None, MetaPage | None]:
    """The two meta pages of ``data`` (None for one that is invalid); never maps the file."""
    with open(data, "rb") as f:
        first = f.read(4096)
        m0 = _parse_meta(first)
        psize = m0.page_size if m0 is not None else 4096
        f.seek(psize)
        m1 = _parse_meta(f.read(4096))
        if m0 is None and m1 is not None and m1.page_size != 4096:
            # The first meta is gone and the second sits at another page size: re-read there.
            f.seek(m1.page_size)
            m1 = _parse_meta(f.read(4096))
    return m0, m1


def check_meta(index_dir: Path) -> IndexFileReport:
    """Step 1 (in this process): the meta pages against the file size. Raises
    IndexDamagedError; ``new`` when there is no data yet and no segment beside it."""
    data = index_dir / "data.mdb"
    size = data.stat().st_size if data.exists() else 0
    if size == 0:
        segments = index_dir.parent / "segments"
        if segments.is_dir() and any(segments.glob("seg-*.safetensors")):
            raise IndexDamagedError(f"the index {data} is missing or empty, but {segments} holds segments")
        return IndexFileReport(new=True)
    m0, m1 = read_metas(data)
    # LMDB refuses a file unless both metas are valid (MDB_INVALID); so do we, before mapping.
    if m0 is None or m1 is None:
        which = "neither meta page is" if m0 is None and m1 is None else f"meta page {0 if m0 is None else 1} is not"
        raise IndexDamagedError(f"{data}: {which} a valid LMDB meta page (size {size} bytes)")
    meta = max((m0, m1), key=lambda m: m.txnid)
    if m0.page_size != m1.page_size:
        raise IndexDamagedError(f"{data}: the two meta pages disagree on the page size")
    if size < 2 * meta.page_size:
        raise IndexDamagedError(f"{data}: {size} bytes, shorter than its two meta pages: truncated")
    # Not "the file holds every page up to last_page": a transaction that took a page and
    # gave it back before committing (an LMDB "loose" page) advances last_page without
    # writing it, so after a kill the file can legitimately end before last_page (seen in
    # the crash torture). What must be in the file is every page a tree points at.
    pages = size // meta.page_size
    with open(data, "rb") as f:
        if meta.main_root != P_INVALID:
            _page(f, meta.main_root, pages, meta.page_size, "main tree root")
        if meta.free_root != P_INVALID:
            # The child walk below never reads the free-page tree; LMDB reads it at the
            # first write, so it is walked here, with plain reads (a page past the end is a
            # short read here, not a SIGBUS).
            _walk_tree(f, meta.free_root, pages, meta.page_size)
    return IndexFileReport(new=False, meta=meta)


P_INVALID = (1 << 64) - 1
P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA = 0x01
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size (then the key, then the data)


def _page(f, pgno: int, pages: int, psize: int, what: str) -> bytes:  # type: ignore[no-untyped-def]
    """Page ``pgno``, checked to be in the file and to name itself."""
    if pgno >= pages:
        raise IndexDamagedError(f"{f.name}: the {what} is page {pgno}, past the end of the file ({pages} pages): truncated")
    raw = os.pread(f.fileno(), psize, pgno * psize)
    if len(raw) != psize or _U64.unpack_from(raw, 0)[0] != pgno:
        raise IndexDamagedError(f"{f.name}: page {pgno} ({what}) does not hold that page: overwritten or zeroed")
    return raw


def _walk_tree(f, root: int, pages: int, psize: int) -> int:  # type: ignore[no-untyped-def]
    """Check every page of the tree at ``root`` (branch, leaf and overflow pages) with plain
    reads; returns the pages seen. Raises IndexDamagedError."""
    todo, seen = [root], 0
    while todo:
        pgno = todo.pop()
        raw = _page(f, pgno, pages, psize, "free-page tree")
        seen += 1
        if seen > pages:
            raise IndexDamagedError(f"{f.name}: the free-page tree loops")
        _, _, flags, lower, upper = _PAGE_HEAD.unpack_from(raw, 0)
        if not flags & (P_BRANCH | P_LEAF) or not 16 <= lower <= upper <= psize:
            raise IndexDamagedError(f"{f.name}: page {pgno} of the free-page tree is not a tree page")
        for k in range((lower - 16) // 2):
            off = struct.unpack_from("<H", raw, 16 + 2 * k)[0]
            if off < upper or off + _NODE.size > psize:
                raise IndexDamagedError(f"{f.name}: page {pgno} has a node outside the page")
            lo, hi, nflags, ksize = _NODE.unpack_from(raw, off)
            if flags & P_BRANCH:
                todo.append(lo | hi << 16 | nflags << 32)
            elif nflags & F_BIGDATA:
                at = off + _NODE.size + ksize
                first = _U64.unpack_from(raw, at)[0]
                over = _page(f, first, pages, psize, "free-list overflow page")
                n_over = struct.unpack_from("<I", over, 12)[0]
                if not _PAGE_HEAD.unpack_from(over, 0)[2] & P_OVERFLOW or first + n_over > pages:
                    raise IndexDamagedError(f"{f.name}: a free-list overflow run is damaged or past the end")
    return seen


# Run in a fresh interpreter (-I: no user site, no cwd on sys.path, so neither this package
# nor the repository's `kernels/` is imported), with the directory this process imported
# lmdb from first on its path (-I also drops PYTHONPATH, where a `pip --target` install puts
# it). _IMPORT exits 4 when lmdb still cannot be imported: a broken environment, which must
# not be reported as a damaged index (whose hint is to rebuild it).
_IMPORT = r"""
import sys
sys.path.insert(0, sys.argv.pop())
try:
    import lmdb
except ImportError as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(4)
"""
# Exit 0 and a JSON line of entry counts, or 3 and the LMDB error; a signal (SIGABRT from an
# LMDB assertion, SIGBUS) is seen by the parent.
_WALK = _IMPORT + r"""
import json
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=64, subdir=True)
try:
    counts = {}
    with env.begin() as txn:
        names = [bytes(k) for k, _ in txn.cursor()]
    for name in names:
        db = env.open_db(name, create=False)
        n = 0
        with env.begin(db=db) as txn:
            for _ in txn.cursor():  # keys and values are copied out: every page is read
                n += 1
        counts[name.decode("utf-8", "replace")] = n
    print(json.dumps(counts))
except lmdb.Error as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(3)
finally:
    env.close()
"""


def _run_child(code: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``code`` (starting with _IMPORT) in a fresh interpreter; raises TierKVError (not
    IndexDamagedError) when that interpreter cannot import lmdb."""
    import lmdb

    site = str(Path(lmdb.__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-I", "-c", code, *args, site], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode == 4:
        detail = (out.stderr.strip().splitlines()[-1:] or ["no detail"])[0]
        raise TierKVError(f"the index check's child interpreter cannot import lmdb ({detail})",
                          hint=f"lmdb must be importable by {sys.executable} from {site}")
    return out


def walk_in_child(index_dir: Path, timeout: float = WALK_TIMEOUT_S) -> dict[str, int]:
    """Step 2: read every page of the index in a child process. Returns the entries of each
    named database; raises IndexDamagedError when the child dies or LMDB reports damage."""
    try:
        out = _run_child(_WALK, [str(index_dir)], timeout)
    except subprocess.TimeoutExpired as e:
        raise IndexDamagedError(f"{index_dir}: reading the index did not finish in {timeout:.0f} s") from e
    if out.returncode < 0:
        raise IndexDamagedError(f"{index_dir}: LMDB cannot read the index (a reader died of signal {-out.returncode})")
    if out.returncode != 0:
        detail = out.stderr.strip().splitlines()[-1:] or ["no detail"]
        raise IndexDamagedError(f"{index_dir}: LMDB cannot read the index ({detail[0]})")
    return {str(k): int(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def check_index(index_dir: Path, walk: bool = True) -> IndexFileReport:
    """Both steps, for an index that nobody is writing (the caller holds the home lock, or
    reads beside an owner with ``walk=False``). Raises IndexDamagedError."""
    report = check_meta(index_dir)
    if report.new or not walk:
        return report
    return IndexFileReport(new=False, meta=report.meta, entries=walk_in_child(index_dir))


_PEEK = _IMPORT + r"""
env = lmdb.open(sys.argv[1], readonly=True, lock=False, max_dbs=8, subdir=True)
try:
    try:
        meta = env.open_db(b"meta", create=False)
    except lmdb.NotFoundError:
        sys.exit(0)
    with env.begin(db=meta) as txn:
        raw = txn.get(sys.argv[2].encode())
    if raw is not None:
        sys.stdout.write("=" + bytes(raw).decode())
except lmdb.Error as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(3)
finally:
    env.close()
"""


def peek_in_child(index_dir: Path, name: str, timeout: float = 60.0) -> str | None:
    """One value of the ``meta`` database, read by a child process (beside a running owner
    too: read-only, no lock table), so that a damaged page cannot kill this process."""
    check_meta(index_dir)
    try:
        out = _run_child(_PEEK, [str(index_dir), name], timeout)
    except subprocess.TimeoutExpired as e:
        raise IndexDamagedError(f"{index_dir}: reading the index did not finish in {timeout:.0f} s") from e
    if out.returncode != 0:
        why = f"signal {-out.returncode}" if out.returncode < 0 else (out.stderr.strip().splitlines()[-1:] or ["?"])[0]
        raise IndexDamagedError(f"{index_dir}: LMDB cannot read the index ({why})")
    return out.stdout[1:] if out.stdout.startswith("=") else None
