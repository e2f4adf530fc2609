"""The node's configuration: one frozen dataclass with documented defaults.

``Config`` groups its settings in sections (``node``, ``codec``, ``transport``,
``mesh``, ``train``, ``store``, ``log``, ``web``, ``audit``); each section is itself
frozen. Two presets
exist: :meth:`Config.lan` for nodes in one data centre and :meth:`Config.wan` (the
default) for nodes continents apart. A TOML file may name a preset and then override single keys::

    preset = "wan"

    [node]
    name = "tokyo-1"
    region = "aws:ap-northeast-1"

    [codec]
    density = 0.001

Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming
the key and the reason. The loader is a pure function of the TOML text.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from ciuic_p2p.config.rules import validate
from ciuic_p2p.config.sections import (
    AuditSection,
    CodecSection,
    CongestionControl,
    DenseDtype,
    Dissemination,
    FinishAverage,
    LogFormat,
    LogLevel,
    LogSection,
    MeshSection,
    NodeSection,
    OuterOptimizer,
    Selection,
    StoreSection,
    TrainMode,
    TrainSection,
    TransportSection,
    ValueMode,
    WebSection,
)
from ciuic_p2p.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "SECTIONS",
    "AuditSection",
    "CodecSection",
    "Config",
    "CongestionControl",
    "DenseDtype",
    "Dissemination",
    "FinishAverage",
    "LogFormat",
    "LogLevel",
    "LogSection",
    "MeshSection",
    "NodeSection",
    "OuterOptimizer",
    "Selection",
    "StoreSection",
    "TrainMode",
    "TrainSection",
    "TransportSection",
    "ValueMode",
    "WebSection",
    "config_from_mapping",
    "config_from_toml",
    "environment_overrides",
    "load_config",
    "load_layered",
    "merge_mappings",
    "runtime_dir",
    "trainer_socket_path",
]


@dataclass(frozen=True, slots=True)
class Config:
    """Everything a node can be configured with. Build with :meth:`wan`, :meth:`lan`,
    :meth:`local` or :func:`load_config`; change with :func:`dataclasses.replace`."""

    preset: Literal["lan", "wan", "local"] = "wan"
    """Which preset the values started from (informational once built)."""
    node: NodeSection = field(default_factory=NodeSection)
    codec: CodecSection = field(default_factory=CodecSection)
    transport: TransportSection = field(default_factory=TransportSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    train: TrainSection = field(default_factory=TrainSection)
    store: StoreSection = field(default_factory=StoreSection)
    log: LogSection = field(default_factory=LogSection)
    web: WebSection = field(default_factory=WebSection)
    audit: AuditSection = field(default_factory=AuditSection)

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def wan(cls) -> Config:
        """Nodes continents apart: 256 KiB chunks, so that a relay can forward the first
        chunk of a step while the next is still arriving (pipelining over a tree)."""
        return cls(preset="wan", codec=CodecSection(chunk_payload_bytes=256 * 1024))

    @classmethod
    def lan(cls) -> Config:
        """Nodes in one data centre: bandwidth is plentiful, so send 5% of entries and
        use whole 1 MiB chunks."""
        return cls(
            preset="lan",
            codec=CodecSection(density=0.05),
            mesh=MeshSection(
                probe_interval_s=0.2,
                probe_timeout_min_s=0.005,
                probe_timeout_max_s=0.5,
                probe_timeout_initial_s=0.2,
                probe_margin_s=0.002,
                sync_interval_s=30.0,
                reconnect_interval_s=1.0,
                heads_interval_s=0.1,
                repair_after_s=0.05,
                relay_penalty_s=0.0005,
                default_rate_bps=10e9,
                tree_chunk_bytes=1 << 20,
                pace_gain=0.0,
            ),
        )

    @classmethod
    def local(cls) -> Config:
        """Several nodes on one machine (a tutorial, tests, a laptop): the LAN timings
        with room for processes that share a few cores (a probe may wait 1 s before
        suspicion), and each daemon's page on a free port, printed at start, so that
        two daemons of one host never collide."""
        lan = cls.lan()
        return dataclasses.replace(
            lan,
            preset="local",
            mesh=dataclasses.replace(lan.mesh, probe_interval_s=0.5, probe_timeout_max_s=1.0),
            web=WebSection(port=0),
        )


_PRESETS = {"lan": Config.lan, "wan": Config.wan, "local": Config.local}

SECTIONS = tuple(f.name for f in dataclasses.fields(Config) if f.name != "preset")
ENV_PREFIX = "CIUIC_"


def environment_overrides(environ: typing.Mapping[str, str]) -> dict[str, Any]:
    """``CIUIC_<SECTION>_<KEY>=value`` variables as a TOML-shaped mapping (``CIUIC_PRESET``
    for the preset). A value is read as a TOML value when it parses as one (numbers,
    booleans, lists), else as a string: ``CIUIC_NODE_NAME=tokyo-1``,
    ``CIUIC_CODEC_DENSITY=0.001``, ``CIUIC_NODE_JOIN='["10.0.0.1:7946"]'``."""
    out: dict[str, Any] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name in _ENV_NOT_CONFIG:
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        if rest == "preset":
            out["preset"] = raw
            continue
        section = next((s for s in SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            raise ConfigError(
                f"environment {name}: unknown section (CIUIC_<SECTION>_<KEY>, sections: "
                f"{', '.join(SECTIONS)})"
            )
        key = rest[len(section) + 1 :]
        try:
            value: Any = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out.setdefault(section, {})[key] = value
    return out


_ENV_NOT_CONFIG = frozenset({"CIUIC_CONFIG"})
"""Variables that name where the config is rather than a setting."""


def merge_mappings(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over``'s keys replace ``base``'s, section by section."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = out[key] | value
        else:
            out[key] = value
    return out


def load_layered(
    path: str | Path | None, environ: typing.Mapping[str, str] | None = None
) -> Config:
    """The file (if any), then ``CIUIC_*`` environment variables over it; command-line
    flags go over the result (daemon.run). Errors name the file or the variable."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{p}: not UTF-8 text") from exc
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
        source = str(p)
    env = environment_overrides(environ if environ is not None else {})
    if env:
        source = f"{source} + environment"
    return config_from_mapping(merge_mappings(data, env), source=source)


