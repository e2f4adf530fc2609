"""Getting one object of the shared store from the nearest holders. Pure: no clock,
no I/O (``now`` comes in, messages to send come out; the daemon's adapter is
daemon.store).

:class:`Fetch` asks every member which version it holds, picks donors by RTT and load
(score ``rtt * (1 + load)``) among those with a version no more than ``version_slack``
behind the newest, keeps ``window_pieces`` requests in flight per donor
(``max_inflight_bytes`` over all of them), and stripes over up to ``max_donors`` donors
whose content is compatible (one QUIC connection over a long path carries far less
than the link: several donors multiply it). A piece whose digest is wrong is fetched
again; a donor that goes quiet, dies or is busy is replaced and its pieces reassigned,
verified pieces kept. Content is compatible when the ``compat`` digests match: for an
exact object that is its content digest (every holder has the same bytes); for a
training replica's state it is the state's layout, since replicas hold nearly the
same values (within the consensus bound) and a state assembled from several of them
is, element by element, one replica's or another's; each piece is checked against the
digest in its own donor's manifest.

A fetch may ask for ``spans`` (byte ranges) of an object instead of all of it: it
gets only the pieces that cover them, each verified as usual, and its result is the
spans' bytes, end to end. A joiner compares such samples of other replicas' states
with the state it took (train.statesync). ``one_writer`` keeps a fetch to the copies of
one writer's content (no striping over replicas' compatible states), so that a sample
or a state can be vouched for as that writer's.

Bounds against a member that lies (each is counted): an offer whose manifest is larger
than ``store.max_object_bytes`` is not taken, and a fetch holds only the pieces that
arrived and verified, never a buffer of the size a manifest claims. An offer whose
manifest fails ``verify`` (its writer's signature), names a writer not asked for, a
version above ``max_version`` or another root than the one asked for is no donor
(``stats.refused``): a member can offer only its own objects as its own.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ciuic_p2p.config.sections import StoreSection
from ciuic_p2p.core.store.messages import (
    ANY_ROOT,
    ANY_VERSION,
    Get,
    Manifest,
    Message,
    NoneHeld,
    Offer,
    Piece,
    Query,
)

MAX_SPANS = 4096
"""Spans one fetch may ask for: a sharded rank's rows of every tensor of a state
(train.shardfetch), or a joiner's samples of another replica's (train.statesync).
Their bytes together are at most ``store.max_object_bytes``; only the pieces that
cover them travel."""


class FetchState(enum.Enum):
    QUERYING = "querying"
    FETCHING = "fetching"
    DONE = "done"
    FAILED = "failed"


@dataclass(slots=True)
class FetchStats:
    pieces_by_donor: collections.Counter[str] = field(default_factory=collections.Counter)
    corrupt: int = 0
    stray: int = 0
    donor_timeouts: int = 0
    donors_lost: int = 0
    busy: int = 0
    gone: int = 0
    """Donors that no longer held the version they offered."""
    queries: int = 0
    oversize: int = 0
    """Offers whose manifest claims more than ``store.max_object_bytes``."""
    refused: int = 0
    """Offers not taken: a bad signature, another writer, version or root than asked."""
    restarts: int = 0
    """Times verified pieces were thrown away (no holder of a compatible state left)."""
    started_s: float = 0.0
    first_donor_s: float | None = None
    """When the first piece request went out (after the query round: for a replica's
    state, the donors' fresh snapshots)."""


class Fetch:
    """Get one object (see the module docstring). Drive it with the ``on_*`` methods
    and :meth:`handle_timer`; send what :meth:`take_messages` returns."""

    def __init__(
        self,
        name: str,
        min_version: int,
        peers: Iterable[str],
        now: float,
        *,
        settings: StoreSection,
        rtt_s: Callable[[str], float | None],
        token: int = 1,
        version_slack: int = 0,
        patient: bool = True,
        writers: frozenset[str] | None = None,
        max_version: int = ANY_VERSION,
        root: bytes = ANY_ROOT,
        verify: Callable[[Manifest], bool] | None = None,
        spans: tuple[tuple[int, int], ...] = (),
        one_writer: bool = False,
    ) -> None:
        """``writers``: only versions written by these peers (None: any; one writer is
        also asked for in the query); ``max_version``: none above; ``root``: exactly
        this object; ``verify``: a manifest's signature check (None: none, core
        tests); ``spans``: (offset, bytes) ranges, at most ``MAX_SPANS``, to fetch
        instead of the whole object; ``one_writer``: no striping over several
        writers' compatible contents."""
        if (
            len(spans) > MAX_SPANS
            or any(not (at >= 0 and n > 0) for at, n in spans)
            or sum(n for _, n in spans) > settings.max_object_bytes
        ):
            raise ValueError(
                f"at most {MAX_SPANS} spans of at least a byte, "
                f"{settings.max_object_bytes} bytes in all"
            )
        self.spans = spans
        self.one_writer = one_writer
        self.name = name
        self.writers = writers
        self.max_version = max_version
        self.root = root
        self.verify = verify
        self.min_version = min_version
        self.settings = settings
        self.rtt_s = rtt_s
        self.version_slack = version_slack
        self.patient = patient
        """Wait (until the deadline) for a holder to appear; else fail once every
        member has answered that it holds none."""
        self.peers = list(dict.fromkeys(peers))
        self.state = FetchState.QUERYING
        self.error = ""
        self.stats = FetchStats(started_s=now)
        self.deadline = now + settings.fetch_timeout_s
        self.offers: dict[str, Offer] = {}
        self.version = -1
        self.manifest: Manifest | None = None
        """The manifest of the first donor chosen (the group's shape)."""
        self.result: bytes | None = None
        self._token = token
        self._answered: set[str] = set()
        self._query_until = 0.0
        self._requery_at: float | None = None
        self._group: tuple[bytes, int, int, str] | None = None
        self._pieces: list[bool] = []
        self._wanted_pieces = 0
        """Pieces this fetch needs: all of them, or those that cover ``spans``."""
        self._received: dict[int, memoryview | bytes] = {}
        """Verified pieces by index: memory grows with what arrived, whatever size a
        manifest claims."""
        self._todo: collections.deque[int] = collections.deque()
        self._active: dict[str, dict[int, float]] = {}
        self._heard: dict[str, float] = {}
        self._strikes: collections.Counter[str] = collections.Counter()
        self._failed: set[str] = set()
        self._busy_until: dict[str, float] = {}
        self._out: list[tuple[str, Message]] = []
        self._query(now)

    # -- inputs ---------------------------------------------------------------------------

    def on_offer(self, peer: str, offer: Offer, now: float) -> None:
        if offer.token != self._token or offer.manifest.name != self.name:
            self.stats.stray += 1
            return
        if offer.manifest.total_bytes > self.settings.max_object_bytes:
            self.stats.oversize += 1  # an answer, but no donor: nothing is allocated
            self.on_none(peer, NoneHeld(self.name, offer.token), now)
            return
        if not self._wanted(offer.manifest):
            self.stats.refused += 1
            self.on_none(peer, NoneHeld(self.name, offer.token), now)
            return
        self.offers[peer] = offer
        self._answered.add(peer)
        self._maybe_choose(now)
        # A donor that answered after the query round (it was taking a fresh snapshot)
        # joins the stripe now, not at the next timer.
        self._activate(now)

    def _wanted(self, m: Manifest) -> bool:
        return (
            (self.writers is None or m.writer in self.writers)
            and m.version <= self.max_version
            and self.root in (ANY_ROOT, m.root)
            and (self.verify is None or self.verify(m))
        )

    @property
    def writer(self) -> str:
        """Whose version this is: the writer of the first donor's manifest."""
        return "" if self.manifest is None else self.manifest.writer

    @property
    def writers_used(self) -> dict[str, str]:
        """The writer of each donor's version (a replica's state may be striped over
        several replicas' compatible states)."""
        return {
            p: self.offers[p].manifest.writer
            for p in self.stats.pieces_by_donor
            if p in self.offers
        }

    def on_none(self, peer: str, msg: NoneHeld, now: float) -> None:
        if msg.token == self._token:
            self._answered.add(peer)
            self._maybe_choose(now)

    def on_busy(self, peer: str, now: float) -> None:
        if peer in self._active:
            self.stats.busy += 1
            self._drop(peer)
            self._busy_until[peer] = now + self.settings.retry_s
            self._activate(now)

    def on_gone(self, peer: str, now: float) -> None:
        """The donor no longer holds what it offered (a newer snapshot replaced it):
        forget its offer; the next query round asks again."""
        self.offers.pop(peer, None)
        if peer in self._active:
            self.stats.gone += 1
            self._drop(peer)
            self._activate(now)

    def on_piece(self, peer: str, piece: Piece, now: float) -> None:
        sent = self._active.get(peer)
        offer = self.offers.get(peer)
        if (
            sent is None
            or offer is None
            or piece.index not in sent
            or piece.version != offer.manifest.version
            or piece.root != offer.manifest.root
        ):
            self.stats.stray += 1
            return
        del sent[piece.index]
        self._heard[peer] = now
        manifest = offer.manifest
        if not manifest.check_piece(piece.index, piece.data):
            self.stats.corrupt += 1
            self._strikes[peer] += 1
            self._todo.appendleft(piece.index)
            if self._strikes[peer] >= self.settings.max_corrupt_per_donor:
                self._fail_donor(peer)
            self._activate(now)
            return
        if not self._pieces[piece.index]:
            self._received[piece.index] = piece.data
            self._pieces[piece.index] = True
        self.stats.pieces_by_donor[peer] += 1
        if len(self._received) == self._wanted_pieces:
            self.state = FetchState.DONE
            if self.spans:
                self.result = b"".join(_cut(self._received, manifest.piece_bytes, self.spans))
            else:
                self.result = b"".join(self._received[i] for i in range(len(self._pieces)))
            self._received = {}
            self._active.clear()
            return
        self._fill(now)

    def peer_gone(self, peer: str, now: float) -> None:
        """The mesh declared ``peer`` dead or left."""
        if peer in self.peers:
            self.peers.remove(peer)
        self.offers.pop(peer, None)
        if peer in self._active:
            self.stats.donors_lost += 1
            self._drop(peer)
            self._activate(now)
        else:
            self._maybe_choose(now)

    def handle_timer(self, now: float) -> None:
        if self.done:
            return
        if now >= self.deadline:
            self._fail(f"no complete copy of {self.name!r} within the fetch timeout")
            return
        if self.state is FetchState.QUERYING:
            if self._requery_at is not None and now >= self._requery_at:
                self._query(now)
            elif self._requery_at is None and now >= self._query_until:
                self._choose(now)
            return
        for peer in [p for p, t in self._busy_until.items() if t <= now]:
            del self._busy_until[peer]
        for peer, sent in list(self._active.items()):
            if sent and now - self._heard.get(peer, now) >= self.settings.piece_timeout_s:
                self.stats.donor_timeouts += 1
                self._fail_donor(peer)
        self._activate(now)  # replaces lost donors, hands their pieces to the others

    def get_timer(self) -> float | None:
        if self.done:
            return None
        times = [self.deadline]
        if self.state is FetchState.QUERYING:
            times.append(self._requery_at if self._requery_at is not None else self._query_until)
        else:
            times += [
                self._heard.get(p, self.deadline) + self.settings.piece_timeout_s
                for p, sent in self._active.items()
                if sent
            ]
            times += self._busy_until.values()
        return min(times)

    def take_messages(self) -> list[tuple[str, Message]]:
        out, self._out = self._out, []
        return out

    @property
    def done(self) -> bool:
        return self.state in (FetchState.DONE, FetchState.FAILED)

    @property
    def donors(self) -> list[str]:
        return list(self._active)

    @property
    def received_pieces(self) -> int:
        return len(self._received) if self.result is None else self._wanted_pieces

    # -- choosing donors -----------------------------------------------------------------

    def _query(self, now: float) -> None:
        self._token += 1
        self._answered = set()
        # A donor that went quiet may be back; one that sent bad pieces stays out.
        limit = self.settings.max_corrupt_per_donor
        self._failed = {p for p in self._failed if self._strikes[p] >= limit}
        self._requery_at = None
        self.offers = {}
        self.state = FetchState.QUERYING
        self.stats.queries += 1
        self._query_until = now + self.settings.query_timeout_s
        one = next(iter(self.writers)) if self.writers and len(self.writers) == 1 else ""
        query = Query(self.name, self.min_version, self._token, one, self.max_version, self.root)
        self._out += [(p, query) for p in self.peers]
        if not self.peers:
            self._requery_at = now + self.settings.retry_s

    def _maybe_choose(self, now: float) -> None:
        if (
            self.state is FetchState.QUERYING
            and self._requery_at is None
            and all(p in self._answered for p in self.peers)
        ):
            self._choose(now)

    def _score(self, peer: str) -> float:
        rtt = self.rtt_s(peer)
        rtt = self.settings.unknown_rtt_s if rtt is None else rtt
        return rtt * (1 + self.offers[peer].load)

    def _candidates(self, now: float) -> list[str]:
        """Usable donors, best first: up to date, compatible with what is held."""
        usable = {
            p: o
            for p, o in self.offers.items()
            if o.manifest.version >= self.min_version
            and p not in self._failed
            and self._busy_until.get(p, 0.0) <= now
        }
        if not usable:
            return []
        newest = max(o.manifest.version for o in usable.values())
        fresh = [p for p, o in usable.items() if o.manifest.version >= newest - self.version_slack]
        if self._group is not None:
            fresh = [
                p for p in fresh if _group(self.offers[p].manifest, self.one_writer) == self._group
            ]
        return sorted(fresh, key=lambda p: (self._score(p), p))

    def _choose(self, now: float) -> None:
        """The query round ended: start (or resume) fetching."""
        best = self._candidates(now)
        if (
            not best
            and self._group is not None
            and self.offers
            and not any(self._busy_until.get(p, 0.0) > now for p in self.offers)
        ):  # nobody holds a compatible state any more: start over
            self.stats.restarts += 1
            self._group = None
            best = self._candidates(now)
        if not best:
            if not self.patient:  # the query round is over and nobody offered
                self._fail(f"no member holds {self.name!r} at version {self.min_version} or later")
                return
            self._requery_at = now + self.settings.retry_s
            return
        if self._group is None:
            manifest = self.offers[best[0]].manifest
            self._group = _group(manifest, self.one_writer)
            self.manifest = manifest
            self.version = manifest.version
            self._pieces = [False] * manifest.pieces
            self._received = {}
            wanted: list[int] | range = range(manifest.pieces)
            if self.spans:
                if any(at + n > manifest.total_bytes for at, n in self.spans):
                    self._fail(f"{self.name!r} is shorter than the spans asked for")
                    return
                wanted = sorted(_covering(manifest.piece_bytes, self.spans))
            self._wanted_pieces = len(wanted)
            self._todo = collections.deque(wanted)
            if self._wanted_pieces == 0:
                self.state = FetchState.DONE
                self.result = b""
                return
        self.state = FetchState.FETCHING
        if self.stats.first_donor_s is None:
            self.stats.first_donor_s = now
        self._activate(now)

    def _activate(self, now: float) -> None:
        """Bring the donor set up to strength: the best candidate, plus the next best
        holders of compatible content (striping), up to ``max_donors``."""
        if self.done or self.state is not FetchState.FETCHING:
            return
        if not self._active:
            best = self._candidates(now)
            if not best:
                if any(t > now for t in self._busy_until.values()):
                    return  # the timer retries when a busy donor's wait ends
                self._query(now)  # every known donor failed: ask again
                return
            self._start_donor(best[0], now)
        for peer in self._candidates(now):  # all of one compat group: see the docstring
            if len(self._active) >= self.settings.max_donors:
                break
            if peer not in self._active:
                self._start_donor(peer, now)
        self._fill(now)

    def _start_donor(self, peer: str, now: float) -> None:
        self._active[peer] = {}
        self._heard[peer] = now

    def _fill(self, now: float) -> None:
        s = self.settings
        piece = max(1, self.manifest.piece_bytes if self.manifest else s.piece_bytes)
        share = -(-max(1, s.max_inflight_bytes // piece) // max(1, len(self._active)))
        window = max(1, min(s.window_pieces, share))
        for peer, sent in self._active.items():
            room = window - len(sent)
            if room <= 0 or not self._todo:
                continue
            take = [self._todo.popleft() for _ in range(min(room, len(self._todo)))]
            if not sent:
                self._heard[peer] = now
            for i in take:
                sent[i] = now
            m = self.offers[peer].manifest
            self._out.append((peer, Get(self.name, m.version, m.root, tuple(take))))

    def _drop(self, peer: str) -> None:
        sent = self._active.pop(peer, {})
        self._todo.extendleft(sorted(sent, reverse=True))

    def _fail_donor(self, peer: str) -> None:
        self._failed.add(peer)
        self._drop(peer)

    def _fail(self, why: str) -> None:
        self.state = FetchState.FAILED
        self.error = why
        self._active.clear()


def _group(m: Manifest, one_writer: bool) -> tuple[bytes, int, int, str]:
    """Which contents may be striped together: compatible ones, of one writer only
    when ``one_writer``."""
    return (m.compat, m.total_bytes, m.piece_bytes, m.writer if one_writer else "")


def _covering(piece_bytes: int, spans: tuple[tuple[int, int], ...]) -> set[int]:
    return {i for at, n in spans for i in range(at // piece_bytes, (at + n - 1) // piece_bytes + 1)}


def _cut(
    pieces: dict[int, memoryview | bytes], piece_bytes: int, spans: tuple[tuple[int, int], ...]
) -> list[bytes]:
    """Each span's bytes, from the pieces that cover it."""
    out = []
    for at, n in spans:
        first, last = at // piece_bytes, (at + n - 1) // piece_bytes
        joined = b"".join(pieces[i] for i in range(first, last + 1))
        start = at - first * piece_bytes
        out.append(joined[start : start + n])
    return out
