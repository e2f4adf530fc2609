"""Data shipped with the package: measured WAN matrices (wan/, with their provenance
in wan/README.md), emulator scenarios built from them (scenarios/), and a public-domain
text corpus for the language-model task (text/, provenance in text/README.md).
Nothing is downloaded at run time."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).parent
WAN_DIR = DATA_DIR / "wan"
SCENARIO_DIR = DATA_DIR / "scenarios"
TEXT_DIR = DATA_DIR / "text"
SHAKESPEARE = TEXT_DIR / "shakespeare_plays.txt"


def scenario_path(name: str) -> Path:
    """A shipped scenario by name (``cities11``, ``multicloud8``, ``harsh``,
    ``partition``), or any path given as is."""
    shipped = SCENARIO_DIR / f"{name}.toml"
    return shipped if shipped.exists() else Path(name)


def shipped_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def shakespeare_text() -> str:
    """Twelve plays (1.57 MB, ASCII), as shipped; see text/README.md."""
    return SHAKESPEARE.read_text(encoding="ascii")
