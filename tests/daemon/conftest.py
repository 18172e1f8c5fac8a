"""Fixtures of the daemon tests (helpers live in daemon_helpers.py)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from helpers.daemons import DaemonThread
from daemon_helpers import make_config


@pytest.fixture
def workdir():
    d = Path(tempfile.mkdtemp(dir="/tmp", prefix="tkvd-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(workdir):
    d = DaemonThread(make_config(workdir)).start()
    yield d
    if d.thread.is_alive():
        d.call(d.daemon.check_integrity)
    d.stop()
