"""The daemon's configuration in sections (issue #32, item 3): the nested file is the
documented form and round-trips through `tierkv config show`; a flat file of before still
loads, to the same configuration, with one WARNING line per key naming its new place; an
unknown key of a section fails naming it and the nearest valid one."""
from __future__ import annotations

import json
import logging
import os

import pytest
from click.testing import CliRunner

from tierkv.cli import main
from tierkv.daemon.config import KEYS, merge, read_config_file
from tierkv.daemon.config.keys import type_of
from tierkv.errors import ConfigError
from tierkv.layout import PageLayout

@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("TIERKV_", "MC_")):
            monkeypatch.delenv(name)


NESTED = """
[store]
home = "/var/lib/tierkv"
device = "cpu"
device_bytes = "8GiB"
host_bytes = "64GiB"
disk_bytes = "1TiB"
eviction_policy = "lru"
[server]
socket = "/run/tierkv/tierkv.sock"
workers = 6
max_inflight = 16
[access]
allowed_uids = [1000, 1001]
namespace_per_uid = true
[leases]
timeout_s = 120
[staging]
region_bytes = "1GiB"
per_client_bytes = "256MiB"
timeout_s = 30
[layouts]
max_open = 2
idle_s = 60
[layouts.preload]
num_layers = 32
num_kv_heads = 8
head_dim = 128
dtype = "bfloat16"
[quotas]
connections_per_uid = 8
unread_reply_bytes = "32MiB"
[metrics]
port = 9464
host = "0.0.0.0"
[remote]
master = "10.0.0.5:50051"
metadata_url = "http://10.0.0.5:8080/metadata"
segment_bytes = "1GiB"
[publish]
puts = true
local_only_namespaces = ["private"]
"""

# The same settings as NESTED, written as before the sections: flat keys, [layout], the
# publish policy in [remote].
FLAT = """
home = "/var/lib/tierkv"
device = "cpu"
device_bytes = "8GiB"
host_bytes = "64GiB"
disk_bytes = "1TiB"
eviction_policy = "lru"
socket = "/run/tierkv/tierkv.sock"
workers = 6
max_inflight = 16
allowed_uids = [1000, 1001]
namespace_per_uid = true
lease_timeout_s = 120
staging_bytes = "1GiB"
client_staging_bytes = "256MiB"
staging_timeout_s = 30
max_layouts = 2
layout_idle_s = 60
metrics_port = 9464
metrics_host = "0.0.0.0"
local_only_namespaces = ["private"]
[layout]
num_layers = 32
num_kv_heads = 8
head_dim = 128
dtype = "bfloat16"
[quotas]
connections_per_uid = 8
unread_reply_bytes = "32MiB"
[remote]
master = "10.0.0.5:50051"
metadata_url = "http://10.0.0.5:8080/metadata"
segment_bytes = "1GiB"
publish_puts = true
"""


def test_a_nested_file_gives_each_section_its_settings(tmp_path):
    f = tmp_path / "daemon.toml"
    f.write_text(NESTED)
    cfg = merge({}, read_config_file(f), {})
    assert cfg.store.host_bytes == 64 << 30 and cfg.store.eviction_policy == "lru" and cfg.store.device == "cpu"
    assert cfg.server.workers == 6 and str(cfg.server.resolved_pid_file) == "/run/tierkv/tierkv.sock.pid"
    assert cfg.access.allowed_uids == (1000, 1001) and cfg.access.namespace_per_uid
    assert cfg.leases.timeout_s == 120 and cfg.staging.per_client_bytes == 256 << 20 and cfg.staging.timeout_s == 30
    assert cfg.layouts.preload == PageLayout(32, 8, 128, 16, "bfloat16") and cfg.layouts.resolved_max_open == 2
    assert cfg.quotas.connections_per_uid == 8 and cfg.quotas.unread_reply_bytes == 32 << 20
    assert (cfg.metrics.port, cfg.metrics.host) == (9464, "0.0.0.0")
    assert cfg.remote.enabled and cfg.remote.tier_config().global_segment_bytes == 1 << 30
    assert cfg.publish.policy().publish_puts and cfg.publish.local_only_namespaces == ("private",)
    assert cfg.sources["store.host_bytes"] == "file" and cfg.sources["server.max_connections"] == "default"
    assert cfg.sources["quotas.connections_per_uid"] == "file"


