"""Build hook (the project is configured in pyproject.toml): wheels get the modules of the
top-level kernels/ directory copied into tierkv/kernels/.

kernels/ has no __init__.py so that, from the repository root, it never shadows the Hugging
Face ``kernels`` package; tierkv/kernels/__init__.py reaches it through ``__path__`` in a
source tree or an editable install, and finds the copies in an installed wheel.
"""
from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads kernels/ in place
        dest = Path(self.build_lib) / "tierkv" / "kernels"
        for src in sorted((ROOT / "kernels").glob("*.py")):
            self.copy_file(str(src), str(dest / src.name))


setup(cmdclass={"build_py": BuildPy})
