"""The UDP socket's kernel buffers.

Linux gives a UDP socket about 208 KiB of receive buffer, some 90 full datagrams with
the kernel's per-datagram bookkeeping. A node receiving from several peers while its
event loop is busy overflows that, and QUIC reads each overflow as congestion: a
node fetching 80 MB from three donors on the emulated WAN lost about 500 datagrams
in 20 s that way. QUIC stacks ask for several MiB (quic-go asks 7 MiB).
"""

from __future__ import annotations

import contextlib
import socket
import sys
from typing import Any

from ciuic_p2p.logsetup import get_logger

log = get_logger("ciuic.transport")


def size_buffers(sock: Any, wanted: int) -> tuple[int, int]:
    """Ask for ``wanted`` bytes of receive and send buffer; what the kernel granted
    (Linux reports twice the usable size, its bookkeeping included)."""
    granted = []
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            if sock.getsockopt(socket.SOL_SOCKET, option) < wanted:
                sock.setsockopt(socket.SOL_SOCKET, option, wanted)
        granted.append(sock.getsockopt(socket.SOL_SOCKET, option))
    usable = [g // 2 for g in granted] if sys.platform == "linux" else granted
    if min(usable) < wanted:
        log.warning(
            "udp_buffers_small",
            wanted=wanted,
            receive=usable[0],
            send=usable[1],
            hint="raise net.core.rmem_max and net.core.wmem_max",
        )
    return granted[0], granted[1]
