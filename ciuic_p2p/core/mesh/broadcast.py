"""Dissemination of chunks: along trees, exactly once, with repair.

Each origin numbers its chunks 1, 2, 3, ... A chunk travels in a ``CHUNK`` message:

- ``tree`` mode: the origin sends to its children in its dissemination tree
  (core.mesh.routing); every node that receives a chunk for the first time delivers it
  and forwards it to its own children in that origin's tree; a large piece names the
  tree its origin planned, and every relay forwards it by that plan
  (core.mesh.carriedplan).
- ``direct`` mode: the origin sends to every live node; nobody forwards.
- ``gossip`` mode: the origin and every first receiver push to ``gossip_fanout``
  random live nodes (the baseline the benchmarks compare against).

Exactly once: per origin a node keeps the highest sequence number below which it has
every chunk, plus the set above it; a chunk already seen is dropped, never delivered
or forwarded again. A sequence number is the origin's *session* (the incarnation its
daemon started with) times 2^40 plus its count in that session, so a restarted
origin's chunks are new to the nodes that hold its previous life's: a higher session
starts the origin's log afresh (every chunk of the new session is expected, so what it
sent before this node heard it is repaired, whichever it hears first). The previous
life's log is kept beside it for ``chunk_retain_s`` (``ended``), as is the log of an
origin that left (a daemon restarted under its trainer leaves first): what that life
sent and this node still lacks is repaired from the members that hold it, as long as
they keep it (the origin's new life does not). Before, leaving dropped the log and a
new session gave the old one up: a node that lagged behind lost what the previous life
sent last, and took the new life for a stranger's, expecting only the 64 chunks before
the first it heard (213 of a restarted trainer's 690 chunks never reached one replica
in a CI run of tests/train/test_daemon_restart.py). A chunk of a session older than
both is a straggler of a life that ended, dropped (``stale``). A
node that restarts itself resumes each origin where its previous life stopped
(``resume``, saved by the daemon at its stop): what came meanwhile is a gap, repaired
like any other, and nothing it delivered before comes again.

Repair: a node tells members the highest sequence number it holds per origin
(``HEADS``), ``heads_fanout`` of them at a time in a shuffled round through the live
members: from the first repair tick (every ``heads_interval_s``) after what it holds
changed, a tick at a time until every member was told, then every
``heads_idle_interval_s`` while nothing changes (an unchanged announcement repeats
what its receivers most likely heard: sent to random members every tick for ever, it
was a third of an idle mesh's bytes and a sixth of a training one's).
A node that learns of a chunk it lacks, and still lacks it a repair wait later (the
tree had its chance), asks an announcer for it (``WANT``), and asks again every 2 x
``repair_after_s`` (and no sooner than a repair has been measured to take to come
back), of its last four announcers in turn and every second time of its origin (the
adapter queues no second copy of a chunk already queued for that peer). The wait is
``repair_after_s``, or longer where the tree copies are measured to come later
(core.mesh.lag: a large piece on a slow link takes seconds, and asking sooner sends a
second copy that slows everything else), at most ``repair_after_max_s``. Holders keep
delivered chunks for ``chunk_retain_s``, and their origin its own for
``own_chunk_retain_s`` (all within ``chunk_retain_bytes``, at most half of it the
node's own), so a chunk whose relay died still reaches everyone while anyone holds
it, in particular while its origin lives, and a round slower than ``chunk_retain_s``
(large pieces on slow links) loses nothing. A repaired chunk is
forwarded down the tree like any other first arrival, so the subtree under a dead
relay is repaired through its root. A gap
no holder fills within ``chunk_retain_s`` (``own_chunk_retain_s`` while its origin is
live) and ``GIVE_UP_ASKS`` requests is given up
and counted (``lost``).

Bounds (members are admitted, but a faulty one must not hang the others): per origin
at most ``MAX_GAP`` missing numbers are tracked at a time (the window moves as the gap
fills) and ``MAX_ABOVE`` chunks held above a gap (past it the oldest gap is given
up); at most ``MAX_ORIGINS`` origin logs.

What a member cannot do (core.mesh.identities): every chunk carries its origin's signature
over (origin, seq) and the payload, checked before this node delivers it, forwards it
or counts its number as held, so nobody can publish as another origin, take its next
numbers, or have its real chunks dropped as duplicates of forged ones; a replayed
chunk is a duplicate of itself. Only a signed chunk opens an origin's log or moves it
to a new session. An announcement (HEADS) is a claim: it makes this node ask for
what it lacks, never hold a number, and a gap no holder fills is forgotten, not
counted as held, so a real chunk that comes later is still delivered once. The head
claimed of an origin (or a session) that no signed chunk has shown yet is asked for
alone, on the repair timetable (``repair_after_s``, then every 2 x that), until a
signed chunk of it arrives and opens the log (whose window then fetches the rest) or
``chunk_retain_s`` passes: a liar's claim costs one small request now and then.
The measured lags are guarded the same way: a lag sample starts only when a number is
known to exist on more than one member's word (a signed chunk of it or above, or a
second announcer), so claims ahead of an origin do not make its honest copies look
late; a repaired chunk's late copy is a sample only from the member that sends that
origin's tree copies here, with its origin's signature; a holder's slow answers set
the re-ask interval only of what was asked of it. What is left: a relay can hold the
repairs of the origins it relays, below it, to ``repair_after_max_s``.

Relays are judged by what reaches the nodes below them (issue 44: a member that made
itself everyone's relay and forwarded nothing): a chunk this node had to repair whose
copy from its relay (by its trees, or the plan the chunk carries) did not come within
``LATE_RELAY_GRACE_S`` after is a miss of that relay; a copy from it is a hit. At
``RELAY_MISSES`` of the last ``RELAY_OUTCOMES`` this node stops counting on it for
``DISTRUST_S``: what it owes is asked for at once, of others, and the link from it is
published far (core.mesh.rttmap), so every node's trees stop making it this node's
relay. Only a relay this node has had for ``RELAY_SETTLE_S`` is judged (while a new
link state spreads, nodes disagree on who relays to whom).
"""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ciuic_p2p.config.sections import MeshSection
from ciuic_p2p.core.mesh.carriedplan import plan_children, plan_parent
from ciuic_p2p.core.mesh.chunkstore import ChunkStore, Kept
from ciuic_p2p.core.mesh.identities import Identities
from ciuic_p2p.core.mesh.lag import LagEstimator
from ciuic_p2p.core.mesh.messages import (
    MAX_HEADS,
    MAX_MESSAGE_BYTES,
    MAX_WANT,
    Chunk,
    Heads,
    Message,
    Plan,
    Want,
)
from ciuic_p2p.core.mesh.originlog import (
    MAX_GAP,
    REORDER_WINDOW,
    Holders,
    OriginLog,
)

