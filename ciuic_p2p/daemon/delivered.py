"""What the daemon had delivered of each origin when it stopped, kept in
``STATE_DIR/delivered.json`` for its next start (core.mesh.broadcast ``resume``): the
chunks sent while it was down (a ``systemctl restart``, an upgrade) are then repaired
from the members that keep them, and reach the trainer that waited through the gap.

Written when the daemon leaves the mesh, taken (read and removed) when it starts: a
daemon that crashed left none, and one started twice does not resume twice. The file
is ours but the disk is not: anything but the shape below, within the bounds the
mesh holds, is ignored as if there were no file.

A file older than ``mesh.own_chunk_retain_s`` is not used: nobody holds what came
since (the next life would ask for thousands of chunks in vain).

Shape: ``{"version": 1, "saved_at": unix s, "origins": {peer: [contiguous, [above,
...]], ...}}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ciuic_p2p.core.mesh.broadcast import MAX_ABOVE, MAX_ORIGINS, Resumed
from ciuic_p2p.logsetup import get_logger

FILE = "delivered.json"
VERSION = 1
MAX_PEER_ID = 128
MAX_SEQ = (1 << 63) - 1
MAX_FILE_BYTES = 64 * 1024 * 1024
"""A file past this is not read (MAX_ORIGINS origins of MAX_ABOVE numbers would be far
more; a real one is a few kB)."""
log = get_logger("ciuic.mesh")


def save_delivered(state_dir: Path, origins: dict[str, Resumed], now_s: float) -> bool:
    """Write it (atomically: write, then rename) as of wall-clock ``now_s``; False
    (logged) when the disk refuses."""
    path = state_dir / FILE
    tmp = path.with_suffix(".tmp")
    body = {
        "version": VERSION,
        "saved_at": now_s,
        "origins": {o: [c, list(a)] for o, (c, a) in origins.items()},
    }
    try:
        tmp.write_text(json.dumps(body, separators=(",", ":")))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("delivered_not_saved", path=str(path), error=exc.strerror or str(exc))
        return False
    return True


def take_delivered(state_dir: Path, now_s: float, max_age_s: float) -> dict[str, Resumed]:
    """Read and remove it; empty when there is none usable (logged when unusable) or
    it was saved more than ``max_age_s`` before wall-clock ``now_s``."""
    path = state_dir / FILE
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"over {MAX_FILE_BYTES} bytes")
        raw = json.loads(path.read_bytes())
        origins = _parse(raw)
        saved_at = raw.get("saved_at")
        if not isinstance(saved_at, (int, float)) or not 0 <= now_s - saved_at <= max_age_s:
            log.info("delivered_file_too_old", path=str(path), max_age_s=max_age_s)
            origins = {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        log.warning("delivered_file_ignored", path=str(path), error=str(exc)[:200])
        origins = {}
    try:
        path.unlink()
    except OSError as exc:
        log.warning("delivered_file_kept", path=str(path), error=exc.strerror or str(exc))
    return origins


def _parse(raw: Any) -> dict[str, Resumed]:
    if not isinstance(raw, dict) or raw.get("version") != VERSION:
        raise ValueError("not a version 1 delivered file")
    entries = raw.get("origins")
    if not isinstance(entries, dict) or len(entries) > MAX_ORIGINS:
        raise ValueError(f"origins must be a map of at most {MAX_ORIGINS}")
    out: dict[str, Resumed] = {}
    for origin, entry in entries.items():
        if not isinstance(origin, str) or not 0 < len(origin) <= MAX_PEER_ID:
            raise ValueError("an origin is not a peer ID")
        if not isinstance(entry, list) or len(entry) != 2:
            raise ValueError(f"{origin[:40]}: not [contiguous, [above...]]")
        contiguous, above = entry
        if not _seq(contiguous) or not isinstance(above, list) or len(above) > MAX_ABOVE:
            raise ValueError(f"{origin[:40]}: numbers out of range")
        if not all(_seq(q) and q > contiguous for q in above):
            raise ValueError(f"{origin[:40]}: numbers above out of range")
        out[origin] = (contiguous, tuple(above))
    return out


def _seq(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEQ
