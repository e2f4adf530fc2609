"""Which member addresses this node may dial, and how often: a member signs its own
address, and could sign a third party's, so that dialling it would make this node send
datagrams anywhere.

An address counts as *proven* once an authenticated link to its member has existed
there (it dialled us from it: one socket per node; or we reached it). A dial to an
unproven address that fails is not repeated for ``5 s x 2^failures`` (at most 10
minutes), so that a lying address costs a few datagrams an hour, not a flood. The
transport's gate asks the same book which sources it knows (transport.gate exempts
them from its caps). Both tables are bounded (the oldest entries go first)."""

from __future__ import annotations

from ciuic_p2p.addresses import format_address
from ciuic_p2p.transport.base import Address

UNPROVEN_BACKOFF_S = (5.0, 600.0)
"""First and largest pause after a failed dial to an address never proven."""
MAX_ADDRESSES = 8192
"""Proven addresses and backoffs remembered (the oldest forgotten first)."""


class AddressBook:
    def __init__(self) -> None:
        self._proven: dict[str, None] = {}
        """Addresses where an authenticated link to their member existed (ordered)."""
        self._backoff: dict[str, tuple[int, float]] = {}
        """Unproven address -> (failed dials, not before)."""

    def proven(self, address: str) -> bool:
        return address in self._proven

    def known_source(self, addr: Address) -> bool:
        """The gate's question (transport.gate): a source where a member was before."""
        return format_address(*addr) in self._proven

    def prove(self, address: str) -> None:
        """An authenticated link to its member exists at ``address``."""
        self._proven[address] = None
        self._backoff.pop(address, None)
        while len(self._proven) > MAX_ADDRESSES:
            del self._proven[next(iter(self._proven))]

    def may_dial(self, address: str, now: float) -> bool:
        """False while an unproven address is held back after failed dials."""
        if address in self._proven:
            return True
        _, not_before = self._backoff.get(address, (0, 0.0))
        return now >= not_before

    def dial_failed(self, address: str, now: float) -> None:
        if address in self._proven:
            return
        failures, _ = self._backoff.get(address, (0, 0.0))
        first, most = UNPROVEN_BACKOFF_S
        self._backoff[address] = (failures + 1, now + min(most, first * 2**failures))
        while len(self._backoff) > MAX_ADDRESSES:
            del self._backoff[next(iter(self._backoff))]