def test_config_show_json_round_trips_the_nested_file(tmp_path):
    """`config show --json` prints the sections as the file nests them: written back as a
    file of its values, it gives the same configuration."""
    f = tmp_path / "daemon.toml"
    f.write_text(NESTED)
    result = CliRunner().invoke(main, ["config", "show", "--config", str(f), "--json"])
    assert result.exit_code == 0, result.output
    settings = json.loads(result.stdout.strip().splitlines()[-1])["settings"]
    assert set(settings) == {key.split(".")[0] for key in KEYS}
    assert {f"{s}.{k}" for s, table in settings.items() for k in table} == set(KEYS)
    assert settings["store"]["host_bytes"] == {"value": str(64 << 30), "source": f"file {f}"}
    assert settings["layouts"]["preload"]["value"] == PageLayout(32, 8, 128, 16, "bfloat16").to_json()
    assert settings["quotas"]["connections_per_uid"] == {"value": "8", "source": f"file {f}"}
    # Back into a file: every setting given (none None) as its text, each in its table.
    lines = []
    for section, table in settings.items():
        lines.append(f"[{section}]")
        for name, item in table.items():
            if item["value"] and name != "preload":
                lines.append(f"{name} = {_toml(section, name, item['value'])}")
    lines += ["[layouts.preload]", *(f"{k} = {json.dumps(v)}" for k, v in
                                    json.loads(settings["layouts"]["preload"]["value"]).items())]
    again = tmp_path / "again.toml"
    again.write_text("\n".join(lines) + "\n")
    assert merge({}, read_config_file(again), {}) == merge({}, read_config_file(f), {})
    # The text form names each setting by its key.
    text = CliRunner().invoke(main, ["config", "show", "--config", str(f)]).stdout
    assert any(line.startswith("store.host_bytes ") and str(64 << 30) in line for line in text.splitlines())


def _toml(section: str, name: str, text: str) -> str:
    kind = type_of(f"{section}.{name}")
    if kind.startswith("tuple"):
        items = [x for x in text.split(",") if x]
        return json.dumps([int(x) for x in items] if kind == "tuple[int, ...]" else items)
    if kind.startswith("bool"):
        return text.lower()
    if kind.startswith(("int", "float")):
        return text
    return json.dumps(text)


def test_a_flat_file_of_before_loads_the_same_with_a_warning_per_key(tmp_path, caplog):
    nested, flat = tmp_path / "nested.toml", tmp_path / "flat.toml"
    nested.write_text(NESTED)
    flat.write_text(FLAT)
    with caplog.at_level(logging.WARNING, logger="tierkv.config"):
        old = merge({}, read_config_file(flat), {})
    assert old == merge({}, read_config_file(nested), {})
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 22  # one per flat key, [layout] and [remote] publish_puts included
    assert f"{flat}: 'host_bytes' is deprecated: write host_bytes under [store] (store.host_bytes)" in warnings
    assert f"{flat}: 'layout' is deprecated: write preload under [layouts] (layouts.preload)" in warnings
    assert f"{flat}: '[remote] publish_puts' is deprecated: write puts under [publish] (publish.puts)" in warnings
    assert all("\n" not in w for w in warnings)
    # A [daemon] table of flat keys, as the old docs allowed, too.
    flat.write_text('[daemon]\nhost_bytes = "2GiB"\nworkers = 3\n')
    assert read_config_file(flat) == {"store.host_bytes": "2GiB", "server.workers": 3}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierkv.config"):
        read_config_file(nested)
    assert not caplog.records  # the nested form warns of nothing


@pytest.mark.parametrize(("text", "named", "suggested"), [
    ('[store]\nhost_byte = "1GiB"\n', "'store.host_byte'", "store.host_bytes"),
    ("[staging]\nstaging_bytes = 5\n", "'staging.staging_bytes'", None),
    ("[quotas]\nconnection_per_uid = 2\n", "'quotas.connection_per_uid'", "quotas.connections_per_uid"),
    ('host_byte = "1GiB"\n', "'host_byte'", "store.host_bytes"),
    ("[metric]\nport = 1\n", "'metric'", "[metrics]"),
])
def test_an_unknown_key_fails_naming_it_and_the_nearest(tmp_path, text, named, suggested):
    f = tmp_path / "daemon.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        read_config_file(f)
    assert named in info.value.message and str(f) in info.value.message
    if suggested:
        assert f"did you mean {suggested}?" in info.value.message
    assert info.value.hint


def test_a_section_that_is_not_a_table_fails(tmp_path):
    f = tmp_path / "daemon.toml"
    f.write_text("store = 5\n")
    with pytest.raises(ConfigError, match="'store' must be a table"):
        read_config_file(f)


def test_validation_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"staging\.region_bytes must be a non-negative int"):
        merge({"staging.region_bytes": -1}, {}, {})
    with pytest.raises(ConfigError, match=r"server\.max_inflight must be at least 1"):
        merge({}, {}, {"TIERKV_MAX_INFLIGHT": "0"})
    with pytest.raises(ConfigError, match=r"metrics\.port must be in \[0, 65535\]"):
        merge({"metrics.port": 70000}, {}, {})
