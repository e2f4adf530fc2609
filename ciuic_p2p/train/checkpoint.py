"""Local checkpoints: a replica's state (core.store.statefile) written atomically.

File layout::

    b"CIUCKPT1" | step u64 LE | state length u64 LE | compat (32) | state
    | BLAKE2b-256 of everything before it

A checkpoint is written to a temporary file in the same directory, flushed and
fsync'ed, then renamed over the previous one (kept as ``.prev`` if it is whole), and
the directory is fsync'ed: a reader sees the old file or the new one, never half of
one. Files are created 0600 in a directory made 0700: a model's parameters are the
run's, not every local user's. A file cut short anyway (a disk that lied about its
cache, a copy interrupted) fails its length or digest check and is never loaded; the
loader then takes the previous one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ciuic_p2p.errors import CiuicError
from ciuic_p2p.logsetup import get_logger

DAEMON_NAMED: Literal["daemon"] = "daemon"
"""Checkpoint where the daemon says when the trainer attaches (WELCOME's
``checkpoint_dir``), else in :func:`fallback_dir`."""
CheckpointChoice = Path | None | Literal["daemon"]
MAX_NAMED_PATH = 4096
MAGIC = b"CIUCKPT1"
_HEAD = struct.Struct("<8sQQ32s")
DIGEST_LEN = 32
log = get_logger("ciuic.checkpoint")


class CheckpointError(CiuicError):
    """A checkpoint file that is incomplete, corrupted or not one."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    step: int
    compat: bytes
    state: bytes


def write_checkpoint(path: Path, step: int, state: bytes | bytearray, compat: bytes) -> str:
    """Write atomically (see the module docstring); the file's BLAKE2b digest (hex)."""
    if not path.parent.is_dir():
        path.parent.mkdir(mode=0o700, parents=True)
        os.chmod(path.parent, 0o700)  # mkdir's mode passes through the umask
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    head = _HEAD.pack(MAGIC, step, len(state), compat)
    digest = hashlib.blake2b(head, digest_size=DIGEST_LEN)
    digest.update(state)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.write(state)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        if path.exists():
            try:  # the previous one becomes .prev only if it is whole
                read_checkpoint(path)
                os.replace(path, path.with_name(path.name + ".prev"))
            except CheckpointError as exc:
                log.warning("checkpoint_replacing_invalid", reason=str(exc))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest()


def read_checkpoint(path: Path) -> Checkpoint:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc.strerror or exc}") from None
    if len(raw) < _HEAD.size + DIGEST_LEN:
        raise CheckpointError(f"{path}: cut short ({len(raw)} bytes)")
    magic, step, length, compat = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a ciuic checkpoint")
    if len(raw) != _HEAD.size + length + DIGEST_LEN:
        raise CheckpointError(f"{path}: cut short or padded ({len(raw)} bytes)")
    body = memoryview(raw)[: _HEAD.size + length]
    if hashlib.blake2b(body, digest_size=DIGEST_LEN).digest() != raw[-DIGEST_LEN:]:
        raise CheckpointError(f"{path}: digest mismatch (corrupted)")
    return Checkpoint(path, int(step), bytes(compat), raw[_HEAD.size : _HEAD.size + length])


def load_newest(path: Path) -> Checkpoint | None:
    """The newest valid checkpoint among ``path`` and its ``.prev``; None if neither
    is (each refusal is logged)."""
    best: Checkpoint | None = None
    for candidate in (path, path.with_name(path.name + ".prev")):
        if not candidate.exists():
            continue
        try:
            ckpt = read_checkpoint(candidate)
        except CheckpointError as exc:
            log.warning("checkpoint_refused", reason=str(exc))
            continue
        if best is None or ckpt.step > best.step:
            best = ckpt
    return best


def checkpoint_choice(given: str | Path | None, configured: str) -> CheckpointChoice:
    """Where attach checkpoints: ``given`` (attach's argument; ``""``: nowhere), else
    ``store.checkpoint_dir`` (``""``: where the daemon names; ``off``: nowhere)."""
    if given is not None:
        return Path(given).expanduser() if str(given) else None
    if configured == "off":
        return None
    return Path(configured).expanduser() if configured else DAEMON_NAMED


def fallback_dir(env: Mapping[str, str]) -> Path:
    """Checkpoints of a trainer that cannot write where its daemon says:
    ``$XDG_STATE_HOME/ciuic-p2p/checkpoints`` (``~/.local/state`` by default)."""
    state_home = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state_home) / "ciuic-p2p" / "checkpoints"


def daemon_named_dir(named: object, env: Mapping[str, str]) -> tuple[Path | None, str]:
    """The checkpoint directory for a trainer whose daemon named ``named`` (WELCOME's
    ``checkpoint_dir``: an absolute path, or None when it could make none), and why:
    that one when this process can write there, else :func:`fallback_dir`, else none
    (no checkpoints: a trainer with no writable home still trains)."""
    why = "named by the daemon"
    if not isinstance(named, str) or not named or len(named) > MAX_NAMED_PATH:
        why = "the daemon named no checkpoint directory"
    elif not Path(named).is_absolute():
        why = f"the daemon named a relative path ({named!r})"
    elif not Path(named).is_dir() or not os.access(named, os.W_OK | os.X_OK):
        why = f"this trainer cannot write to {named}"
    else:
        return Path(named), why
    fallback = fallback_dir(env)
    try:
        fallback.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"{why}, nor make {fallback} ({exc.strerror or exc}): no checkpoints"
    if not os.access(fallback, os.W_OK | os.X_OK):
        return None, f"{why}, nor write to {fallback}: no checkpoints"
    return fallback, why
