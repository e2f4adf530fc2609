from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ciuic_p2p.config import Config, config_from_toml, load_config, load_layered
from ciuic_p2p.errors import ConfigError


def test_presets_differ_where_documented() -> None:
    assert Config.wan().preset == "wan" and Config.lan().preset == "lan"
    assert Config.wan().codec.chunk_payload_bytes < Config.lan().codec.chunk_payload_bytes
    assert Config.lan().codec.density > Config.wan().codec.density
    local = config_from_toml('preset = "local"')
    assert local == Config.local() and local.preset == "local"
    assert local.web.port == 0 and Config.wan().web.port == 7947  # two daemons, one host
    assert local.mesh.probe_timeout_max_s > Config.lan().mesh.probe_timeout_max_s


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().codec.density = 0.5  # type: ignore[misc]


def test_toml_overrides_keys_of_the_named_preset(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        'preset = "lan"\n[node]\nname = "tokyo-1"\nlisten_port = 9000\n'
        '[codec]\ndensity = 0.001\nblock_size = 128\n[log]\nformat = "json"\n'
    )
    cfg = load_config(path)
    assert cfg.preset == "lan" and cfg.node.name == "tokyo-1" and cfg.node.listen_port == 9000
    assert cfg.codec.density == 0.001 and cfg.codec.block_size == 128
    assert cfg.codec.chunk_payload_bytes == Config.lan().codec.chunk_payload_bytes
    assert cfg.log.format == "json"


def test_integer_is_accepted_where_a_float_is_expected() -> None:
    assert config_from_toml("[codec]\ndensity = 1\n").codec.density == 1.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[codec]\ndensty = 0.1\n", "codec.densty: unknown key"),
        ("[nodes]\nname = 'a'\n", "nodes: unknown key"),
        ("[codec]\ndensity = 'high'\n", "codec.density: must be a number"),
        ("[codec]\ndensity = 2.0\n", "codec.density: must be in (0, 1]"),
        ("[codec]\nvalue_mode = 'int3'\n", "codec.value_mode: must be one of"),
        ("[node]\nlisten_port = 70000\n", "node.listen_port"),
        ("[node]\nlisten_port = true\n", "node.listen_port: must be an integer"),
        ("preset = 'moon'\n", "preset: must be one of"),
        ("[codec\n", "not valid TOML"),
        ("codec = 3\n", "codec: must be a table"),
        ("[mesh]\nheads_idle_interval_s = 0.1\n", "mesh.heads_idle_interval_s: must be >= heads"),
        ("[mesh]\npace_gain = 0.9\n", "mesh.pace_gain: must be 0 or 1 to 4"),
        ("[mesh]\npace_gain = 5\n", "mesh.pace_gain: must be 0 or 1 to 4"),
    ],
)
def test_bad_config_names_the_key_and_why(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_toml(text, source="x.toml")
    assert message in str(info.value) and str(info.value).startswith("x.toml")


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")


def test_mesh_presets_and_bad_mesh_values() -> None:
    lan, wan = Config.lan().mesh, Config.wan().mesh
    assert lan.probe_interval_s < wan.probe_interval_s
    assert lan.probe_timeout_initial_s < wan.probe_timeout_initial_s
    cfg = config_from_toml('preset = "lan"\n[mesh]\ndissemination = "gossip"\n')
    assert cfg.mesh.dissemination == "gossip" and cfg.mesh.probe_interval_s == lan.probe_interval_s
    with pytest.raises(ConfigError, match=r"mesh\.probe_interval_s"):
        config_from_toml("[mesh]\nprobe_interval_s = 0\n")
    with pytest.raises(ConfigError, match=r"mesh\.dissemination"):
        config_from_toml('[mesh]\ndissemination = "flood"\n')
    # Pacing is for the WAN: one data centre's links are not queue-bound.
    assert wan.pace_gain > 1 and lan.pace_gain == 0 and Config.local().mesh.pace_gain == 0
    assert config_from_toml("[mesh]\npace_gain = 0\n").mesh.pace_gain == 0


def test_environment_overrides_the_file_and_names_a_bad_variable(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text('[node]\nname = "from-file"\nregion = "r"\n[codec]\ndensity = 0.02\n')
    cfg = load_layered(
        f,
        {
            "CIUIC_NODE_NAME": "from-env",
            "CIUIC_CODEC_DENSITY": "0.001",
            "CIUIC_NODE_JOIN": '["10.0.0.1:7946"]',
            "CIUIC_CONFIG": "/ignored/here",
            "HOME": "/root",
        },
    )
    assert cfg.node.name == "from-env" and cfg.node.region == "r"
    assert cfg.codec.density == 0.001 and cfg.node.join == ("10.0.0.1:7946",)
    with pytest.raises(ConfigError, match="CIUIC_NOPE_X: unknown section"):
        load_layered(f, {"CIUIC_NOPE_X": "1"})
    with pytest.raises(ConfigError, match=r"environment: codec.density: must be a number"):
        load_layered(f, {"CIUIC_CODEC_DENSITY": "lots"})
    with pytest.raises(ConfigError, match=r"node.join: 'nohost' is not HOST:PORT"):
        load_layered(None, {"CIUIC_NODE_JOIN": '["nohost"]'})
