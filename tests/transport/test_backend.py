"""What a node may choose as its QUIC library, and what it refuses."""

from __future__ import annotations

import importlib.metadata

import pytest

from ciuic_p2p.config import config_from_toml
from ciuic_p2p.errors import ConfigError
from ciuic_p2p.transport import backend


def test_both_backends_are_offered_and_installed() -> None:
    assert set(backend.OFFERED) == {"aioquic", "qh3"}
    assert [backend.unsupported_reason(name) for name in backend.OFFERED] == [None, None]


@pytest.mark.parametrize(
    ("found", "refused"),
    [("1.9.4", False), ("1.12.0", False), ("1.10rc1", False), ("2.1.0", True), ("1.8.1", True)],
)
def test_qh3_is_taken_only_in_its_tested_line(
    monkeypatch: pytest.MonkeyPatch, found: str, refused: bool
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: found)
    reason = backend.unsupported_reason("qh3")
    assert (reason is not None) == refused
    if refused:
        assert reason is not None and found in reason and "1.9 <= qh3 < 2" in reason
        with pytest.raises(ValueError, match=r"qh3 2\.x cannot accept aioquic peers"):
            backend.QuicBackend("qh3")


def test_reno_needs_aioquic() -> None:
    with pytest.raises(ConfigError, match="qh3 always runs CUBIC"):
        config_from_toml('[transport]\ncongestion_control = "reno"\n')
    cfg = config_from_toml('[transport]\ncongestion_control = "reno"\nquic_backend = "aioquic"\n')
    assert cfg.transport.congestion_control == "reno"


def test_qh3_without_package_metadata_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert "no version to check" in str(backend.unsupported_reason("qh3"))
