"""``python -m tierkv ...`` is the ``tierkv`` command (e.g. ``python -m tierkv serve``)."""
from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main(prog_name="tierkv")
