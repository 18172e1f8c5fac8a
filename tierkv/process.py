"""The current process id, without a system call per request.

A store or client opened in one process must refuse to run in a fork of it (the child
would share the parent's locks, mappings and socket). Checking ``os.getpid()`` on every
call is a system call each time (glibc caches no pid since 2.25): on the trace replay it
was 3% of the store's time. The pid is read once and re-read in a child right after fork.
"""
from __future__ import annotations

import os

_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def current_pid() -> int:
    """``os.getpid()``, cached (kept true across fork by an at-fork hook)."""
    return _pid
