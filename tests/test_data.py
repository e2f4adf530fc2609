"""Shipped data: present in the package with its provenance, and intact."""

from __future__ import annotations

from ciuic_p2p.data import TEXT_DIR, WAN_DIR, shakespeare_text


def test_the_text_corpus_ships_with_its_provenance() -> None:
    text = shakespeare_text()
    assert len(text) > 1_500_000
    assert "HAMLET" in text.upper() and "MACBETH" in text.upper()
    assert text.isascii()
    note = (TEXT_DIR / "README.md").read_text()
    assert "Project Gutenberg" in note and "Keep this note" in note


def test_wan_matrices_ship_with_their_provenance() -> None:
    assert "provenance" in (WAN_DIR / "README.md").read_text()
    assert len(list(WAN_DIR.glob("*.csv"))) == 3
