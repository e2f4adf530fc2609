"""A link's datagrams in few system calls: UDP generic segmentation offload (GSO).

QUIC hands the transport its datagrams one by one, and one ``sendto`` each cost 11-16%
of a daemon's CPU while it moved bulk data (py-spy, issue 21). Linux (4.18 and later)
takes a run of equal-sized datagrams to one address in one ``sendmsg`` with a
``UDP_SEGMENT`` control message and cuts them apart itself (in the NIC where it
can); the receiver sees the same datagrams. :func:`batches` groups a transmit's
datagrams into such runs (pure); :class:`SegmentedSender` sends them on the node's own
socket, and falls back to the event loop's ``sendto`` for a lone datagram, when the
socket would block, when the loop still holds queued datagrams (order is kept), and
for good after the kernel refuses GSO once.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ciuic_p2p.logsetup import get_logger

log = get_logger("ciuic.transport")

UDP_SEGMENT = 103
"""``UDP_SEGMENT`` of linux/udp.h (not in Python's socket module)."""
MAX_SEGMENTS = 64
"""The kernel's ``UDP_MAX_SEGMENTS``: more in one send is refused."""
MAX_BATCH_BYTES = 65_000
"""Below the 65,507-byte payload limit of one IPv4 UDP send (IPv6: 65,487)."""
GSO_REFUSED = frozenset({errno.EIO, errno.EINVAL, errno.ENOPROTOOPT, errno.EOPNOTSUPP, 524})
"""Errors that say the kernel or the device cannot segment (524: ENOTSUPP); any other
error concerns one destination or one moment, and GSO stays on."""


@dataclass(frozen=True, slots=True)
class Batch:
    """Datagrams sent as one: ``segment`` bytes each, the last one possibly shorter.
    They go to the kernel as an iovec each, so grouping copies nothing."""

    datagrams: tuple[bytes, ...]

    @property
    def segment(self) -> int:
        return len(self.datagrams[0])


def batches(datagrams: Sequence[bytes]) -> list[Batch]:
    """Consecutive datagrams grouped into GSO sends, in order. A run holds datagrams
    of one size; a shorter one ends it (the kernel allows only the last segment to
    be short); a longer one starts the next."""
    out: list[Batch] = []
    run: list[bytes] = []
    total = 0

    def close() -> None:
        nonlocal total
        if run:
            out.append(Batch(tuple(run)))
            run.clear()
            total = 0

    for data in datagrams:
        if run and (
            len(data) > len(run[0])
            or len(run) == MAX_SEGMENTS
            or total + len(data) > MAX_BATCH_BYTES
        ):
            close()
        run.append(data)
        total += len(data)
        if len(data) < len(run[0]):
            close()
    close()
    return out


def gso_supported() -> bool:
    """Whether this platform may offer UDP GSO at all (the kernel still decides)."""
    return sys.platform == "linux" and hasattr(socket, "SOL_UDP")


class SegmentedSender:
    """Sends datagrams on a UDP socket with GSO, through ``fallback`` otherwise.

    ``fileno`` is the event loop's socket; this keeps its own duplicate of the
    descriptor (the loop's transport does not expose ``sendmsg``), non-blocking, and
    ``queued`` says how many bytes the loop still holds to send (0: none)."""

    def __init__(
        self,
        fileno: int,
        fallback: Callable[[bytes, Any], None],
        queued: Callable[[], int],
    ) -> None:
        # Given a descriptor, socket() reads its family and type from the kernel.
        duplicate = os.dup(fileno)
        try:
            self._sock: socket.socket | None = socket.socket(fileno=duplicate)
        except OSError:
            os.close(duplicate)
            raise
        self._sock.setblocking(False)
        self._fallback = fallback
        self._queued = queued
        self.sends = 0
        """System calls that carried more than one datagram."""
        self.datagrams = 0
        """Datagrams those calls carried."""

    @property
    def active(self) -> bool:
        return self._sock is not None

    def send(self, datagrams: Sequence[bytes], addr: Any) -> None:
        """Every datagram to ``addr``, in order."""
        pending = batches(datagrams)
        for i, batch in enumerate(pending):
            if len(batch.datagrams) == 1 or self._sock is None or self._queued() > 0:
                self._one_by_one(batch, addr)
                continue
            try:
                self._sock.sendmsg(
                    batch.datagrams,
                    [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", batch.segment))],
                    0,
                    addr,
                )
            except BlockingIOError:
                # The socket is full: the loop queues the rest and sends it in order.
                for rest in pending[i:]:
                    self._one_by_one(rest, addr)
                return
            except OSError as exc:
                if exc.errno in GSO_REFUSED:
                    log.info("udp_gso_off", reason=str(exc))
                    self.close()
                self._one_by_one(batch, addr)
                continue
            self.sends += 1
            self.datagrams += len(batch.datagrams)

    def _one_by_one(self, batch: Batch, addr: Any) -> None:
        for data in batch.datagrams:
            self._fallback(data, addr)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
