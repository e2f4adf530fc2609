"""The node's incarnation, kept in ``STATE_DIR/incarnation`` across restarts: a
restarted node comes back with a higher one, which the mesh takes over its old death
notice, and one raised by a refutation is saved at once.

The file is ours but the disk is not: a value that is not a number in the range the
wire format allows (``core.mesh.messages.MAX_INCARNATION``) is ignored as if the
file were missing, and a
write that fails (a full disk) is logged, not raised. Either way the node starts:
should the mesh know it by a higher incarnation than it starts with, its own signed
announcement of that incarnation comes back to it and it refutes above it
(core.mesh.membership).
"""

from __future__ import annotations

import os
from pathlib import Path

from ciuic_p2p.core.mesh.messages import MAX_INCARNATION
from ciuic_p2p.logsetup import get_logger

log = get_logger("ciuic.mesh")


def read_incarnation(state_dir: Path) -> int | None:
    """The saved incarnation, or None when there is none usable."""
    path = state_dir / "incarnation"
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text.isdigit() or len(text) > 20 or int(text) > MAX_INCARNATION:
        log.warning("incarnation_file_ignored", path=str(path), value=text[:40])
        return None
    return int(text)


def next_incarnation(state_dir: Path) -> int:
    """Read, bump and save the incarnation (atomically: write, then rename)."""
    current = read_incarnation(state_dir)
    value = 0 if current is None else min(current + 1, MAX_INCARNATION)
    save_incarnation(state_dir, value)
    return value


def save_incarnation(state_dir: Path, value: int) -> bool:
    """Save ``value``; False (logged) when the disk refuses."""
    path = state_dir / "incarnation"
    tmp = path.with_suffix(".tmp")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(f"{value}\n")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning(
            "incarnation_not_saved", path=str(path), error=exc.strerror or str(exc), value=value
        )
        return False
    return True
