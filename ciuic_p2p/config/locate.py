"""Where a running daemon is, found the same way by each of its clients (the CLI's
control commands, the training hook's ``attach``): an explicit path first; else the
config file (``--config`` or ``$CIUIC_CONFIG``, else the service's
``/etc/ciuic/node.toml`` when it exists) with the ``CIUIC_*`` variables over it; else,
with no file named, the service's runtime directory (``/run/ciuic``) and the default
state directory. A client that finds nothing says every place it looked and how to
name the daemon it means."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ciuic_p2p.config.sections import NodeSection

SERVICE_CONFIG = Path("/etc/ciuic/node.toml")
"""The config file of the systemd service (systemd/ciuic-node.service)."""
SERVICE_RUNTIME_DIR = Path("/run/ciuic")
"""The service's RuntimeDirectory: its sockets."""
DEFAULT_STATE_DIR = Path(NodeSection().state_dir)
"""Where a node keeps its state (and its sockets) when nothing says otherwise."""


def node_config_file(named: str | Path | None, environ: Mapping[str, str]) -> Path | None:
    """The config file a client reads: ``named``, else ``$CIUIC_CONFIG``, else the
    service's when it exists; None when there is none (defaults and variables)."""
    chosen = named or environ.get("CIUIC_CONFIG")
    if chosen:
        return Path(chosen).expanduser()
    return SERVICE_CONFIG if _exists(SERVICE_CONFIG) else None


def socket_candidates(socket_dir: Path, name: str, file_named: bool) -> list[Path]:
    """Where the socket ``name`` may be, most likely first: in ``socket_dir`` (the
    config's runtime directory), then, unless a config file was named (it says where
    its daemon is), in the service's runtime directory and the default state
    directory. No duplicates."""
    found = [socket_dir / name]
    if not file_named:
        found += [SERVICE_RUNTIME_DIR / name, DEFAULT_STATE_DIR / name]
    return list(dict.fromkeys(found))


def first_present(candidates: list[Path]) -> Path | None:
    return next((c for c in candidates if _exists(c)), None)


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; False also where a directory on the way may not be
    searched (the service's 0750 directories, to a user outside its group), which
    ``Path.exists`` raises for on Python 3.11."""
    return os.path.exists(path)


def not_found_hint(candidates: list[Path], what: str, how: str) -> str:
    """One line: where a client looked for ``what`` and how to point it elsewhere."""
    places = ", ".join(str(c) for c in candidates)
    return f"no {what} found (looked at {places}); {how}"
