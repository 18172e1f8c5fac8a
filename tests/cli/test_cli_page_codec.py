"""``--page-codec`` on materialize and generate: a new home takes it, an existing one keeps
its own (naming another is an error, exit status 1), and it is the daemon's setting when
``--socket`` is given."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tierkv.cli import main

pytestmark = pytest.mark.usefixtures("private_caches")


def _run(*args: object) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def test_materialize_int8_then_generate(llama_dir, repo, tmp_path):
    home = tmp_path / "home"
    made = _run("materialize", repo, "--model", llama_dir, "--home", home, "--name", "repo", "--no-progress",
                "--page-codec", "int8", "--json")
    assert made.exit_code == 0, made.output
    stored = json.loads(made.stdout.strip().splitlines()[-1])["stored_blocks"]
    assert stored > 0
    request = ("generate", "--model", llama_dir, "--prompt", "store the block", "--max-new-tokens", "3",
               "--prefix", "repo", "--json")
    ask = (*request, "--home", home)
    warm = _run(*ask)  # no codec named: the home's
    assert warm.exit_code == 0, warm.output
    assert json.loads(warm.stdout.strip().splitlines()[-1])["cached_tokens"] == stored * 16
    again = _run(*ask, "--page-codec", "int8")
    assert again.exit_code == 0, again.output
    wrong = _run(*ask, "--page-codec", "none")
    assert wrong.exit_code == 1 and "page codec 'int8'" in wrong.output and "Traceback" not in wrong.output
    daemon = _run(*request, "--page-codec", "int8", "--socket", tmp_path / "no.sock")
    assert daemon.exit_code == 2 and "daemon's setting" in daemon.output
