"""A damaged index never kills the process (issue 11, item 4).

Real damage to a real ``data.mdb``: truncation at several lengths and one zeroed 4 KiB page
at several offsets. Every probe runs in a forked child, so a regression (SIGBUS from a
truncated mapping, SIGABRT from an LMDB assertion) shows as a failing test, not a dead
runner. Each probe must end cleanly: either the store opens and serves exactly the stored
bytes, or the open raises IndexDamagedError naming `tierkv verify --repair`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import traceback
from pathlib import Path

import pytest

from tierkv.errors import IndexDamagedError
from tierkv.index_check import check_meta

from .kit import SCOPE, assert_lease_exact, open_store, put_chain, toks

N_CHAINS = 120


def _probe(home: Path, shm: Path) -> dict:
    """Open the damaged home, lease every chain, verify, check integrity, put, close."""
    import tierkv

    try:
        store = open_store(home, shm_dir=shm, disk_bytes=1024 * 4096, segment_pages=64)
    except IndexDamagedError as e:
        return {"result": "refused", "error": str(e)}
    found = 0
    with store:
        for i in range(N_CHAINS):
            with store.acquire(toks(i, 3), SCOPE) as lease:
                assert_lease_exact(lease)
                found += lease.num_blocks
        store.verify()
        store.check_integrity()
        put_chain(store, toks(10_000, 2))
    # The ops tools read the layout first, without opening the store.
    tierkv.home_layout(home)
    return {"result": "opened", "found": found}


def in_fork(fn, *args) -> tuple[int, dict | None, str]:
    """Run ``fn(*args)`` in a forked child: (exit status, its JSON result, its traceback)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            out = json.dumps(fn(*args))
            code = 0
        except BaseException:
            out = json.dumps({"traceback": traceback.format_exc()})
        finally:
            os.write(w, out.encode())
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        raw = f.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    data = json.loads(raw) if raw else None
    return code, data, (data or {}).get("traceback", "")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    store = open_store(root / "home", shm_dir=root / "shm", disk_bytes=1024 * 4096, segment_pages=64)
    with store:
        for i in range(N_CHAINS):
            put_chain(store, toks(i, 3))
    return root / "home"


def damaged_copy(pristine: Path, tmp_path: Path) -> tuple[Path, Path]:
    home = tmp_path / "home"
    shutil.copytree(pristine, home)
    return home, home / "index" / "data.mdb"


def assert_survived(code: int, data: dict | None, tb: str, what: str) -> None:
    assert code >= 0, f"{what}: the process died of {signal.Signals(-code).name}"
    assert code == 0, f"{what}: {tb}"
    assert data is not None
    if data["result"] == "refused":
        assert "tierkv verify --repair" in data["error"], data
    else:
        assert data["found"] == N_CHAINS * 3, f"{what}: opened but served {data['found']} blocks"


