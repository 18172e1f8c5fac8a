"""docs/cli.md against the command itself (issue #37, item 10): its table lists every
command of the `tierkv` group, and each row links a section that exists."""
from __future__ import annotations

import re
from pathlib import Path

from tierkv.cli import main

CLI_MD = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _table_rows(text: str) -> list[str]:
    """The rows of the first table whose header is `| command | what it does |`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\|\s*command\s*\|", line))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_command_table_lists_every_command_and_links_its_section():
    text = CLI_MD.read_text()
    rows = _table_rows(text)
    listed = {name for row in rows for name in re.findall(r"`([a-z][a-z-]*)`", row.split("|")[1])}
    assert listed == set(main.commands), (
        f"docs/cli.md's table lacks {sorted(set(main.commands) - listed)}, "
        f"lists unknown {sorted(listed - set(main.commands))}")
    anchors = {_anchor(h) for h in re.findall(r"^#{2,4} (.+)$", text, flags=re.M)}
    links = [link for row in rows for link in re.findall(r"\]\(#([^)]+)\)", row)]
    assert len(links) == len(rows) and set(links) <= anchors, sorted(set(links) - anchors)


def test_serve_help_names_every_socket_fallback():
    """Issue #37, item 10: `serve --help` omitted /tmp/tierkv-UID, used without XDG_RUNTIME_DIR."""
    from click.testing import CliRunner

    r = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200)
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    for fallback in ("$TIERKV_SOCKET", "$XDG_RUNTIME_DIR/tierkv/tierkv.sock", "/tmp/tierkv-UID/tierkv.sock",
                     "$TIERKV_HOME", "~/.local/share/tierkv"):
        assert fallback in text, fallback