def trainer_socket_path(config: Config) -> Path:
    """``train.socket_path``, or ``trainer.sock`` in the runtime directory when unset; the
    daemon serves it and the hook dials it."""
    return Path(config.train.socket_path or runtime_dir(config) / "trainer.sock").expanduser()


def runtime_dir(config: Config) -> Path:
    """Where the sockets live: ``node.runtime_dir``, else ``node.state_dir``."""
    return Path(config.node.runtime_dir or config.node.state_dir).expanduser()


def load_config(path: str | Path) -> Config:
    """Read a TOML file into a :class:`Config` (see the module docstring); no
    environment variables (``load_layered`` adds them)."""
    return load_layered(path, {})


def config_from_toml(text: str, source: str = "<string>") -> Config:
    """Parse TOML text into a :class:`Config`, starting from the preset it names."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    return config_from_mapping(data, source=source)


def config_from_mapping(data: dict[str, Any], source: str = "<mapping>") -> Config:
    """Build a :class:`Config` from nested dicts as TOML yields them."""
    preset = data.get("preset", "wan")
    if preset not in _PRESETS:
        raise ConfigError(f"{source}: preset: must be one of {sorted(_PRESETS)}, got {preset!r}")
    base = _PRESETS[preset]()
    changes: dict[str, Any] = {}
    hints = typing.get_type_hints(Config)
    for key, value in data.items():
        if key == "preset":
            continue
        if key not in hints or not dataclasses.is_dataclass(hints[key]):
            raise ConfigError(
                f"{source}: {key}: unknown key (top-level keys: preset, and the sections "
                f"{', '.join(SECTIONS)})"
            )
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: must be a table")
        changes[key] = _replace_section(getattr(base, key), value, f"{source}: {key}")
    try:
        return dataclasses.replace(base, **changes)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def _replace_section(section: Any, values: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(type(section))
    updates: dict[str, Any] = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{where}.{key}: unknown key")
        updates[key] = _coerce(value, hints[key], f"{where}.{key}")
    return dataclasses.replace(section, **updates)


def _coerce(value: Any, typ: Any, where: str) -> Any:
    origin = get_origin(typ)
    if origin is Literal:
        allowed = get_args(typ)
        if value not in allowed:
            raise ConfigError(f"{where}: must be one of {list(allowed)}, got {value!r}")
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: must be true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: must be an integer, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: must be finite, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: must be a string, got {value!r}")
        return value
    if origin is tuple and get_args(typ) == (str, ...):
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: must be a list of strings, got {value!r}")
        return tuple(value)
    raise ConfigError(f"{where}: unsupported type {typ!r}")  # pragma: no cover
