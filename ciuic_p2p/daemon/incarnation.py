"""The node's incarnation, kept in ``STATE_DIR/incarnation`` across restarts: a
restarted node comes back with a higher one, which the mesh takes over its old death
notice, and one raised by a refutation is saved at once."""

from __future__ import annotations

import os
from pathlib import Path


def next_incarnation(state_dir: Path) -> int:
    """Read, bump and save the incarnation (atomically: write, then rename)."""
    path = state_dir / "incarnation"
    try:
        current = int(path.read_text().strip())
    except (OSError, ValueError):
        current = -1
    save_incarnation(state_dir, current + 1)
    return current + 1


def save_incarnation(state_dir: Path, value: int) -> None:
    path = state_dir / "incarnation"
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{value}\n")
    os.replace(tmp, path)