Resumed = tuple[int, tuple[int, ...]]
"""An origin's contiguous prefix delivered, and the numbers delivered above it."""
SESSION_SHIFT = 40
"""A session numbers up to 2^40 chunks (35 years at 1,000 a second)."""
MAX_ABOVE = 4 * MAX_GAP
"""Chunks held per origin above a gap that does not fill; past it the oldest gap is
given up (``lost``), as it would be after ``chunk_retain_s``."""
MAX_ORIGINS = 8192
"""Origins with a log; a new origin past this (announced by a faulty member, say) is
ignored and counted unless it is live."""
GIVE_UP_ASKS = 8
"""A missing number is given up once ``chunk_retain_s`` (``own_chunk_retain_s`` while
its origin is live, which holds it that long) has passed since it was known missing
*and* it was asked for this often (two turns through its last four announcers): on a
slow round the holders that got it last still keep it, and a number given up is
never asked for again."""
REPAIRED_HOPS = 254
"""The hop count of a repaired chunk forwarded down the tree (a repair answer is 255):
its lag is the repair's upstream, not the tree's, and is not sampled (a subtree below
a relay that repairs a burst would otherwise learn to wait for that relay's repairs,
and wait longer with every burst)."""
MAX_HOLDER_LAGS = 1024
"""Holders whose answer lag is kept (the least recently heard from forgotten first)."""
MAX_REPAIRED_TRACKED = 4096
"""Repaired chunks whose tree copy, when it comes as a duplicate, is still measured (the
oldest forgotten first)."""
MAX_SESSION = (1 << 24) - 1
"""Sessions past this share it (a node restarted 16 million times): a restart then
goes unnoticed until its count passes the previous life's, as before sessions."""
RELAY_OUTCOMES = 16
"""The last copies a relay owed this node that judge it: a copy that came down the
tree from it (on time or late, a repair it forwarded included), or one this node had to
repair and that did not come from it within ``LATE_RELAY_GRACE_S`` after."""
RELAY_MISSES = 8
"""Misses among those that make this node stop counting on the relay for
``DISTRUST_S`` (a relay that drops half of what it owes is one to route around)."""
DISTRUST_S = 300.0
"""How long a relay that failed this node is not counted on: its chunks are asked of
others at once, it is asked for no repair, and the link from it is published at
``core.mesh.rttmap.DISTRUSTED_RTT_S``, so that no node's tree makes it this node's
relay. Then it has its chance again."""
LATE_RELAY_GRACE_S = 1.0
"""A repaired chunk's copy from its relay that comes within this (or twice the repair
wait, if longer) is a late copy, not a miss: a relay whose own relay dropped the chunk
repairs it and forwards it then."""
RELAY_SETTLE_S = 3.0
"""A relay is judged only for chunks it had been this node's relay for this long before
they were known to exist: while trees change (a new link state spreading), nodes
briefly disagree on who relays to whom, and a copy no one thought was theirs to send
is no one's miss."""
MAX_AWAITED = 4096
"""Repaired chunks whose relay's copy is awaited (the oldest judged first)."""


@dataclass(slots=True)
class _Claim:
    high: int
    holders: Holders
    since: float
    asked_at: float | None = None


@dataclass(frozen=True, slots=True)
class Delivery:
    origin: str
    seq: int
    payload: bytes
    at: float
    hops: int


