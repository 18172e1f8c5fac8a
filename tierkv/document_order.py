"""The order of a document's files: files likely to change come last (issue #35, item 1).

A prefix is reused up to the first byte that differs, so a file edited today should sit
after the files nobody has touched for a year. The stability order sorts the kept files by
a key of three parts, then by header path to break ties:

1. class 0: committed and unchanged since, keyed by the committer time of the last commit
   that touched the file (oldest first); a file outside any git work tree is in this class
   too, keyed by its mtime (``st_mtime_ns``, oldest first);
2. class 1: uncommitted changes (modified, staged, deleted-and-recreated: anything
   ``git status`` reports for a tracked path), in header-path order;
3. class 2: untracked (or ignored, when ``.gitignore`` is off), in header-path order.

Inside git the order depends only on the tree and its history (commit times, never the
mtimes a checkout happened to write), so it is the same on every machine. Several roots,
some in git and some not, and nested repositories (a submodule, a clone inside a tree)
merge into one order by the same key; each repository's history is read once
(``git log --name-only``, git 2.31 or later, parsed in one pass: the first time a path appears is its newest
commit), not once per file.

Fallback, never an exception: when ``git`` is not installed, the root is not in a work
tree, the clone is shallow (its history is cut, so "last commit" would be a guess), the
repository has no commit yet, or any git command fails, that repository's files are
ordered by mtime as if git were absent. That order is only as stable as the mtimes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

from .git import WorkTree, run_git, work_tree

COMMITTED, UNCOMMITTED, UNTRACKED = 0, 1, 2


class KeptFile(NamedTuple):
    """A file that goes into the document: its header path and where it is read from."""

    header: str
    path: Path


class _Key(NamedTuple):
    cls: int
    time_ns: int
    header: str


@dataclass(frozen=True)
class _History:
    """What one repository says about its paths (relative to ``top``, '/'-separated)."""

    top: Path
    last_commit_ns: dict[str, int]
    changed: frozenset[str]


def parse_log(out: bytes) -> dict[str, int]:
    """Path -> commit time (ns) of its newest commit, from
    ``git log -z --format=%x01%ct --name-only`` output (newest commit first)."""
    times: dict[str, int] = {}
    current: int | None = None
    after_header = False
    for token in out.decode("utf-8", "surrogateescape").split("\0"):
        if after_header and token.startswith("\n"):
            token = token[1:]  # the separator git writes between a header and its names
        after_header = False
        if token.startswith("\x01"):
            current = int(token[1:]) * 1_000_000_000
            after_header = True
        elif token and current is not None:
            times.setdefault(token, current)  # first seen = newest commit
    return times


def parse_status(out: bytes) -> frozenset[str]:
    """Paths ``git status --porcelain -z`` reports (entries ``XY path``)."""
    paths: set[str] = set()
    tokens = out.decode("utf-8", "surrogateescape").split("\0")
    i = 0
    while i < len(tokens):
        entry = tokens[i]
        i += 1
        if len(entry) < 4:
            continue
        paths.add(entry[3:])
        if entry[0] in "RC":
            i += 1  # a rename's source path follows; we ask for --no-renames, but be safe
    return frozenset(paths)


def _history(top: Path) -> _History | None:
    # dense-combined: a merge commit lists the files it changed against every parent (a
    # conflict resolution, a file added in the merge itself); by default git log shows no
    # files for merges, and such a file would look untracked. Files merged in unchanged
    # keep the date of the branch commit that changed them.
    log = run_git(["log", "-z", "--format=%x01%ct", "--name-only", "--no-renames",
                   "--diff-merges=dense-combined"], top)
    # --no-optional-locks: status would otherwise refresh (write) the index.
    status = run_git(["--no-optional-locks", "status", "--porcelain", "-z", "--untracked-files=no",
                   "--no-renames"], top)
    if log is None or status is None:
        return None  # includes a repository with no commit yet: git log fails there
    return _History(top, parse_log(log), parse_status(status))


class _Repos:
    """Finds the repository of each file, reading each repository's history once."""

    def __init__(self, stops: set[Path]) -> None:
        self._stops = stops  # directories at which the upward search asks git directly
        self._dir_tree: dict[Path, WorkTree | None] = {}
        self._histories: dict[Path, _History | None] = {}

    def _tree_of_dir(self, d: Path) -> WorkTree | None:
        if d in self._dir_tree:
            return self._dir_tree[d]
        at_stop = d in self._stops or d.parent == d
        # Ask git only where a repository can start (a .git here: a submodule or a nested
        # clone) or where the search ends, not once per directory.
        tree = work_tree(d) if at_stop or (d / ".git").exists() else None
        if tree is None and not at_stop:
            tree = self._tree_of_dir(d.parent)  # no .git here, or a stray one git rejects
        self._dir_tree[d] = tree
        return tree

    def history_of(self, file: Path) -> _History | None:
        tree = self._tree_of_dir(Path(os.path.realpath(file.parent)))
        if tree is None or tree.shallow:
            return None  # shallow: the cut history would date every old file at the cut
        if tree.top not in self._histories:
            self._histories[tree.top] = _history(tree.top)
        return self._histories[tree.top]


def _mtime_ns(path: Path) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0  # it will be reported as unreadable when read


def _key(file: KeptFile, repos: _Repos) -> _Key:
    history = repos.history_of(file.path)
    if history is None:
        return _Key(COMMITTED, _mtime_ns(file.path), file.header)
    real = Path(os.path.realpath(file.path.parent)) / file.path.name
    try:
        rel = real.relative_to(os.path.realpath(history.top)).as_posix()
    except ValueError:
        return _Key(COMMITTED, _mtime_ns(file.path), file.header)
    if rel in history.changed:
        return _Key(UNCOMMITTED, 0, file.header)
    if rel in history.last_commit_ns:
        return _Key(COMMITTED, history.last_commit_ns[rel], file.header)
    return _Key(UNTRACKED, 0, file.header)


def stability_order(files: Sequence[KeptFile], roots: Sequence[Path]) -> list[KeptFile]:
    """``files`` (found under the argument ``roots``: directories, or files given directly)
    sorted as the module docstring says. Runs a few git commands per repository; never
    raises for git's sake (see the fallback above)."""
    stops = {Path(os.path.realpath(r if r.is_dir() else r.parent)) for r in roots}
    repos = _Repos(stops)
    return sorted(files, key=lambda f: _key(f, repos))
