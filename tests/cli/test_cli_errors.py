"""How the `tierkv` command words errors (issue #37, item 10): a hint that names a library
call (tierkv.open(), tierkv.connect()) is given in command-line words instead."""
from __future__ import annotations

from click.testing import CliRunner

from tierkv.cli import main
from tierkv.errors import ConfigError, DaemonOwnsHomeError, DeviceUnavailableError, TierKVError, UntrustedDaemonError


def test_library_hints_are_worded_for_the_command_line():
    for cls in (ConfigError, DaemonOwnsHomeError, UntrustedDaemonError):
        assert "tierkv." in cls.default_hint
        local = cls("bad").for_command_line()
        from_daemon = cls("bad", hint=cls.default_hint).for_command_line()  # the hint came over the wire as text
        assert local == from_daemon == f"bad (hint: {cls.cli_hint})" and "tierkv." not in local
    assert ConfigError("bad", hint="do this").for_command_line() == "bad (hint: do this)"  # explicit: kept
    # A subclass with a default hint of its own keeps it (the parent's wording is for the parent's).
    assert DeviceUnavailableError("bad").for_command_line() == f"bad (hint: {DeviceUnavailableError.default_hint})"
    assert TierKVError("bad").for_command_line() == "bad"


def test_serve_with_a_bad_option_gives_a_command_line_hint(tmp_path):
    r = CliRunner().invoke(main, ["serve", "--home", str(tmp_path / "h"), "--socket", str(tmp_path / "s.sock"),
                                  "--max-layouts", "0"])
    assert r.exit_code == 1, r.output
    assert "tierkv.open" not in r.output and "tierkv COMMAND --help" in r.output
    assert not (tmp_path / "h").exists() and not (tmp_path / "s.sock").exists()


def test_a_document_error_gives_a_command_line_hint(tmp_path):
    """A ConfigError raised without a hint through a main-job command."""
    from tierkv.cli.common import TierKVGroup

    group = TierKVGroup()

    @group.command()
    def fail() -> None:
        raise ConfigError("--max-tokens must be positive, got 0")

    r = CliRunner().invoke(group, ["fail"])
    assert r.exit_code == 1 and r.stderr.strip() == (
        "Error: --max-tokens must be positive, got 0 (hint: check the command's options (tierkv COMMAND --help) "
        "and the config file)")
