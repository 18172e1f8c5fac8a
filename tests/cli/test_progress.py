"""The CLI's progress bar (tierkv/cli/common.py, progress_bar)."""
from __future__ import annotations

import logging
import re

from tierkv.cli.common import progress_bar


def test_a_log_line_during_the_bar_gets_a_line_of_its_own(capsys):
    """Issue #37, item 10: the store's "disk tier degraded" warning landed inside the bar."""
    progress, close = progress_bar("prefill")
    progress(0, 100)
    progress(40, 100)
    logging.getLogger("tierkv.tiers.disk").warning("disk tier degraded: ENOSPC")
    progress(100, 100)
    close()
    err = capsys.readouterr().err
    assert re.search(r"(^|[\r\n])disk tier degraded: ENOSPC\n", err), repr(err)
    assert re.search(r"prefill: 100%.*100/100", err), repr(err)
    # Closed: the redirection ended with the bar, records go where they went before.
    assert not any(type(h).__name__ == "_TqdmLoggingHandler" for h in logging.getLogger().handlers)


def test_a_disabled_bar_prints_nothing(capsys):
    progress, close = progress_bar("prefill", enabled=False)
    progress(0, 10)
    progress(10, 10)
    close()
    assert capsys.readouterr().err == ""
