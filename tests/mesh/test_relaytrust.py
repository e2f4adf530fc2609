"""Routes that do not take a member's word alone (issue 44, point 5): link claims checked
against what others measured, and relays judged by what reaches the nodes below them."""

from __future__ import annotations

from ciuic_p2p.config import MeshSection
from ciuic_p2p.core.mesh.broadcast import (
    DISTRUST_S,
    RELAY_MISSES,
    RELAY_SETTLE_S,
    Disseminator,
)
from ciuic_p2p.core.mesh.messages import Coordinate, Heads, LinkEntry, Links, Message, Want
from ciuic_p2p.core.mesh.rttmap import DISTRUSTED_RTT_S, RttMap
from tests.mesh.relayattack import relay_run
from tests.mesh.signing import chunk, identities


def test_a_member_claiming_short_links_and_dropping_copies_relays_for_no_one() -> None:
    """Issue 44: a member publishing its links' RTTs at 1% of the truth, and forwarding
    nothing, became a relay in 10 of 10 honest trees on the 11-city matrix and put the
    honest delivery p90 at 10x. Now its claims are not taken below what the other ends
    measured, and the nodes it fails route around it: it relays in no honest tree and
    the p90 stays within 1.5x of the same run with it honest, nothing lost."""
    clean = relay_run(attack=False)
    attacked = relay_run(attack=True)
    assert attacked.lies > 0 and attacked.dropped > 0  # it did lie, and did drop
    assert attacked.liar_relays <= 1, attacked.summary()
    assert attacked.p(0.9) <= 1.5 * clean.p(0.9), (attacked.summary(), clean.summary())
    assert attacked.undelivered == 0 and clean.undelivered == 0
    assert attacked.refused_claims > 0 and clean.refused_claims == 0
    assert attacked.distrusted_honest == 0 and clean.distrusted_honest == 0


def _links(origin: str, **rtt_ms: float) -> Links:
    entries = tuple(LinkEntry(p, round(ms * 1000)) for p, ms in sorted(rtt_ms.items()))
    return Links(origin, 1, entries)


def test_a_link_is_never_taken_shorter_than_its_other_end_measured_it() -> None:
    """Where both ends published a link and one end's RTT is far the shorter, the
    longer is taken and the short claim counted; where they agree, their mean."""
    view = RttMap("me", MeshSection(link_publish_min_s=0.0))
    view.apply_links(_links("m", x=1.0, y=0.95), now=1.0)  # the truth at 1%
    view.apply_links(_links("x", m=100.0), now=1.0)
    view.apply_links(_links("y", m=96.0), now=1.0)
    assert view.measured_s("m", "x") == view.measured_s("x", "m") == 0.1
    assert view.refused_claims("m") == 2 and view.refused_claims("x") == 0
    honest = RttMap("me", MeshSection(link_publish_min_s=0.0))
    honest.apply_links(_links("m", x=90.0), now=1.0)
    honest.apply_links(_links("x", m=100.0), now=1.0)
    assert abs(honest.measured_s("m", "x") - 0.095) < 1e-9  # type: ignore[operator]
    assert honest.refused_claims("m") == 0


def test_a_link_one_end_published_is_taken_no_shorter_than_half_its_triangle_bound() -> None:
    """m claims 1 ms to x and x published nothing of m: the witnesses' links (each
    published by both its ends) bound RTT(m, x) from below by |RTT(y, m) - RTT(y, x)|,
    and the second greatest of those bounds, halved, is what the claim is taken at."""
    view = RttMap("me", MeshSection(link_publish_min_s=0.0))
    view.apply_links(_links("m", x=1.0, y1=20.0, y2=30.0, y3=40.0), now=1.0)
    view.apply_links(_links("x", y1=120.0, y2=110.0, y3=100.0), now=1.0)
    view.apply_links(_links("y1", m=20.0, x=120.0), now=1.0)
    view.apply_links(_links("y2", m=30.0, x=110.0), now=1.0)
    view.apply_links(_links("y3", m=40.0, x=100.0, z=1.0), now=1.0)
    # Bounds 100, 80 and 60 ms: the second greatest is 80, half of it 40.
    assert abs(view.measured_s("m", "x") - 0.040) < 1e-9  # type: ignore[operator]
    assert view.refused_claims("m") == 1
    # One witness alone (y3 claiming to be 1 ms from z, which said nothing) decides nothing.
    assert view.measured_s("y3", "z") == 0.001


