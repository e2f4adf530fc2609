"""The event loop a node runs on."""

from __future__ import annotations

import asyncio
from typing import cast


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop where available (it is on Linux), else asyncio's default loop."""
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        return asyncio.new_event_loop()
    return cast(asyncio.AbstractEventLoop, uvloop.new_event_loop())
