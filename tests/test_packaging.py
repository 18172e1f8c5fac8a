"""The top-level kernels/ directory must not shadow the Hugging Face ``kernels`` package
(which transformers and vLLM import) when Python runs from the repository root, and
``tierkv.kernels`` must keep its API (issue 10, item 5)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_at_root(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_kernels_dir_is_not_a_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()
    # At most a PEP 420 namespace portion (no loader, no __file__), which transformers
    # treats as "not installed".
    got = run_at_root("import importlib.util as u; s = u.find_spec('kernels'); print(s is None or s.loader is None)")
    assert got == "True"


def test_an_installed_kernels_package_wins_over_the_repository_directory(tmp_path):
    site = tmp_path / "site" / "kernels"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("REAL = True\n")
    got = run_at_root(f"import sys; sys.path.append({str(site.parent)!r}); import kernels; print(kernels.REAL)")
    assert got == "True"


def test_tierkv_kernels_api_from_the_repository_root():
    got = run_at_root("import tierkv.kernels as k, tierkv.kernels.reference as r; "
                      "print(callable(k.paged_decode_attention) and callable(r.paged_decode_reference))")
    assert got == "True"


def test_transformers_sees_no_kernels_package_from_the_repository_root():
    got = run_at_root("from transformers.utils.import_utils import is_kernels_available; "
                      "print(is_kernels_available())")
    assert got == "False"
