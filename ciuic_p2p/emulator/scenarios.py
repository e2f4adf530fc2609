"""Scenario files: what the pure model (emulator.model.scenario) is read from. A
``.toml`` or ``.json`` scenario, or a bare ``.csv`` RTT matrix; a scenario's matrix
files are named relative to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ciuic_p2p.emulator.model.scenario import Scenario, parse_scenario
from ciuic_p2p.errors import ConfigError


def load_scenario(path: str | Path, **overrides: Any) -> Scenario:
    """A scenario from ``.toml``, ``.json`` or a bare ``.csv`` RTT matrix."""
    p = Path(path)

    def read(name: str) -> str:
        try:
            return (p.parent / name).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{p.parent / name}: cannot read: {exc.strerror}") from exc

    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read scenario: {exc.strerror}") from exc
    try:
        return parse_scenario(text, p.suffix.lstrip(".") or "toml", read, **overrides)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from exc
