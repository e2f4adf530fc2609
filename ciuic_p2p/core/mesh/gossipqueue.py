"""The queue of updates waiting to be piggybacked (memberlist's TransmitLimitedQueue).

Each update is sent ``retransmit_mult * ceil(log10(N + 1))`` times, the least-sent
first, so that it reaches every member with high probability while the per-message
overhead stays bounded. A newer update about the same subject (a member, or a node's
link state) replaces the older one, which then stops spreading.
"""

from __future__ import annotations

import math

from ciuic_p2p.core.mesh.messages import (
    Alive,
    Credential,
    Dead,
    Left,
    Links,
    Suspect,
    Update,
    update_size,
)


def subject_of(update: Update) -> str:
    if isinstance(update, Links):
        return "links:" + update.origin
    if isinstance(update, Credential):
        return "credential:" + update.node
    assert isinstance(update, Alive | Suspect | Dead | Left)
    return "member:" + update.node


class GossipQueue:
    def __init__(self, retransmit_mult: int) -> None:
        self.retransmit_mult = retransmit_mult
        self._items: dict[str, tuple[Update, int, int]] = {}  # subject -> (update, sent, size)
        self._urgent = 0

    def __len__(self) -> int:
        return len(self._items)

    def limit(self, members: int) -> int:
        return self.retransmit_mult * max(1, math.ceil(math.log10(members + 1)))

    def put(self, update: Update) -> None:
        key = subject_of(update)
        if key not in self._items and not isinstance(update, Links):
            self._urgent += 1
        self._items[key] = (update, 0, update_size(update))

    def urgent(self) -> bool:
        """Membership news waiting (link state alone only rides on probes and acks:
        it is never worth a message of its own)."""
        return self._urgent > 0

    def pending(self, subject: str) -> bool:
        return subject in self._items

    def take(self, budget_bytes: int, members: int) -> list[Update]:
        """Updates that fit in ``budget_bytes``, least-sent first; each take counts
        as one transmission."""
        if not self._items:
            return []
        limit = self.limit(members)
        out: list[Update] = []
        used = 0
        for key, (update, sent, size) in sorted(self._items.items(), key=lambda kv: kv[1][1]):
            if used + size > budget_bytes:
                continue
            used += size
            out.append(update)
            if sent + 1 >= limit:
                del self._items[key]
                if not isinstance(update, Links):
                    self._urgent -= 1
            else:
                self._items[key] = (update, sent + 1, size)
        return out
