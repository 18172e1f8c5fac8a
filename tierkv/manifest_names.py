"""What a named prefix's name may be: one rule for the embedded store, the daemon (whose
tenancy prefixes a uid's names and so leaves each tenant fewer characters) and bundles.

A name is the key of its manifest in LMDB, which refuses keys over 511 bytes with a raw
BadValsizeError; a lone surrogate failed as a raw UnicodeEncodeError and a '/' made a path
where names are files (issue 11, item 11). The embedded store checked only length and '/'
until issue #32 found the rule written three times.
"""
from __future__ import annotations

from typing import Any

from .errors import InvalidNameError

MAX_NAME = 200  # characters
MAX_NAME_BYTES = 400  # of UTF-8, below LMDB's 511-byte key limit


def check_name(name: Any, max_len: int = MAX_NAME) -> None:
    """InvalidNameError unless ``name`` is 1..max_len characters (at most MAX_NAME_BYTES
    of UTF-8) without '/'."""
    if not isinstance(name, str) or not name or len(name) > max_len or "/" in name:
        raise InvalidNameError(f"bad name {str(name)[:40]!r}: 1-{max_len} characters, no '/'")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidNameError(f"bad name {name[:40]!r}: not valid UTF-8 (a lone surrogate?)") from None
    if len(raw) > MAX_NAME_BYTES:
        raise InvalidNameError(f"name of {len(raw)} UTF-8 bytes; at most {MAX_NAME_BYTES}")
