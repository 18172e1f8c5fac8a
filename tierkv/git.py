"""Asking git about a work tree: one command at a time, no shell, None on any failure.

Documents use git to list a tree's files (honouring every ignore rule git honours) and to
date them by history. Git is optional there: callers treat None (git not installed, not a
work tree, a command that failed) as "no git" and fall back to reading the filesystem, so
nothing here raises.
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import NamedTuple, Sequence

# Settings a user's config could change that would alter what we parse: signatures would
# be printed into `git log` output, and a root commit's files would be left out.
_FIXED_CONFIG = ("-c", "log.showSignature=false", "-c", "log.showRoot=true")


class WorkTree(NamedTuple):
    top: Path  # the work tree's top directory, as git reports it (symlinks resolved)
    shallow: bool  # a shallow clone: its history is cut


def run_git(args: Sequence[str], cwd: Path) -> bytes | None:
    """Stdout of ``git <args>`` run in ``cwd``, or None when git is missing or fails."""
    try:
        out = subprocess.run(["git", *_FIXED_CONFIG, *args], cwd=cwd, capture_output=True, check=False)
    except OSError:  # no git binary, or cwd is gone
        return None
    return out.stdout if out.returncode == 0 else None


def work_tree(cwd: Path) -> WorkTree | None:
    """The git work tree containing directory ``cwd``, or None outside one."""
    out = run_git(["rev-parse", "--show-toplevel", "--is-shallow-repository"], cwd)
    if out is None:
        return None
    lines = out.decode("utf-8", "surrogateescape").splitlines()
    if len(lines) != 2:
        return None
    return WorkTree(Path(lines[0]), lines[1] == "true")


def split_z(out: bytes) -> list[str]:
    """The NUL-separated paths of a ``-z`` listing (paths are raw bytes: no quoting)."""
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]