class Disseminator:
    def __init__(
        self,
        node: str,
        settings: MeshSection,
        *,
        children: Callable[[str, int, int], list[str]],
        live: Callable[[], list[str]],
        identities: Identities,
        seed: int = 0,
        session: int = 0,
        plan_for: Callable[[int, int], Plan] | None = None,
        parent: Callable[[str, int, int], str | None] | None = None,
        resume: Mapping[str, Resumed] | None = None,
    ) -> None:
        """``resume``: what this node's previous life had delivered of each origin
        (:meth:`delivered`, saved when it stopped): an origin heard again in the same
        session resumes from there, so the chunks sent while this node was down are
        repaired (from holders that keep them: ``own_chunk_retain_s`` at the origin)."""
        self.node = node
        self._resume = dict(resume or {})
        self.resumed = 0
        """Origins whose log resumed from this node's previous life."""
        self.settings = settings
        self.children = children
        self.plan_for = plan_for
        """The plan this node's chunks of (route, payload bytes) carry (core.mesh.
        carriedplan); empty, or no callable: relays forward by their own trees."""
        self.parent = parent
        """Who sends this node an origin's chunks of (route, payload bytes) by its
        trees (None: no relay to judge)."""
        self.live = live
        self.identities = identities
        self.rng = random.Random(seed ^ 0x5EED)
        self.logs: dict[str, OriginLog] = {}
        self.ended: OrderedDict[str, tuple[OriginLog, float]] = OrderedDict()
        """Per origin that restarted or left, its ended session's log and when it
        ended: what that life sent is still repaired from holders, for
        ``chunk_retain_s`` (at most ``MAX_ORIGINS``, the oldest given up first)."""
        self._heard: OrderedDict[str, None] = OrderedDict()
        """Origins this node had a log of (the most recent ``MAX_ORIGINS``): a new
        session of one is a restart, and all of it is expected."""
        self._base = min(max(0, session), MAX_SESSION) << SESSION_SHIFT
        self.next_seq = self._base + 1
        self.chunks = ChunkStore(node, settings)
        """What this node holds for repair, and for how long (core.mesh.chunkstore)."""
        self.deliveries: list[Delivery] = []
        self.duplicates = 0
        self.repaired = 0
        self.lost = 0
        self.stale = 0
        """Chunks (and announcements) of an origin's previous life, dropped."""
        self.unknown_origins = 0
        """Chunks and announcements of an origin not live, past ``MAX_ORIGINS`` logs."""
        self.restarts_seen = 0
        """Origins heard from in a new session (restarted)."""
        self.plans_refused = 0
        """Carried plans that gave this node more than one child beyond what its own
        tree gives it: forwarded by its own tree instead."""
        self.bad_signatures = 0
        """Chunks whose origin signature did not verify (or whose origin has no
        credential here): dropped, never delivered, forwarded or held."""
        self.tree_lag = LagEstimator()
        """Every origin's tree lags: the wait for an origin not measured yet."""
        self.answer_lags: OrderedDict[str, LagEstimator] = OrderedDict()
        """From a WANT to the repaired chunk's arrival, by the holder asked: a holder
        that answers late holds up only the asks sent to it."""
        self._repaired_since: OrderedDict[tuple[str, int], float] = OrderedDict()
        """Repaired chunks, by when they were first known missing."""
        self.relays: OrderedDict[str, deque[bool]] = OrderedDict()
        """Per relay, whether each of the last copies it owed this node came."""
        self.distrusted: dict[str, float] = {}
        """Relays not counted on, until when (``DISTRUST_S``)."""
        self.relays_distrusted = 0
        """Times a relay was found failing (``RELAY_MISSES``)."""
        self._awaited: OrderedDict[tuple[str, int], tuple[str, float]] = OrderedDict()
        """Repaired chunks whose relay's copy may still come: (relay, deadline)."""
        self._shape: dict[str, tuple[int, int]] = {}
        """Each origin's last chunk's route and size: whose copies its next ones owe."""
        self._relay_since: dict[str, tuple[str | None, float]] = {}
        """Each origin's relay to this node, as of its last chunk, and since when."""
        self._heads_turn = 0
        self._claims: dict[str, _Claim] = {}
        """Heads announced in a session no signed chunk has shown yet, by origin."""
        self._out: list[tuple[str, Message]] = []
        self._next_heads: float | None = None
        """The next repair tick (every ``heads_interval_s`` while anything is held)."""
        self._held_changes = 0
        """Chunks kept so far (own and others'): what the heads say moves with it."""
        self._announced_changes = -1
        self._next_announce = 0.0
        self._turn_left = 0
        """Origins a turn through more heads than one message holds has yet to announce:
        they go out at the next ticks."""
        self._tell_left = 0
        """Members a change is still to be announced to (``heads_fanout`` a tick)."""
        self._rotation: list[str] = []
        self._rotation_at = 0

    # -- sending ----------------------------------------------------------------------------

    def publish(self, payload: bytes, now: float, route: int = 0) -> int:
        """Send a chunk from this node to every live node (``tree`` mode: down its
        trees of strategy ``route``, core.mesh.strategy); returns its sequence number."""
        seq = self.next_seq
        self.next_seq += 1
        mode = self.settings.dissemination
        plan: Plan = ()
        if mode == "tree" and self.plan_for is not None:
            plan = self.plan_for(route, len(payload))
        unsigned = Chunk(self.node, seq, 0, payload, route=route, plan=plan)
        signed = dataclasses.replace(unsigned, signature=self.identities.sign(unsigned))
        self._keep(signed, now)
        if mode == "direct":
            targets = list(self.live())
        elif mode == "gossip":
            targets = self._random_peers(self.settings.gossip_fanout, exclude=())
        elif plan:
            targets = plan_children(plan, self.node, self.node, set(self.live())) or []
        else:
            targets = self.children(self.node, route, len(payload))
        for t in targets:
            self._send(t, signed)  # one body: the adapter encodes it once for all
        self._arm_heads(now)
        return seq

    def _random_peers(self, k: int, exclude: tuple[str, ...]) -> list[str]:
        pool = [n for n in self.live() if n not in exclude]
        return self.rng.sample(pool, min(k, len(pool)))

    # -- receiving --------------------------------------------------------------------------

    def handle(self, msg: Message, now: float) -> None:
        b = msg.body
        if isinstance(b, Chunk):
            self._on_chunk(msg.sender, b, now)
        elif isinstance(b, Heads):
            for origin, high in b.heads:
                if origin != self.node:
                    self._claim(origin, high, msg.sender, now)
        elif isinstance(b, Want):
            for seq in b.seqs:
                kept = self.kept(b.origin, seq)
                if kept is not None:
                    self._send(
                        msg.sender, Chunk(b.origin, seq, 255, kept[0], kept[1], kept[3], kept[4])
                    )

    def _claim(self, origin: str, high: int, holder: str, now: float) -> None:
        """A HEADS entry: tracked in the origin's signed session, else asked for once
        (see the module docstring)."""
        session = high >> SESSION_SHIFT
        log = self._ended_log(origin, session) or self.logs.get(origin)
        if self._is_stale(origin, session):
            self.stale += 1
        elif log is not None and session == log.session:
            self._learn(log, high, holder, now)
        elif not self.identities.knows(origin) or (
            origin not in self._claims and len(self._claims) >= MAX_ORIGINS
        ):
            self.unknown_origins += 1
        else:
            claim = self._claims.get(origin)
            if claim is None:
                claim = self._claims[origin] = _Claim(high, Holders(), now)
            claim.high = max(claim.high, high)
            claim.holders.note(holder)
            self._arm_heads(now)

    def _log(self, origin: str, seq: int, now: float) -> OriginLog | None:
        """The origin's log for the session of ``seq``, a signed chunk's number (a new
        log for a newer session); None for a session older than the one known."""
        session = seq >> SESSION_SHIFT
        ended = self._ended_log(origin, session)
        if ended is not None:
            if origin not in self.logs and origin in self.live():
                # Back in the mesh in the same session (it left, or was taken for
                # gone, without a restart): its log is current again.
                del self.ended[origin]
                self.logs[origin] = ended
            return ended
        if self._is_stale(origin, session):
            self.stale += 1
            return None
        log = self.logs.get(origin)
        if log is None and len(self.logs) >= MAX_ORIGINS and origin not in self.live():
            self.unknown_origins += 1
            return None
        if log is None or session > log.session:
            if log is not None:  # restarted: its previous life's gaps fill from holders
                self.restarts_seen += 1
                self._end_session(origin, log, now)
            base = session << SESSION_SHIFT
            # A known origin that restarted sent every chunk of its new session to a
            # mesh that knew it (and keeps them: own_chunk_retain_s), so all of them
            # are expected, not only the reorder window before the first heard here:
            # a restarted daemon sends at once what its trainer kept while it was
            # away, and the first of those were never asked for.
            known = log is not None or origin in self.ended or origin in self._heard
            window = MAX_GAP if known else REORDER_WINDOW
            log = OriginLog(contiguous=max(base, seq - 1 - window), session=session)
            self._resume_log(origin, log, seq)
            self._forget_repaired(origin)
            self.logs[origin] = log
            self._heard[origin] = None
            self._heard.move_to_end(origin)
            if len(self._heard) > MAX_ORIGINS:
                self._heard.popitem(last=False)
        return log

    def _end_session(self, origin: str, log: OriginLog, now: float) -> None:
        """Keep ``origin``'s log of a session that ended beside the new one (one per
        origin: the one before it is given up, its gaps counted lost)."""
        before = self.ended.pop(origin, None)
        if before is not None:
            self.lost += _missing(before[0])
        self.ended[origin] = (log, now)
        if len(self.ended) > MAX_ORIGINS:
            self.lost += _missing(self.ended.popitem(last=False)[1][0])

    def _is_stale(self, origin: str, session: int) -> bool:
        """``session`` is older than what this node tracks of ``origin`` (its current
        log, else its ended one) and is not the ended one."""
        log = self.logs.get(origin)
        ended = self.ended.get(origin)
        newest = log.session if log is not None else ended[0].session if ended else -1
        return session < newest and self._ended_log(origin, session) is None

    def _ended_log(self, origin: str, session: int) -> OriginLog | None:
        """``origin``'s log of ``session`` if it is the one that ended last, still kept."""
        ended = self.ended.get(origin)
        if ended is None or ended[0].session != session:
            return None
        return ended[0]

    def _resume_log(self, origin: str, log: OriginLog, seq: int) -> None:
        """Start ``origin``'s new log where this node's previous life stopped, when it
        is of the same session: what came meanwhile is then a gap, repaired like any
        other (at most ``MAX_GAP`` of it), and what was delivered before is not
        delivered again (however short the gap)."""
        resumed = self._resume.pop(origin, None)
        if resumed is None:
            return
        contiguous, above = resumed
        if contiguous >> SESSION_SHIFT != log.session:
            return
        # Past seq too: then seq itself was delivered before, and is a duplicate now.
        log.contiguous = max(contiguous, seq - 1 - MAX_GAP)
        for q in above:
            if q > log.contiguous:
                log.add(q)
        self.resumed += 1

    def delivered(self) -> dict[str, Resumed]:
        """Per origin: every chunk up to which this node delivered, and those above it
        (at most ``MAX_ABOVE``): what its next life resumes from (``resume``)."""
        out = dict(self._resume)  # not heard since a restart: still where it was
        out.update(
            (origin, (log.contiguous, tuple(sorted(log.above)[:MAX_ABOVE])))
            for origin, log in self.logs.items()
            if origin != self.node
        )
        return out

    def _learn(
        self, log: OriginLog, high: int, holder: str, now: float, signed: bool = False
    ) -> None:
        if high > log.high:
            log.high, log.high_by = high, holder
        log.holders.note(holder)
        while len(log.above) > MAX_ABOVE:
            self.lost += log.give_up_oldest_gap()
        if log.track(now):
            self._arm_heads(now)
        if log.claimed_by:
            log.confirm(high, None if signed else holder, now)

    def _on_chunk(self, sender: str, chunk: Chunk, now: float) -> None:
        if chunk.origin == self.node:
            self.duplicates += 1
            return
        session = chunk.seq >> SESSION_SHIFT
        if self._is_stale(chunk.origin, session):
            self.stale += 1
            return
        known = self._ended_log(chunk.origin, session) or self.logs.get(chunk.origin)
        if known is not None and known.session != session:
            known = None  # a newer session: its signature is checked, then it opens a log
        if known is not None and known.has(chunk.seq):
            self.duplicates += 1  # no signature to check: nothing changes but a lag
            self._note_late_copy(known, sender, chunk, now)
            awaited = self._awaited.get((chunk.origin, chunk.seq))
            if awaited is not None and awaited[0] == sender:
                del self._awaited[(chunk.origin, chunk.seq)]
                self._relay_outcome(sender, chunk.origin, True, now)
            return
        if not self.identities.verify_chunk(chunk):
            self.bad_signatures += 1
            return
        log = self._log(chunk.origin, chunk.seq, now)
        if log is None:
            return
        if log.has(chunk.seq):  # a log just resumed where this node had delivered it
            self.duplicates += 1
            return
        self._note_arrival(log, sender, chunk, now)
        log.add(chunk.seq)
        self._learn(log, chunk.seq, sender, now, signed=True)
        claim = self._claims.get(chunk.origin)
        if claim is not None and claim.high >> SESSION_SHIFT <= log.session:
            del self._claims[chunk.origin]  # its session is shown: tracked in the log now
            if claim.high >> SESSION_SHIFT == log.session:
                log.holders.merge(claim.holders)
                self._learn(log, claim.high, sender, now)
        self._keep(chunk, now)
        self.deliveries.append(Delivery(chunk.origin, chunk.seq, chunk.payload, now, chunk.hops))
        mode = self.settings.dissemination
        hops = min(chunk.hops + 1, REPAIRED_HOPS)
        if mode == "tree":
            targets = [c for c in self._tree_children(chunk) if c != sender]
        elif mode == "gossip":
            targets = self._random_peers(
                self.settings.gossip_fanout, exclude=(sender, chunk.origin)
            )
        else:
            targets = []
        forwarded = dataclasses.replace(chunk, hops=hops)
        for t in targets:
            self._send(t, forwarded)
        self._arm_heads(now)

    def _tree_children(self, chunk: Chunk) -> list[str]:
        """Whom this node forwards a first-arriving chunk to: by the plan it carries
        (core.mesh.carriedplan), else by this node's trees of its route."""
        if not chunk.plan:
            return self.children(chunk.origin, chunk.route, len(chunk.payload))
        planned = plan_children(chunk.plan, chunk.origin, self.node, set(self.live()))
        if planned is None:
            return []  # not in its origin's view: the planned nodes get it down the plan
        if len(planned) > 1:
            # A plan is its origin's word: it may move a copy from one relay to another
            # where views differ, not make this node send many more than its own tree.
            own = self.children(chunk.origin, chunk.route, len(chunk.payload))
            if len(planned) > len(own) + 1:
                self.plans_refused += 1
                return own
        return planned

    def kept(self, origin: str, seq: int) -> Kept | None:
        """The chunk (origin, seq) as held here, if it still is."""
        return self.chunks.kept(origin, seq)

    def _keep(self, chunk: Chunk, now: float) -> None:
        self._held_changes += 1
        self.chunks.keep(chunk, now)

    # -- repair -----------------------------------------------------------------------------

    def _max_wait_s(self) -> float:
        s = self.settings
        return max(s.repair_after_s, s.repair_after_max_s)

    def _note_arrival(self, log: OriginLog, sender: str, chunk: Chunk, now: float) -> None:
        """A new chunk's lags: the tree's (since it was known to exist), or a
        repair's (since it was asked for, of this sender, once), and what its tree
        copy will teach."""
        seq = chunk.seq
        since = log.known_at.get(seq)
        self._shape[chunk.origin] = (chunk.route, len(chunk.payload))
        relay = self._expected_relay(chunk)
        held = self._relay_since.get(chunk.origin)
        if held is None or held[0] != relay:
            self._relay_since[chunk.origin] = held = (relay, now)
        if chunk.hops == 255:
            if relay is not None and since is not None and held[1] <= since - RELAY_SETTLE_S:
                self._await_relay(chunk, relay, now)
            self.repaired += 1
            asked = log.requested_at.get(seq)
            if asked is not None and log.asks.get(seq) == 1 and log.asked_of.get(seq) == sender:
                # Only the answer to a first ask: the answer to an earlier one that
                # comes just after a re-ask would read as a quick repair.
                self._answer_lag(sender).add(min(now - asked, self._max_wait_s()))
            if since is not None:
                self._repaired_since[(chunk.origin, seq)] = since
                if len(self._repaired_since) > MAX_REPAIRED_TRACKED:
                    self._repaired_since.popitem(last=False)
        else:  # down the tree, first hand or as its relay repaired it
            self._relay_outcome(sender, chunk.origin, True, now)
            if chunk.hops < REPAIRED_HOPS:
                log.tree_sender = sender
                if since is not None:
                    self._sample_tree_lag(log, now - since)

    # -- relays that fail -------------------------------------------------------------------

    def _expected_relay(self, chunk: Chunk) -> str | None:
        """Who owed this node ``chunk``'s tree copy (None: its origin, or no one)."""
        if chunk.plan:
            relay = plan_parent(chunk.plan, chunk.origin, self.node, set(self.live()))
        elif self.parent is not None:
            relay = self.parent(chunk.origin, chunk.route, len(chunk.payload))
        else:
            relay = None
        return None if relay in (chunk.origin, self.node) else relay

    def _await_relay(self, chunk: Chunk, relay: str, now: float) -> None:
        """A repair came first: the relay's copy may still come (a late copy), or not
        (a miss, judged at the deadline)."""
        grace = max(LATE_RELAY_GRACE_S, 2 * self.repair_wait_s(chunk.origin))
        self._awaited[(chunk.origin, chunk.seq)] = (relay, now + grace)
        while len(self._awaited) > MAX_AWAITED:
            self._awaited.popitem(last=False)  # not judged

    def _relay_outcome(self, relay: str, origin: str, came: bool, now: float) -> None:
        if relay in (origin, self.node):
            return
        record = self.relays.get(relay)
        if record is None:
            record = self.relays[relay] = deque(maxlen=RELAY_OUTCOMES)
            if len(self.relays) > MAX_HOLDER_LAGS:
                self.relays.popitem(last=False)
        else:
            self.relays.move_to_end(relay)
        record.append(came)
        if not came and record.count(False) >= RELAY_MISSES and relay not in self.distrusted:
            self.distrusted[relay] = now + DISTRUST_S
            self.relays_distrusted += 1
            record.clear()

    def _judge_relays(self, now: float) -> None:
        """Misses for the relays whose copies did not come in time; distrust ends."""
        for key in [k for k, (_, deadline) in self._awaited.items() if deadline <= now]:
            relay, _ = self._awaited.pop(key)
            self._relay_outcome(relay, key[0], False, now)
        for relay in [r for r, until in self.distrusted.items() if until <= now]:
            del self.distrusted[relay]

    def forget_relay(self, node: str) -> None:
        """A member died or left: what it owed is no longer judged (a crashed relay is
        no liar; back, it starts afresh)."""
        self.relays.pop(node, None)
        self.distrusted.pop(node, None)
        for key in [k for k, (relay, _) in self._awaited.items() if relay == node]:
            del self._awaited[key]

    def _counts_on_relay(self, origin: str) -> bool:
        """Whether this node's relay for ``origin``'s next chunks is one it counts on."""
        if not self.distrusted or self.parent is None:
            return True
        route, size = self._shape.get(origin, (0, self.settings.tree_chunk_bytes))
        return self.parent(origin, route, size) not in self.distrusted

    def _note_late_copy(self, log: OriginLog, sender: str, chunk: Chunk, now: float) -> None:
        """A second copy: if it is the tree's copy of a chunk repaired here, from the
        member that sends this origin's tree copies and as its origin signed it, how
        late the tree was (a wait set too short learns from nothing else)."""
        key = (chunk.origin, chunk.seq)
        since = self._repaired_since.get(key)
        if since is None or chunk.hops >= REPAIRED_HOPS or sender != log.tree_sender:
            return
        kept = self.chunks.others.get(key)
        if kept is None or kept[1] != chunk.signature:
            return
        del self._repaired_since[key]
        self._sample_tree_lag(log, now - since)

    def _answer_lag(self, holder: str) -> LagEstimator:
        lag = self.answer_lags.get(holder)
        if lag is None:
            lag = self.answer_lags[holder] = LagEstimator()
            if len(self.answer_lags) > MAX_HOLDER_LAGS:
                self.answer_lags.popitem(last=False)
        else:
            self.answer_lags.move_to_end(holder)
        return lag

    def _sample_tree_lag(self, log: OriginLog, lag_s: float) -> None:
        lag_s = min(lag_s, self._max_wait_s())
        log.tree_lag.add(lag_s)
        self.tree_lag.add(lag_s)

    def repair_wait_s(self, origin: str) -> float:
        """How long a chunk of ``origin`` known to exist may be missing before it is
        asked for: ``repair_after_s``, or what its tree copies are measured to take
        (every origin's, while this one's are not measured), at most
        ``repair_after_max_s``."""
        log = self.logs.get(origin)
        lag = log.tree_lag if log is not None and log.tree_lag.samples else self.tree_lag
        return min(max(self.settings.repair_after_s, lag.bound_s()), self._max_wait_s())

    def _reask_wait_s(self, holder: str | None) -> float:
        """``2 x repair_after_s``, and no sooner than a repair from the holder last
        asked is measured to come back (asking a second holder while the first one's
        copy is on its way doubles the bytes; before any repair came back from it,
        what the tree's copies take stands in: the same pieces over the same links)."""
        s = self.settings
        lag = self.answer_lags.get(holder) if holder is not None else None
        if lag is None or not lag.samples:
            lag = self.tree_lag
        return max(2 * s.repair_after_s, min(lag.bound_s(), self._max_wait_s()))

    def _arm_heads(self, now: float) -> None:
        if self._next_heads is None:
            self._next_heads = now + self.settings.heads_interval_s

    def get_timer(self) -> float | None:
        return self._next_heads

    def handle_timer(self, now: float) -> None:
        s = self.settings
        if self._next_heads is None or now < self._next_heads:
            return
        self._next_heads = now + s.heads_interval_s
        self._judge_relays(now)
        self._announce(now)
        self._ask_claims(now)
        live = set(self.live())
        for origin, log in self.logs.items():
            # While its origin lives it still holds the chunk (own_chunk_retain_s): a
            # round of 1 MiB pieces on 5 Mbit/s links outlasted chunk_retain_s, and a
            # number given up then was never asked for again (the round never ended).
            keep_asking_s = s.chunk_retain_s
            if origin in live:
                keep_asking_s = max(keep_asking_s, s.own_chunk_retain_s)
            self._repair(origin, log, now, keep_asking_s, origin_holds=True)
        for origin, (log, ended_at) in list(self.ended.items()):
            # The origin's new life holds none of these: asked of the holders alone.
            self._repair(origin, log, now, s.chunk_retain_s, origin_holds=False)
            if now - ended_at > s.chunk_retain_s and not _missing(log):
                # Nobody keeps that life's chunks any longer. Where it stopped is kept
                # (as a previous life's is, ``resume``): a chunk of that session that
                # comes again later (a slow holder's, or the member back without a
                # restart) resumes there, and nothing delivered comes again.
                del self.ended[origin]
                if len(self._resume) < MAX_ORIGINS:
                    self._resume[origin] = (log.contiguous, tuple(sorted(log.above)[:MAX_ABOVE]))
        self.chunks.evict(now)

    def _repair(
        self, origin: str, log: OriginLog, now: float, keep_asking_s: float, origin_holds: bool
    ) -> None:
        """Ask for what ``log`` lacks and has waited for long enough; give up what was
        asked for often enough and longer than ``keep_asking_s`` ago."""
        wanted = []
        # A relay that failed this node is not waited for: asked of others at once.
        wait_s = self.repair_wait_s(origin) if self._counts_on_relay(origin) else 0.0
        for seq, since in sorted(log.missing_since.items()):
            if log.has(seq):
                continue
            if now - since > keep_asking_s and log.asks.get(seq, 0) >= GIVE_UP_ASKS:
                # Given up: counted and no longer asked for, but not held: the
                # number was only claimed, and a real chunk that comes later is
                # still delivered (once).
                self.lost += 1
                log.forget_missing(seq)
                continue
            asked = log.requested_at.get(seq)
            # No blind back-off: one (tried, up to 16-32 x) delayed real repairs
            # by seconds and pushed replicas past the staleness bound. The wait
            # follows the measured lags instead, and a second copy queued behind
            # the first the adapter's outbox refuses (daemon.outbox).
            if now - since >= wait_s and (
                asked is None or now - asked >= self._reask_wait_s(log.asked_of.get(seq))
            ):
                wanted.append(seq)
                log.requested_at[seq] = now
                log.asks[seq] = log.asks.get(seq, 0) + 1
            if len(wanted) >= MAX_WANT:
                break
        log.track(now)  # the window moves on as the gap fills
        if wanted:
            self._ask(origin, log, wanted, origin_holds)

    def _ask(self, origin: str, log: OriginLog, wanted: list[int], origin_holds: bool) -> None:
        """WANTs for ``wanted``: of the next announcer, and every second ask of a
        number of its origin, while it lives: the announcers may all lack it (each
        announces the highest it holds, gaps below it or not), and the origin holds
        every chunk it sent for ``chunk_retain_s``."""
        to_origin = [q for q in wanted if log.asks[q] % 2 == 0] if origin_holds else []
        if to_origin and origin in self.live():
            wanted = [q for q in wanted if log.asks[q] % 2]
            for seq in to_origin:
                log.asked_of[seq] = origin
            self._send(origin, Want(origin, tuple(to_origin)))
        holder = log.holders.next() if wanted else None
        for _ in range(3):  # the last four announcers, a failing relay passed over
            if holder not in self.distrusted and (origin_holds or holder != origin):
                break
            holder = log.holders.next()
        if not origin_holds and holder == origin:
            holder = None  # its new life holds none of its previous life's chunks
        if holder in self.distrusted and origin_holds and origin in self.live():
            holder = origin
        if holder is not None:
            for seq in wanted:
                log.asked_of[seq] = holder
            self._send(holder, Want(origin, tuple(wanted)))

    def _announce(self, now: float) -> None:
        """Send the heads while a change is still to reach every member (``fanout`` a
        tick, in turn), every ``heads_idle_interval_s`` otherwise, and tick by tick
        while a turn through more origins than one message holds is not over."""
        s = self.settings
        changed = self._held_changes != self._announced_changes
        if (
            not changed
            and now < self._next_announce
            and self._turn_left <= 0
            and self._tell_left <= 0
        ):
            return
        if self._turn_left <= 0:  # a new turn through the origins starts here
            self._turn_left = len(self.logs) + len(self.ended)
            # What this turn covers: a change kept during it is announced by the next.
            self._announced_changes = self._held_changes
            if changed:
                self._tell_left = len(self.live())
        # Half a tick early: the repair tick that lands on the interval's end takes it.
        self._next_announce = now + s.heads_idle_interval_s - 0.5 * s.heads_interval_s
        heads = self._heads()
        if heads:
            peers = self._next_peers(s.heads_fanout)
            self._tell_left -= max(1, len(peers))
            for peer in peers:
                self._send(peer, Heads(tuple(heads)))
        else:
            self._tell_left = 0

    def _next_peers(self, k: int) -> list[str]:
        """The next ``k`` members of a round through the live ones, shuffled whenever
        the members change: every member hears one of any ceil(N / k) announcements
        (random picks left one out for many intervals now and then)."""
        live = self.live()
        if len(self._rotation) != len(live) or set(self._rotation) != set(live):
            self._rotation, self._rotation_at = self.rng.sample(live, len(live)), 0
        out: list[str] = []
        while len(out) < min(k, len(live)):
            if self._rotation_at >= len(self._rotation):  # round again, same order:
                self._rotation_at = 0  # no member waits more than one round
            peer = self._rotation[self._rotation_at]
            self._rotation_at += 1
            if peer not in out:
                out.append(peer)
        return out

    def _ask_claims(self, now: float) -> None:
        """Ask for each claimed head alone (see the module docstring)."""
        s = self.settings
        for origin, claim in list(self._claims.items()):
            if now - claim.since > s.chunk_retain_s:
                del self._claims[origin]
                continue
            if now - claim.since >= s.repair_after_s and (
                claim.asked_at is None or now - claim.asked_at >= 2 * s.repair_after_s
            ):
                claim.asked_at = now
                holder = claim.holders.next()
                if holder is not None:
                    self._send(holder, Want(origin, (claim.high,)))

    def _heads(self) -> list[tuple[str, int]]:
        """This node's own head first, then the others' from a place that moves on
        every round, as many as one message holds (about 1,400): a mesh of more
        origins is announced over several rounds, never in a message too large to
        send."""
        own = [(self.node, self.next_seq - 1)] if self.next_seq - 1 > self._base else []
        logs = [*self.logs.items(), *((o, log) for o, (log, _) in self.ended.items())]
        others = [(o, max(log.held_high, log.contiguous)) for o, log in logs]
        if others:
            start = self._heads_turn % len(others)
            others = others[start:] + others[:start]
        budget = MAX_MESSAGE_BYTES - 256
        out: list[tuple[str, int]] = []
        taken = 0
        for origin, high in own + others:
            size = 10 + len(origin.encode())  # str8 and u64
            if size > budget or len(out) >= MAX_HEADS:
                break
            taken += 1
            if high > 0:
                budget -= size
                out.append((origin, high))
        self._heads_turn += max(0, taken - len(own))  # the next round starts after these
        self._turn_left = max(0, self._turn_left - max(0, taken - len(own)))
        return out

    def forget(self, origin: str, now: float) -> None:
        """An origin left (its daemon stopped): nothing more of this life is to come,
        but what it sent before and this node lacks is repaired from the holders for
        ``chunk_retain_s`` (its log is kept as ended: a daemon restarted under its
        trainer leaves, and its last chunks were still on their way)."""
        log = self.logs.pop(origin, None)
        if log is not None:
            self._end_session(origin, log, now)
        self._claims.pop(origin, None)
        self._shape.pop(origin, None)
        self._relay_since.pop(origin, None)
        self._forget_repaired(origin)
        self._turn_left = min(self._turn_left, len(self.logs) + len(self.ended))

    def _forget_repaired(self, origin: str) -> None:
        for key in [k for k in self._repaired_since if k[0] == origin]:
            del self._repaired_since[key]

    # -- output -----------------------------------------------------------------------------

    def _send(self, node: str, body: Chunk | Heads | Want) -> None:
        self._out.append((node, Message(self.node, body)))

    def messages_to_send(self) -> list[tuple[str, Message]]:
        out, self._out = self._out, []
        return out

    def take_deliveries(self) -> list[Delivery]:
        out, self.deliveries = self.deliveries, []
        return out


def _missing(log: OriginLog) -> int:
    """Numbers ``log`` knows exist and lacks."""
    return sum(1 for q in log.missing_since if not log.has(q))
