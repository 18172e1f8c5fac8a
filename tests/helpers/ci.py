"""Skip or fail: a test may skip only for a reason outside tierkv (not root, a package
that is not installed here). In CI (``CI=true``, run as root) the system is set up by
scripts/test.sh, so what would be a skip on a laptop is a failure there: a missing system
library or a Mooncake master that does not start must turn CI red, not green."""
from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def skip_outside_ci(reason: str) -> None:
    """pytest.skip(reason) on a developer machine; pytest.fail in CI as root."""
    if in_ci() and os.geteuid() == 0:
        pytest.fail(f"{reason} (CI runs as root with scripts/test.sh's setup: this test must run there)")
    pytest.skip(reason)
