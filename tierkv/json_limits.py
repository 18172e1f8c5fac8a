"""Bounds on untrusted JSON before ``json.loads`` sees it: the daemon's frame headers
(daemon/protocol.py) and a bundle's header (bundle_format.py) both refuse nesting deeper
than their limit first, since ``json.loads`` recurses once per level and a header of 64 KiB
of ``[`` raised RecursionError (issue 11, item 8). Here, not in the daemon's protocol: a
bundle is read without any daemon, and importing the wire format for it made bundle_format
depend on the daemon's internals (issue #32).
"""
from __future__ import annotations

import re

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


def nests_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether arrays and objects in ``raw`` nest more than ``limit`` deep, found by a flat
    scan (no recursion: the point is to refuse what would make ``json.loads`` recurse too
    deep). Brackets inside strings do not count. Malformed input may give a wrong answer;
    ``json.loads`` rejects it afterwards anyway."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # fast path: cannot nest deeper than the number of openers
    depth = 0
    for ch in _STRING.sub(b'""', raw):
        if ch in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif ch in (0x5D, 0x7D):  # ] }
            depth -= 1
    return False
