"""What tests that start processes ask of them."""

from __future__ import annotations


def running(pid: int) -> bool:
    """Whether a process runs (a zombie waiting for its new parent has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