def test_a_node_publishes_the_link_from_a_relay_that_failed_it_as_far() -> None:
    settings = MeshSection(link_publish_min_s=0.0, link_refresh_s=1e9)
    me = RttMap("me", settings)
    me.observe("r", Coordinate(), 0.050)
    first = me.publish(now=1.0)
    assert first is not None and first.entries[0].rtt_us == 50_000
    me.distrusted = {"r": 100.0}
    far = me.publish(now=2.0)
    assert far is not None and far.entries[0].rtt_us == round(DISTRUSTED_RTT_S * 1e6)
    back = me.publish(now=100.0)  # its time is over: the measurement again
    assert back is not None and back.entries[0].rtt_us == 50_000


SETTINGS = MeshSection(heads_interval_s=0.05, repair_after_s=0.3, chunk_retain_s=60.0)


def _child(relay: str = "relay") -> Disseminator:
    """A node whose trees make ``relay`` its relay for every origin."""
    return Disseminator(
        "me",
        SETTINGS,
        children=lambda origin, route, size: [],
        live=lambda: ["me", "origin", "relay", "holder", "holder2"],
        identities=identities("me", "origin"),
        parent=lambda origin, route, size: relay,
    )


def _repair(d: Disseminator, seq: int, now: float) -> float:
    """``seq`` announced by two holders, asked for, and answered by a holder; the
    time after."""
    for holder in ("holder", "holder2"):
        d.handle(Message(holder, Heads((("origin", seq),))), now=now)
    while not [m for _, m in d.messages_to_send() if isinstance(m.body, Want)]:
        now = round(now + 0.05, 2)
        d.handle_timer(now)
    d.handle(Message("holder", chunk("origin", seq, hops=255)), now=now)
    return now


def test_a_relay_whose_copies_never_come_is_not_waited_for_nor_asked() -> None:
    """A child that has to repair what its relay should have forwarded, again and
    again, stops counting on it: it asks for what that relay owes at once, and of
    others than it."""
    d = _child()
    d.handle(Message("relay", chunk("origin", 1, hops=1)), now=0.0)
    now = RELAY_SETTLE_S  # its relay since 0.0: long enough to be judged
    for seq in range(2, 2 + RELAY_MISSES):
        now = _repair(d, seq, now) + 2.0  # the relay's copy never comes
        d.handle_timer(now)
    assert set(d.distrusted) == {"relay"} and d.relays_distrusted == 1
    for holder in ("relay", "holder"):  # the relay announces it too: it is not asked
        d.handle(Message(holder, Heads((("origin", 20),))), now=now)
    asked_at, wants = now, list[tuple[str, object]]()
    while not wants:
        asked_at = round(asked_at + 0.05, 2)
        d.handle_timer(asked_at)
        wants = [(p, m.body) for p, m in d.messages_to_send() if isinstance(m.body, Want)]
    assert asked_at - now <= 0.11 < SETTINGS.repair_after_s  # a tick, not the repair wait
    assert all(p != "relay" for p, _ in wants)
    d.handle_timer(now + DISTRUST_S + 1.0)
    assert not d.distrusted  # its chance again


def test_a_relay_is_not_judged_for_chunks_sent_while_the_trees_changed() -> None:
    """While a new link state spreads, nodes briefly disagree on who relays to whom:
    a chunk this node's new relay was never told to send is no miss of it. Only a
    relay this node has had for ``RELAY_SETTLE_S`` before a chunk is judged for it."""
    relays = iter(["old", *["new"] * 100])
    d = Disseminator(
        "me",
        SETTINGS,
        children=lambda origin, route, size: [],
        live=lambda: ["me", "origin", "old", "new", "holder", "holder2"],
        identities=identities("me", "origin"),
        parent=lambda origin, route, size: next(relays),
    )
    d.handle(Message("old", chunk("origin", 1, hops=1)), now=0.0)
    now = 10.0  # the trees changed: "new" is its relay from the next chunk on
    for seq in range(2, 2 + RELAY_MISSES):
        now = _repair(d, seq, now) + 0.3
        d.handle_timer(now)
    now += 2.0
    d.handle_timer(now)
    assert not d.distrusted


def test_a_relay_whose_copies_come_late_after_its_own_repair_keeps_its_place() -> None:
    """A relay whose own relay dropped a chunk repairs it and forwards it then: its
    copy comes after this node's repair, late, and that is not a miss."""
    d = _child()
    d.handle(Message("relay", chunk("origin", 1, hops=1)), now=0.0)
    now = RELAY_SETTLE_S  # its relay since 0.0: long enough to be judged
    for seq in range(2, 2 + 3 * RELAY_MISSES):
        now = _repair(d, seq, now)
        d.handle(Message("relay", chunk("origin", seq, hops=254)), now=now + 0.4)
        now += 2.0
        d.handle_timer(now)
    assert not d.distrusted and d.relays_distrusted == 0