@pytest.mark.parametrize("cut", ["half", "last-page", "one-byte", "two-pages", "zero"])
def test_truncated_index_is_a_clear_error(pristine, tmp_path, cut):
    home, data = damaged_copy(pristine, tmp_path)
    size = data.stat().st_size
    new = {"half": size // 2, "last-page": size - 4096, "one-byte": size - 1, "two-pages": 8192, "zero": 0}[cut]
    os.truncate(data, new)
    code, out, tb = in_fork(_probe, home, tmp_path / "shm")
    assert_survived(code, out, tb, f"truncated to {new} of {size} bytes")
    if cut in ("zero", "two-pages", "half"):
        assert out["result"] == "refused"  # these cuts remove pages in use (or the whole index)


@pytest.mark.parametrize("page", [0, 1, 2, 5, 11, 23, "last"])
def test_zeroed_index_page_is_a_clear_error_or_harmless(pristine, tmp_path, page):
    home, data = damaged_copy(pristine, tmp_path)
    n_pages = data.stat().st_size // 4096
    at = n_pages - 1 if page == "last" else page
    with open(data, "r+b") as f:
        f.seek(at * 4096)
        f.write(b"\0" * 4096)
    code, out, tb = in_fork(_probe, home, tmp_path / "shm")
    # A zeroed page still in use is refused; a zeroed free page is harmless (all bytes served).
    assert_survived(code, out, tb, f"page {at} of {n_pages} zeroed")
    if at in (0, 1):
        assert out["result"] == "refused"  # a meta page


def test_zeroed_tree_pages_are_refused_somewhere(pristine, tmp_path):
    """Sweep: zero each page in turn; none may kill the process, and the pages the tree uses
    must be found (at least the root and branch pages of the blocks database)."""
    n_pages = (pristine / "index" / "data.mdb").stat().st_size // 4096
    refused = 0
    for at in range(2, n_pages):
        work = tmp_path / f"p{at}"
        shutil.copytree(pristine / "index", work / "index")
        with open(work / "index" / "data.mdb", "r+b") as f:
            f.seek(at * 4096)
            f.write(b"\0" * 4096)

        def walk(index_dir: Path) -> dict:
            from tierkv.index import Index

            try:
                idx = Index(index_dir, 1 << 30)
            except IndexDamagedError:
                return {"result": "refused"}
            n = sum(1 for _ in idx.iter_blocks())
            idx.close()
            return {"result": "opened", "n": n}

        code, out, tb = in_fork(walk, work / "index")
        assert code == 0, f"page {at}: status {code} {tb}"
        if out["result"] == "opened":
            assert out["n"] == N_CHAINS * 3, f"page {at} zeroed: opened with {out['n']} records"
        refused += out["result"] == "refused"
        shutil.rmtree(work)
    assert refused >= n_pages // 2, f"only {refused} of {n_pages} zeroed pages were noticed"


def test_meta_check_reads_lmdb_meta_pages(pristine):
    report = check_meta(pristine / "index")
    assert not report.new and report.meta is not None
    assert report.meta.page_size == 4096 and report.meta.txnid > 0
    assert (report.meta.last_page + 1) * 4096 <= (pristine / "index" / "data.mdb").stat().st_size


def test_missing_index_beside_segments_is_refused(pristine, tmp_path):
    home, _ = damaged_copy(pristine, tmp_path)
    shutil.rmtree(home / "index")
    with pytest.raises(IndexDamagedError, match="verify --repair"):
        open_store(home, shm_dir=tmp_path / "shm")
    # Refused before anything changed: the segments are all still there.
    assert sorted(p.name for p in (home / "segments").iterdir()) == sorted(p.name for p in (pristine / "segments").iterdir())


def test_file_may_end_before_the_last_page_number(pristine, tmp_path):
    """LMDB counts pages a transaction took and gave back before committing ("loose" pages)
    in the meta's last page number without writing them, so after a SIGKILL the file can end
    before it (the crash torture met this). That is not damage: it must open and serve."""
    import struct

    home, data = damaged_copy(pristine, tmp_path)
    with open(data, "r+b") as f:
        for meta in (0, 4096):
            f.seek(meta + 136)
            (last,) = struct.unpack("<Q", f.read(8))
            f.seek(meta + 136)
            f.write(struct.pack("<Q", last + 3))
    code, out, tb = in_fork(_probe, home, tmp_path / "shm")
    assert_survived(code, out, tb, "last page number past the end")
    assert out["result"] == "opened"


def test_the_index_walk_finds_lmdb_where_this_process_did(pristine, monkeypatch):
    """The walk's child runs isolated (-I drops PYTHONPATH); it is told where lmdb came from,
    so an lmdb installed off the default path (pip --target plus PYTHONPATH, as on the GPU
    check's machine) is found: here a base interpreter outside this venv reads the index."""
    import sys

    from tierkv.index_check import walk_in_child

    base = Path(sys.base_prefix) / "bin" / "python3"  # here and in CI: a python without lmdb
    if not base.exists():
        base = Path(sys.executable)
    monkeypatch.setattr(sys, "executable", str(base))
    counts = walk_in_child(pristine / "index")
    assert counts and all(n >= 0 for n in counts.values())


def test_a_child_that_cannot_import_lmdb_is_not_a_damaged_index(pristine, tmp_path, monkeypatch):
    """A broken environment must not be reported as damage (whose hint is to rebuild)."""
    import lmdb

    from tierkv.errors import TierKVError
    from tierkv.index_check import walk_in_child

    fake = tmp_path / "site" / "lmdb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no lmdb here')\n")
    monkeypatch.setattr(lmdb, "__file__", str(fake / "__init__.py"))
    with pytest.raises(TierKVError, match="cannot import lmdb") as e:
        walk_in_child(pristine / "index")
    assert not isinstance(e.value, IndexDamagedError)
