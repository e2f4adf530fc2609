"""The RTT map: the round-trip time between every pair of live nodes.

- A node's own links are measured by its membership probes (core.mesh.membership).
- Every node publishes its measured links as link state (``Links`` updates with a
  version, newest wins), gossiped like membership updates, so every node learns every
  other node's measurements. A link's RTT is republished only when it moves by more
  than ``link_change_ratio`` and ``link_change_min_s``: measurement noise neither
  floods the mesh nor reshapes the trees built from the map.
- Where no one has measured a pair yet, Vivaldi coordinates (core.mesh.vivaldi) estimate it.
- Each entry also carries the rate the peer's bytes reach the publisher, measured by
  the link from the bulk frames it carries (core.link.throughput, fed in with
  ``observe_rate``), republished when it moves by more than ``link_rate_change_ratio``;
  the trees count serialization at the published rates (core.mesh.routing).

Every node computes routes from the *published* values, its own included, so nodes
that hold the same link state compute the same trees. The RTT of a pair is the mean
of what its two ends published where they agree; a member's word alone is not taken
(issue 44: a member publishing its links at 1% of the truth became a relay in every
honest tree, and dropped what it was sent): where one end's claim is shorter than
``CLAIM_AGREE`` of the other end's, the longer is taken (a link is never shorter than
either end measured it; a member can make its own links look longer, never shorter),
and a link only one end published is taken no shorter than ``TRIANGLE_SLACK`` of its
triangle bound (the second greatest ``|RTT(y, m) - RTT(y, x)|`` over the witnesses y
whose links both their ends published, the shorter end's taken: no one member decides
it). Every check reads the published state only, so every node takes the same values.
Claims not taken are counted per member (:meth:`RttMap.refused_claims`).

Link state is signed by the node it describes (core.mesh.messages; checked by
core.mesh.membership before it gets here): the map keeps each node's newest ``Links`` as
signed, to pass on unchanged in syncs, and signs its own with ``sign``.

A node takes at most one version of a member's links per ``link_publish_min_s``, the
most often an honest node publishes: every version taken changes the map every route
and tree is computed from, so a member republishing at will would make every node
replan for every chunk it forwards, and would keep the mesh's digests apart and its
syncs busy. A version that comes sooner is held (the newest replaces an older one held)
and taken when its time comes: the map ends with the newest version, as every other
node's does, a little later.

Of two versions with the same number, the one whose signature is greater wins, and the
digest covers the signatures: a member that signs two different link states under one
number, and sends one to each node, would otherwise leave the nodes with different
maps, and different trees, for as long as it published no newer version.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Mapping

from ciuic_p2p.config.sections import MeshSection
from ciuic_p2p.core.mesh.messages import MAX_LINKS, MAX_RATE_KBPS, Coordinate, LinkEntry, Links
from ciuic_p2p.core.mesh.vivaldi import VivaldiClient, distance_s

Measured = dict[str, tuple[float, float, float]]
"""peer -> (rtt_s, loss, rate_bps): the rate the peer's bytes reach the publisher
(core.link.throughput), 0 where not measured."""
MAX_VERSION = (1 << 32) - 1
"""A link-state version is a u32 on the wire (core.mesh.messages)."""
RECENT_SAMPLES = 16
"""A link's published RTT is the least of its last 16 samples: the path's propagation
delay, which routes should follow, without the queueing and scheduling noise that a
busy node adds to single samples (a smoothed mean moved with every burst of load and
made the trees of different nodes disagree while the news spread)."""
CLAIM_AGREE = 0.8
"""Two ends' RTTs of one link agree when the shorter is at least this fraction of the
longer (both are the least of their samples of one path; each is republished only on
a move of ``link_change_ratio``); where they do not, the longer is taken: a member
claiming its links at 1% of the truth was made a relay in every tree (issue 44)."""
DISTRUSTED_RTT_S = 5.0
"""The RTT a node publishes for its link to a relay that failed it (dropped the copies
it owed, core.mesh.broadcast), while it does not count on it: the pair's RTT is the
longer of its ends' (``CLAIM_AGREE``), so every node's trees stop making that member
this node's relay, and a member that drops what it is sent ends as a relay of no one.
It is the cost of a copy through that member, as this node sees it: longer than any
path on earth, short enough for a tree that has no other way."""
TRIANGLE_SLACK = 0.5
"""A link published by one end only is taken no shorter than this fraction of its
triangle bound: the bound is loose both ways on real matrices (1.6 times the truth for
Frankfurt-Paris on the 11-city matrix, 4.4 times on the multi-cloud one, through
triangle-inequality violations), so only a claim far below it is refused."""


class RttMap:
    def __init__(
        self,
        node: str,
        settings: MeshSection,
        seed: int = 0,
        sign: Callable[[Links], Links] = lambda links: links,
    ) -> None:
        self.node = node
        self.settings = settings
        self.sign = sign
        self.signed: dict[str, Links] = {}
        """Each node's newest link state as its node signed it."""
        self.vivaldi = VivaldiClient(seed)
        self.coords: dict[str, Coordinate] = {}
        self.recent: dict[str, deque[float]] = {}
        self.loss: dict[str, float] = {}
        self.rates: dict[str, float] = {}
        """The receive rate measured from each peer (its link's bulk frames), bits/s."""
        self.published: dict[str, Measured] = {}
        self.taken_at: dict[str, float] = {}
        """When each origin's version in ``published`` was taken."""
        self.held: dict[str, Links] = {}
        """Each origin's newest version that came before its time (module docstring)."""
        self.links_held = 0
        """Versions held on arrival (a member publishing faster than any honest node)."""
        self._version = 0
        self._last_publish = float("-inf")
        self._republish = False
        """Our own links came back at a version we have not reached (a previous life's,
        before a restart): publish above it at the next chance."""
        self.distrusted: Mapping[str, float] = {}
        """Peers whose relaying failed this node (core.mesh.broadcast), until when: the
        links from them are published at ``DISTRUSTED_RTT_S`` at least."""
        self.changes = 0
        self._pairs: dict[tuple[str, str], tuple[float | None, str | None]] = {}
        """Each pair's checked RTT (:meth:`measured_s`) for the map of ``changes``."""
        self._pairs_at = 0
        self._digest: int | None = None
        """Bumped whenever the published view changes (routes recompute on it)."""

    # -- inputs -------------------------------------------------------------------------

    def observe(self, peer: str, coordinate: Coordinate, rtt_s: float) -> None:
        self.vivaldi.update(peer, coordinate, rtt_s)
        self.coords[peer] = coordinate
        self.recent.setdefault(peer, deque(maxlen=RECENT_SAMPLES)).append(rtt_s)

    def observe_loss(self, peer: str, probes: int, acks: int) -> None:
        if probes >= 5:
            self.loss[peer] = max(0.0, 1.0 - acks / probes)

    def observe_rate(self, peer: str, rate_bps: float) -> None:
        """The rate ``peer``'s bytes reach this node, measured by the link."""
        if 0 < rate_bps <= MAX_RATE_KBPS * 1e3:
            self.rates[peer] = rate_bps

    def apply_links(self, links: Links, now: float) -> bool:
        """Take a node's published links, or hold them until ``link_publish_min_s``
        after its last version was taken; False if not newer than what we hold."""
        origin = links.origin
        if origin == self.node:
            # Our previous life's (the version starts at 0 again after a restart, and
            # the others keep the newest): continue above it, or every node would keep
            # the old links, and sync with us for nothing, until our count caught up.
            if self._version < links.version < MAX_VERSION:
                self._version = links.version
                self._republish = True
            return False
        newest = self.held.get(origin) or self.signed.get(origin)
        if newest is not None and (links.version, links.signature) <= (
            newest.version,
            newest.signature,
        ):
            return False
        if now < self._due_at(origin):
            self.held[origin] = links
            self.links_held += 1
            return True
        self.held.pop(origin, None)
        self._take(links, now)
        return True

    def release(self, now: float) -> None:
        """Take every held version whose time has come."""
        if not self.held:
            return
        for origin in [o for o in self.held if self._due_at(o) <= now]:
            self._take(self.held.pop(origin), now)

    def get_timer(self) -> float | None:
        """When the next held version may be taken (None: none held)."""
        return min(map(self._due_at, self.held)) if self.held else None

    def _due_at(self, origin: str) -> float:
        # One expression for the timer and the test against it: a timer that fires
        # at a time the test rounds the other way would fire again at once, for ever.
        return self.taken_at.get(origin, float("-inf")) + self.settings.link_publish_min_s

    def _take(self, links: Links, now: float) -> None:
        self.taken_at[links.origin] = now
        self.signed[links.origin] = links
        self.published[links.origin] = {
            e.peer: (e.rtt_us / 1e6, e.loss_permille / 1000, e.rate_kbps * 1e3)
            for e in links.entries
        }
        self.changes += 1
        self._digest = None

    def forget(self, node: str) -> None:
        self.recent.pop(node, None)
        self.rates.pop(node, None)
        self.coords.pop(node, None)
        self.vivaldi.forget(node)
        # Its version goes with its links: a restarted node counts from 0 again, and a
        # version kept here with no links to pass back (which would make it publish
        # above) refused its new links for as long as its count took to catch up.
        # taken_at stays (one float per member ever signed): a member that leaves and
        # comes back is not let past the interval by its departure.
        if self.signed.pop(node, None) is not None:
            self._digest = None
        self.held.pop(node, None)
        if self.published.pop(node, None) is not None:
            self.changes += 1
            self._digest = None
        mine = self.published.get(self.node)
        if mine is not None and node in mine:
            del mine[node]
            self.changes += 1
            self._digest = None

    # -- publishing ---------------------------------------------------------------------

    def publish(self, now: float) -> Links | None:
        """Our links as a new version, when they changed enough or are due a refresh."""
        s = self.settings
        if now - self._last_publish < s.link_publish_min_s:
            return None
        mine = self.published.get(self.node, {})
        current: Measured = {}
        changed = False
        for peer, samples in self.recent.items():
            if not samples:
                continue
            rtt, loss = min(samples), self.loss.get(peer, 0.0)
            if self.distrusted.get(peer, now) > now:
                rtt = max(rtt, DISTRUSTED_RTT_S)
            rate = self.rates.get(peer, 0.0)
            old = mine.get(peer)
            if old is None or (
                abs(rtt - old[0]) > max(s.link_change_min_s, s.link_change_ratio * old[0])
            ):
                changed = True
                current[peer] = _quantized(rtt, loss, rate)
            elif rate and abs(rate - old[2]) > s.link_rate_change_ratio * old[2]:
                changed = True  # the RTT as published (it did not move), the new rate
                current[peer] = _quantized(old[0], old[1], rate)
            else:
                current[peer] = old
        if len(current) > s.link_state_max_peers:
            nearest = sorted(current, key=lambda p: (current[p][0], p))[: s.link_state_max_peers]
            current = {p: current[p] for p in nearest}
        changed = changed or set(current) != set(mine)
        if not changed and not self._republish and now - self._last_publish < s.link_refresh_s:
            return None
        if self._version >= MAX_VERSION:
            # No newer version fits the wire's u32 (4e9 publishes): the last one stands.
            return None
        self._republish = False
        self._last_publish = now
        self._version += 1
        self.published[self.node] = current
        self.changes += 1
        self._digest = None
        own = self.sign(self._links_of(self.node, current, self._version))
        self.signed[self.node] = own
        return own

    @staticmethod
    def _links_of(origin: str, measured: Measured, version: int) -> Links:
        entries = tuple(
            LinkEntry(p, round(r * 1e6), round(loss * 1000), round(rate / 1e3))
            for p, (r, loss, rate) in sorted(measured.items())[:MAX_LINKS]
        )
        return Links(origin, version, entries)

    @property
    def versions(self) -> dict[str, int]:
        """Each other node's version taken."""
        return {o: u.version for o, u in self.signed.items() if o != self.node}

    def all_links(self) -> list[Links]:
        """Every node's latest link state as signed (for a full sync)."""
        return [self.signed[origin] for origin in sorted(self.signed)]

    def digest(self) -> int:
        """A 32-bit BLAKE2b of every origin's link-state version and its signature's
        first bytes (never 0: 0 means "none"). Not a CRC: a CRC is linear, so a member
        whose ID sorts last could search its own signatures once for a link state whose
        digest equals another's, whatever the rest of the map, and keep two nodes that
        hold different versions of it from ever syncing them."""
        if self._digest is None:
            text = ";".join(
                f"{o}={u.version}:{u.signature[:8].hex()}" for o, u in sorted(self.signed.items())
            )
            hashed = hashlib.blake2b(text.encode(), digest_size=4).digest()
            self._digest = int.from_bytes(hashed, "big") or 1
        return self._digest

    # -- queries -------------------------------------------------------------------------

    def measured_s(self, a: str, b: str) -> float | None:
        """The pair's RTT as its ends published it, checked (module docstring): the
        mean of the two where they agree, the larger where one end's claim is shorter
        than ``CLAIM_AGREE`` of the other's; one end's alone no shorter than
        ``TRIANGLE_SLACK`` of the triangle bound. None: neither end published it."""
        return self._pair(a, b)[0]

    def refused_claims(self, origin: str) -> int:
        """How many of ``origin``'s published links are not taken at its word now (a
        shorter RTT than the other end measured, or than the triangle bound)."""
        if origin == self.node:
            return 0
        return sum(
            1 for peer in self.published.get(origin, {}) if self._pair(origin, peer)[1] == origin
        )

    def _pair(self, a: str, b: str) -> tuple[float | None, str | None]:
        """The pair's checked RTT, and the end whose claim was not taken (None: none)."""
        if self._pairs_at != self.changes:
            self._pairs.clear()
            self._pairs_at = self.changes
        key = (a, b) if a <= b else (b, a)
        found = self._pairs.get(key)
        if found is None:
            found = self._pairs[key] = self._check_pair(*key)
        return found

    def _check_pair(self, a: str, b: str) -> tuple[float | None, str | None]:
        ab = self.published.get(a, {}).get(b)
        ba = self.published.get(b, {}).get(a)
        if ab is not None and ba is not None:
            low, high = sorted((ab[0], ba[0]))
            if low < CLAIM_AGREE * high:
                return high, a if ab[0] == low else b
            return (low + high) / 2, None
        if ab is not None:
            claimant, other, claim = a, b, ab[0]
        elif ba is not None:
            claimant, other, claim = b, a, ba[0]
        else:
            return None, None
        bound = TRIANGLE_SLACK * self._triangle_bound_s(claimant, other)
        return (bound, claimant) if claim < bound else (claim, None)

    def _triangle_bound_s(self, m: str, x: str) -> float:
        """The second greatest ``|RTT(y, m) - RTT(y, x)|`` over the witnesses y whose
        links to both were published by both their ends (the shorter of the two
        taken): a lower bound of RTT(m, x) by the triangle inequality that no one
        member's word, m's included, decides (0 with fewer than two witnesses)."""
        bounds: list[float] = []
        for y, links in self.published.items():
            if y in (m, x):
                continue
            ym, yx = links.get(m), links.get(x)
            my = self.published.get(m, {}).get(y)
            xy = self.published.get(x, {}).get(y)
            if ym is None or yx is None or my is None or xy is None:
                continue
            bounds.append(abs(min(ym[0], my[0]) - min(yx[0], xy[0])))
        if len(bounds) < 2:
            return 0.0
        bounds.sort(reverse=True)
        return bounds[1]

    def rtt_both_s(self, a: str, b: str) -> float | None:
        """The pair's RTT as both ends published it, the larger of the two; None unless
        both did (clusters go by it: one end's word, or a short claim, is not enough)."""
        ab = self.published.get(a, {}).get(b)
        ba = self.published.get(b, {}).get(a)
        return None if ab is None or ba is None else max(ab[0], ba[0])

    def rate_bps(self, a: str, b: str) -> float | None:
        """The published rate from ``a`` to ``b``: what ``b`` measured receiving from
        ``a``, and only that. Not the other direction: a sender's word about its own
        uplink would let a member claim fast links and be made a relay in every tree
        (the routing also clamps what it uses to ``default_rate_bps``)."""
        v = self.published.get(b, {}).get(a)
        return v[2] if v is not None and v[2] > 0 else None

    def loss_of(self, a: str, b: str) -> float | None:
        values = [
            v[1] for v in (self.published.get(a, {}).get(b), self.published.get(b, {}).get(a)) if v
        ]
        return max(values) if values else None

    def estimate_s(self, a: str, b: str) -> float | None:
        ca = self.vivaldi.coordinate if a == self.node else self.coords.get(a)
        cb = self.vivaldi.coordinate if b == self.node else self.coords.get(b)
        if ca is None or cb is None:
            return None
        return distance_s(ca, cb)

    def rtt_s(self, a: str, b: str) -> float | None:
        """Measured where anyone measured the pair, else the Vivaldi estimate."""
        measured = self.measured_s(a, b)
        return measured if measured is not None else self.estimate_s(a, b)

    def source(self, a: str, b: str) -> str:
        if self.measured_s(a, b) is not None:
            return "measured"
        return "vivaldi" if self.estimate_s(a, b) is not None else "unknown"


def _quantized(rtt_s: float, loss: float, rate_bps: float) -> tuple[float, float, float]:
    """A link's values as the wire carries them (microseconds, permille, kbit/s): the
    publisher's own trees must come from the same numbers as everyone else's."""
    rtt_us = min(0xFFFFFFFF, max(0, round(rtt_s * 1e6)))
    permille = min(1000, max(0, round(loss * 1000)))
    kbps = min(MAX_RATE_KBPS, max(0, round(rate_bps / 1e3)))
    return rtt_us / 1e6, permille / 1000, kbps * 1e3
