"""Chunk dissemination on virtual time: every live node gets every chunk exactly once."""

from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest

from ciuic_p2p.config import MeshSection
from ciuic_p2p.core.mesh.broadcast import (
    GIVE_UP_ASKS,
    MAX_ABOVE,
    MAX_ORIGINS,
    SESSION_SHIFT,
    Disseminator,
)
from ciuic_p2p.core.mesh.messages import (
    MAX_HEADS,
    MAX_MESSAGE_BYTES,
    MAX_WANT,
    Chunk,
    Heads,
    Message,
    Want,
    encode_message,
)
from ciuic_p2p.core.mesh.originlog import CLAIM_AHEAD, MAX_GAP
from ciuic_p2p.data import scenario_path
from ciuic_p2p.emulator.meshsim import SimMesh
from ciuic_p2p.emulator.scenarios import load_scenario
from tests.mesh.signing import chunk, identities

NAMES = ["Tokyo", "Singapore", "Sydney", "Frankfurt", "London", "Virginia", "SaoPaulo", "Oregon"]


def formed(mode: str = "tree", loss: float = 0.0) -> SimMesh:
    scenario = load_scenario(scenario_path("cities11")).subset(NAMES)
    if loss:
        scenario = dataclasses.replace(
            scenario,
            links={k: dataclasses.replace(v, loss=loss) for k, v in scenario.links.items()},
        )
    sim = SimMesh(scenario, MeshSection(dissemination=mode), seed=9)  # type: ignore[arg-type]
    sim.start_all(join_through="Tokyo")
    sim.run_until_true(sim.agree, limit_s=10)
    sim.run_for(15)  # every link measured and published: trees agree
    return sim


def deliveries(sim: SimMesh) -> dict[str, collections.Counter[tuple[str, int]]]:
    return {
        name: collections.Counter((d.origin, d.seq) for d in sim.take_deliveries(name))
        for name in sim.nodes
    }


@pytest.mark.parametrize("mode", ["tree", "direct", "gossip"])
def test_every_chunk_reaches_every_node_exactly_once(mode: str) -> None:
    sim = formed(mode, loss=0.01)
    sent = []
    for i in range(40):
        origin = NAMES[i % len(NAMES)]
        sent.append((origin, sim.broadcast(origin, bytes([i]) * 4096)))
        sim.run_for(0.05)
    sim.run_for(5)
    for name, got in deliveries(sim).items():
        expected = {s for s in sent if s[0] != name}
        assert set(got) == expected, name
        assert max(got.values()) == 1
    if mode == "tree":
        assert sum(n.dissemination.repaired for n in sim.nodes.values()) >= 1  # loss repaired


def test_a_relay_killed_mid_broadcast_loses_nothing_for_the_living() -> None:
    sim = formed()
    tree = sim.nodes["Tokyo"].tree("Tokyo")
    relay = next(c for c in tree["Tokyo"] if tree[c])
    below = tree[relay]
    seqs = [sim.broadcast("Tokyo", b"first" * 800)]
    sim.kill(relay)  # the chunk is on its way to the relay, which will never forward it
    for _ in range(10):
        sim.run_for(0.2)
        seqs.append(sim.broadcast("Tokyo", b"more" * 1000))
    sim.run_for(10)
    got = deliveries(sim)
    for name, counter in got.items():
        if name == "Tokyo":
            continue
        assert set(counter) == {("Tokyo", s) for s in seqs}, name
        assert max(counter.values()) == 1
    assert sum(sim.nodes[b].dissemination.repaired for b in below) >= len(below)


def test_payloads_arrive_intact_and_duplicates_are_dropped() -> None:
    sim = formed("gossip")
    payload = bytes(range(256)) * 16
    seq = sim.broadcast("Sydney", payload)
    sim.run_for(3)
    for name in sim.nodes:
        if name != "Sydney":
            (d,) = sim.take_deliveries(name)
            assert (d.origin, d.seq, d.payload) == ("Sydney", seq, payload)
    # Gossip sends each chunk to several nodes that already hold it.
    assert sum(n.dissemination.duplicates for n in sim.nodes.values()) > 0


def test_every_node_computes_the_same_trees() -> None:
    sim = formed()
    for origin in NAMES:
        trees = [node.tree(origin) for node in sim.nodes.values()]
        assert all(t == trees[0] for t in trees), origin


def test_an_unanswered_want_is_repeated_to_its_announcers_in_turn() -> None:
    """A chunk announced but never answered is asked for 0.3 s after it was announced,
    then every 0.6 s, of its recent announcers in turn: one that never answers (or a
    member that re-announces every head to draw the requests) holds up nothing."""
    settings = MeshSection(heads_interval_s=0.05, repair_after_s=0.3, chunk_retain_s=60.0)
    d = Disseminator(
        "me",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: ["me", "holder"],
        identities=identities("me", "origin"),
    )
    d.handle(Message("holder", Heads((("origin", 1),))), now=0.0)
    asked: list[tuple[float, str]] = []
    now = 0.0
    while now < 3.0:
        now = round(now + 0.05, 2)
        if now >= 1.5:
            d.handle(Message("other", Heads((("origin", 1),))), now=now)
        d.handle_timer(now)
        for peer, msg in d.messages_to_send():
            if isinstance(msg.body, Want):
                assert msg.body.seqs == (1,)
                asked.append((now, peer))
    times = [t for t, _ in asked]
    assert times[0] == pytest.approx(0.3, abs=0.06)
    assert all(
        g == pytest.approx(0.6, abs=0.06)
        for g in map(lambda p: p[1] - p[0], itertools.pairwise(times))
    )
    assert {p for t, p in asked if t < 1.5} == {"holder"}
    assert {p for t, p in asked if t > 1.5} == {"holder", "other"}


@pytest.mark.parametrize("declared_dead_first", [False, True])
def test_a_restarted_origin_is_heard_again_and_its_previous_life_is_not(
    declared_dead_first: bool,
) -> None:
    """A crashed node comes back numbering its chunks from 1 of a new session: the
    others deliver them (not take them for the previous life's, long delivered), and
    a straggler of the previous life is dropped."""
    sim = formed()
    old = [sim.broadcast("London", b"old" * 300) for _ in range(100)]
    got: collections.Counter[str] = collections.Counter()

    def all_old_delivered() -> bool:
        for name, counter in deliveries(sim).items():
            got[name] += sum(counter.values())
        return all(got[n] == len(old) for n in NAMES if n != "London")

    sim.run_until_true(all_old_delivered, limit_s=30)
    kept = sim.nodes["London"].dissemination.kept("London", old[-1])
    assert kept is not None
    straggler = kept[0]
    sim.kill("London")
    if declared_dead_first:
        sim.run_until_true(lambda: sim.all_mark("London"), limit_s=60)
    else:
        sim.run_for(0.5)  # back before anyone suspects it
    sim.start("London", join_through="Tokyo")
    sim.run_until_true(sim.agree, limit_s=30)
    new = [sim.broadcast("London", b"new" * 300) for _ in range(5)]
    sim.run_for(5)
    assert min(new) > max(old)
    for name, counter in deliveries(sim).items():
        if name != "London":
            assert set(counter) == {("London", s) for s in new}, name
            assert max(counter.values()) == 1
            assert sim.nodes[name].dissemination.restarts_seen == 1
    tokyo = sim.nodes["Tokyo"].dissemination
    dropped = tokyo.stale + tokyo.duplicates  # announcements of the old life count too
    # Its previous life's log is still kept (its gaps would be repaired): the straggler
    # is a duplicate there; once that log is gone, stale.
    sim.nodes["Tokyo"].receive_message(
        "Sydney", Message("Sydney", Chunk("London", old[-1], 3, straggler)), 0
    )
    assert sim.take_deliveries("Tokyo") == [] and tokyo.stale + tokyo.duplicates == dropped + 1


def test_what_a_restarted_origin_sent_before_it_was_heard_is_delivered() -> None:
    """A restarted daemon sends what its trainer kept while the daemon was away as
    soon as it is up, before the mesh hears it: every chunk of the origin's new
    session is expected by the nodes that knew it, not only the reorder window (64)
    before the first they hear. Before, the first of them were never asked for (a
    third of a restarted trainer's chunks in tests/train/test_daemon_restart.py)."""
    sim = formed()
    sim.broadcast("London", b"old" * 300)
    sim.run_for(3)
    deliveries(sim)
    sim.kill("London")
    sim.run_for(0.5)
    london = sim.start("London")  # not joined yet: nobody to send to
    early = [sim.broadcast("London", b"early" * 300) for _ in range(100)]
    london.join("Tokyo", sim.now)
    sim.net.poke("London")
    sim.run_until_true(sim.agree, limit_s=30)
    later = [sim.broadcast("London", b"later" * 300) for _ in range(5)]
    expected = {("London", q) for q in early + later}
    got = {n: collections.Counter[tuple[str, int]]() for n in NAMES if n != "London"}

    def arrived() -> bool:
        for name, counter in deliveries(sim).items():
            if name in got:
                got[name].update(counter)
        return all(expected <= set(c) for c in got.values())

    sim.run_until_true(arrived, limit_s=60)
    assert all(max(c.values()) == 1 for c in got.values())


def test_what_a_restarted_origins_previous_life_sent_is_repaired_from_holders() -> None:
    """A node that lagged behind an origin when the origin restarted (its daemon under
    a running trainer): the chunks of the previous life it lacks are repaired from the
    members that hold them, and delivered once; the origin's new life, which holds none,
    is not asked. Before, they were given up at the first chunk of the new session
    (213 of 690 chunks of a restarted daemon's trainer, in 1 CI run of the restart
    test): that replica's finish() waited for them in vain."""
    settings = MeshSection(heads_interval_s=0.05, repair_after_s=0.1, chunk_retain_s=30.0)
    d = Disseminator(
        "me",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: ["me", "holder", "origin"],
        identities=identities("me", "origin"),
    )
    old = list(range(1, 41))
    for seq in old[:10]:
        d.handle(Message("origin", chunk("origin", seq)), now=0.0)
    d.handle(Message("holder", Heads((("origin", old[-1]),))), now=0.0)
    new = [(1 << SESSION_SHIFT) + q for q in range(1, 6)]
    for seq in new:  # its new life's first chunks overtake the old life's last
        d.handle(Message("origin", chunk("origin", seq)), now=0.1)
    assert d.restarts_seen == 1 and d.lost == 0
    asked: set[int] = set()
    for tick in range(1, 20):
        d.handle_timer(0.1 + 0.1 * tick)
        for to, m in d.messages_to_send():
            if isinstance(m.body, Want):
                assert to == "holder" or all(q >> SESSION_SHIFT == 1 for q in m.body.seqs)
                asked.update(q for q in m.body.seqs if q >> SESSION_SHIFT == 0)
    assert asked == set(old[10:])
    for seq in old[10:]:
        d.handle(Message("holder", chunk("origin", seq, hops=255)), now=2.5)
    d.handle(Message("holder", chunk("origin", old[-1], hops=255)), now=2.5)  # twice
    got = [x.seq for x in d.take_deliveries()]
    assert sorted(got) == old + new and len(got) == len(set(got))
    assert d.lost == 0
    # Once nobody keeps that life's chunks, its log goes; a straggler is stale then.
    d.handle_timer(40.0)
    assert "origin" not in d.ended
    stale = d.stale
    d.handle(Message("holder", chunk("origin", old[0], hops=255)), now=40.0)
    assert d.take_deliveries() == [] and d.stale == stale + 1


def test_an_origin_that_left_and_came_back_is_expected_whole() -> None:
    """A daemon restarted under its trainer leaves (its members forget it), then
    comes back and at once sends what its trainer kept meanwhile. Its last chunks
    before it left still reach a node that lacked them (from a holder), and its new
    life is expected from its first chunk, whichever this node hears first. Before,
    leaving dropped its log, and the new life was taken as a stranger's: only the 64
    chunks before the first heard were expected (in CI, 213 of a restarted trainer's
    690 chunks never reached one replica)."""
    settings = MeshSection(heads_interval_s=0.05, repair_after_s=0.1, chunk_retain_s=30.0)
    live = ["me", "holder", "origin"]
    d = Disseminator(
        "me",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: live,
        identities=identities("me", "origin"),
    )
    for seq in range(1, 11):
        d.handle(Message("origin", chunk("origin", seq)), now=0.0)
    d.handle(Message("holder", Heads((("origin", 20),))), now=0.0)
    live.remove("origin")
    d.forget("origin", now=0.05)  # it left
    wanted: set[int] = set()
    for tick in range(1, 10):
        d.handle_timer(0.05 + 0.1 * tick)
        for to, m in d.messages_to_send():
            if isinstance(m.body, Want):
                assert to == "holder"
                wanted.update(m.body.seqs)
    assert wanted == set(range(11, 21))
    for seq in range(11, 21):
        d.handle(Message("holder", chunk("origin", seq, hops=255)), now=1.0)
    live.append("origin")
    new = [(1 << SESSION_SHIFT) + q for q in range(1, 201)]
    d.handle(Message("origin", chunk("origin", new[150])), now=2.0)  # heard first
    for tick in range(1, 40):
        d.handle_timer(2.0 + 0.1 * tick)
        for _, m in d.messages_to_send():
            if isinstance(m.body, Want):
                for seq in m.body.seqs:
                    d.handle(Message("origin", chunk("origin", seq, hops=255)), now=2.0)
    for seq in new[151:]:
        d.handle(Message("origin", chunk("origin", seq)), now=6.0)
    got = [x.seq for x in d.take_deliveries()]
    assert sorted(got) == list(range(1, 21)) + new and len(got) == len(set(got))
    assert d.lost == 0


def test_a_departed_origins_chunks_are_not_delivered_again_after_its_log_expired() -> None:
    """Once nobody keeps a departed origin's chunks its log goes, and where it stopped
    is kept: a slow holder's copy of a chunk delivered before is not delivered again,
    and the next one of that life is (review: the log reopened with a window of 4096
    asked for and delivered them all again)."""
    settings = MeshSection(heads_interval_s=0.05, repair_after_s=0.1, chunk_retain_s=30.0)
    live = ["me", "holder"]
    d = Disseminator(
        "me",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: live,
        identities=identities("me", "origin"),
    )
    for seq in range(1, 21):
        d.handle(Message("origin", chunk("origin", seq)), now=0.0)
    d.forget("origin", now=0.0)
    d.handle_timer(1.0)
    d.handle_timer(40.0)  # past chunk_retain_s: the ended log goes
    assert "origin" not in d.ended
    assert len(d.take_deliveries()) == 20
    d.handle(Message("holder", chunk("origin", 15, hops=255)), now=41.0)
    d.handle(Message("holder", chunk("origin", 21, hops=255)), now=41.0)
    assert [x.seq for x in d.take_deliveries()] == [21]


@pytest.mark.parametrize(
    ("resumed", "gap"),
    [(False, 150), (True, 150), (True, 10)],
    ids=["fresh", "resumed", "resumed-short-gap"],
)
def test_a_node_restarted_while_others_publish_gets_what_came_meanwhile(
    resumed: bool, gap: int
) -> None:
    """A node restarted (``systemctl restart``) while an origin published 150 chunks
    (or 10, within the reorder window): started where its previous life stopped (what
    it delivered, saved at its stop), it repairs the gap from the origin and delivers
    each chunk once, none it had delivered before. Started afresh, it took at most the
    64 before the first chunk it heard again (the reorder window): the others' updates
    of the gap never reached its trainer."""
    sim = formed()
    before = [sim.broadcast("London", b"before" * 200) for _ in range(20)]
    sim.run_for(3)
    assert set(deliveries(sim)["Sydney"]) == {("London", s) for s in before}
    saved = sim.nodes["Sydney"].dissemination.delivered()
    sim.kill("Sydney")
    meanwhile = []
    for _ in range(gap):
        meanwhile.append(sim.broadcast("London", b"meanwhile" * 200))
        sim.run_for(0.02)
    sim.start("Sydney", join_through="Tokyo", resume=saved if resumed else None)
    sim.run_until_true(sim.agree, limit_s=30)
    after = [sim.broadcast("London", b"after" * 200) for _ in range(5)]
    got: collections.Counter[tuple[str, int]] = collections.Counter()
    expected = {("London", s) for s in (meanwhile if resumed else []) + after}

    def arrived() -> bool:
        got.update(deliveries(sim)["Sydney"])
        return expected <= set(got)

    sim.run_until_true(arrived, limit_s=60)
    sim.run_for(5)
    got.update(deliveries(sim)["Sydney"])
    assert max(got.values()) == 1
    london = {s for o, s in got if o == "London"}
    assert not london & set(before)
    if resumed:
        assert sim.nodes["Sydney"].dissemination.resumed == 1
    else:
        assert len(set(meanwhile) & london) <= 64  # the reorder window, no more


def test_an_announcement_far_ahead_costs_bounded_work_and_mutes_nobody() -> None:
    """A faulty member announces an origin's chunk 2^39: the node tracks a window of
    the gap (not 2^39 entries, which hung it), asks for it in bounded WANTs, and still
    delivers the origin's real chunks as they come."""
    settings = MeshSection(heads_interval_s=0.05, repair_after_s=0.1, chunk_retain_s=60.0)
    d = Disseminator(
        "me",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: ["me", "liar"],
        identities=identities("me", "origin"),
    )
    d.handle(Message("origin", chunk("origin", 1)), now=0.0)
    d.handle(Message("liar", Heads((("origin", 1 << 39),))), now=0.0)
    log = d.logs["origin"]
    assert len(log.missing_since) <= CLAIM_AHEAD  # a claim: a window past what is held
    d.handle_timer(0.2)
    wants = [m.body for _, m in d.messages_to_send() if isinstance(m.body, Want)]
    assert wants and all(len(w.seqs) <= MAX_WANT for w in wants)
    for seq in range(2, 101):
        d.handle(Message("origin", chunk("origin", seq)), now=0.3)
    assert [x.seq for x in d.take_deliveries()] == list(range(1, 101))
    assert log.contiguous == 100 and len(log.missing_since) <= CLAIM_AHEAD
    d.handle_timer(0.4)  # the window moved on with what is held
    assert max(log.missing_since) == 100 + CLAIM_AHEAD


def test_chunks_above_a_gap_that_never_fills_are_bounded() -> None:
    """Chunks that keep arriving above a hole nobody can fill: the node holds at most
    MAX_ABOVE of them and gives the oldest gap up (counted lost), delivering all."""
    settings = MeshSection(chunk_retain_s=3600.0)
    d = Disseminator(
        "me",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: ["me", "o"],
        identities=identities("me", "o"),
    )
    d.handle(Message("o", chunk("o", 1)), now=0.0)
    count = MAX_ABOVE + 500
    for i in range(count):  # every second chunk lost on the way
        d.handle(Message("o", chunk("o", 3 + 2 * i)), now=0.0)
    log = d.logs["o"]
    assert len(log.above) <= MAX_ABOVE
    assert len(log.missing_since) <= MAX_GAP
    assert d.lost > 0 and len(d.take_deliveries()) == count + 1
    assert log.contiguous - d.lost + len(log.above) == count + 1  # each seq once: held or lost


def test_announced_origins_are_bounded() -> None:
    """HEADS naming thousands of made-up origins: none of them has a credential, so
    none gets a log or a request (each counted), while a real origin is still taken."""
    d = Disseminator(
        "me",
        MeshSection(),
        children=lambda origin, route, size: [],
        live=lambda: ["me", "real"],
        identities=identities("me", "real"),
    )
    for batch in range(3):
        heads = tuple((f"fake-{batch}-{i}", 1) for i in range(MAX_HEADS))
        d.handle(Message("liar", Heads(heads)), now=0.0)
    assert len(d.logs) == 0 and d.unknown_origins == 3 * MAX_HEADS
    d.handle_timer(10.0)
    assert [m for _, m in d.messages_to_send() if isinstance(m.body, Want)] == []
    d.handle(Message("real", chunk("real", 1)), now=0.0)
    assert [x.origin for x in d.take_deliveries()] == ["real"]
    assert len(d.logs) <= MAX_ORIGINS


def test_heads_of_thousands_of_origins_fit_one_message_and_take_turns() -> None:
    """Review: past about 1,400 origins a node's HEADS no longer fit one message, failed
    to encode, and repair stopped for every origin. Now each round announces what fits,
    from a place that moves on."""
    names = [f"ciuic{i:032d}" for i in range(3000)]
    d = Disseminator(
        "me",
        MeshSection(heads_interval_s=0.1),
        children=lambda origin, route, size: [],
        live=lambda: ["me", "peer"],
        identities=identities("me", *names),
    )
    for name in names:  # one signed chunk of each opens its log
        d.handle(Message(name, chunk(name, 5)), now=0.0)
    assert len(d.logs) == 3000
    announced: set[str] = set()
    for tick in range(1, 6):
        d.handle_timer(tick * 0.1)
        for _, msg in d.messages_to_send():
            if isinstance(msg.body, Heads):
                assert len(encode_message(msg)) <= MAX_MESSAGE_BYTES
                announced |= {origin for origin, _ in msg.body.heads}
    assert len(announced) > 2000


def test_heads_are_sent_on_a_change_and_seldom_while_nothing_changes() -> None:
    """Review: every node sent its heads to two members every 0.25 s for as long as it
    held anything: a third of an idle mesh's bytes, repeating what the receivers had
    heard. Now a change is announced at the next tick and an unchanged state every
    heads_idle_interval_s."""
    settings = MeshSection(heads_interval_s=0.25, heads_idle_interval_s=4.0)
    d = Disseminator(
        "me",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: ["peer"],
        identities=identities("me", "origin"),
    )

    def announced(t0: float, t1: float) -> list[float]:
        times = []
        for tick in range(round(t0 / 0.25) + 1, round(t1 / 0.25) + 1):
            now = tick * 0.25
            d.handle_timer(now)
            if any(isinstance(m.body, Heads) for _, m in d.messages_to_send()):
                times.append(now)
        return times

    d.handle(Message("origin", chunk("origin", 1)), now=0.0)
    first = announced(0.0, 60.0)
    assert first[0] == 0.25
    assert {b - a for a, b in itertools.pairwise(first)} == {4.0}
    assert len(first) == 15  # against 240, one every tick, before
    for seq, at in ((2, 60.1), (3, 60.3)):  # a burst of changes: each goes out next tick
        d.handle(Message("origin", chunk("origin", seq)), now=at)
        assert announced(at - 0.1, at + 0.2) == [round(at / 0.25 + 0.5) * 0.25]
    assert announced(60.5, 64.0) == []
    assert announced(64.0, 64.5) == [64.5]


def test_a_chunk_missed_long_after_the_last_change_is_still_repaired() -> None:
    """The back-off must not starve repair: a node that missed a chunk still learns of
    it from a holder's slow announcements (here the only member, so within one
    heads_idle_interval_s) and asks that holder for it."""
    settings = MeshSection(heads_interval_s=0.25, heads_idle_interval_s=4.0, repair_after_s=0.3)
    holder = Disseminator(
        "holder",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: ["late"],  # the members besides itself, as the mesh passes them
        identities=identities("holder", "late", "origin"),
    )
    holder.handle(Message("origin", chunk("origin", 1)), now=0.0)
    for tick in range(1, 200):  # 50 s: the holder is deep in its back-off
        holder.handle_timer(tick * 0.25)
        holder.messages_to_send()
    late = Disseminator(
        "late",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: ["holder"],
        identities=identities("holder", "late", "origin"),
    )
    # A node that lacks the chunk (its tree edge lost it; it holds nothing of origin).
    wanted_at = None
    for tick in range(201, 201 + 40):  # 10 s
        now = tick * 0.25
        holder.handle_timer(now)
        for dest, msg in holder.messages_to_send():
            assert dest == "late"
            late.handle(Message("holder", msg.body), now=now)
        late.handle_timer(now)
        for dest, msg in late.messages_to_send():
            if isinstance(msg.body, Want) and wanted_at is None:
                assert dest == "holder" and 1 in msg.body.seqs
                wanted_at = now
    assert wanted_at is not None and wanted_at <= 50.0 + 4.0 + 2 * 0.3 + 0.5


def test_a_change_reaches_every_member_in_turn_and_so_does_the_idle_repeat() -> None:
    """Review: after a change each holder told two random members once, then one
    random pair every 4 s, so a member that missed the last chunk of a burst waited a
    geometric number of intervals (17 s seen at 8 nodes). Now the announcements go
    round a shuffled list: every member hears of a change within ceil(7 / 2) ticks,
    and within as many idle intervals after that."""
    members = [f"m{i}" for i in range(7)]
    d = Disseminator(
        "me",
        MeshSection(heads_interval_s=0.25, heads_idle_interval_s=4.0, heads_fanout=2),
        children=lambda origin, route, size: [],
        live=lambda: members,
        identities=identities("me", "origin"),
    )
    d.handle(Message("origin", chunk("origin", 1)), now=0.0)
    told: dict[str, list[float]] = {m: [] for m in members}
    for tick in range(1, 4 * 40 + 1):  # 40 s
        now = tick * 0.25
        d.handle_timer(now)
        for dest, msg in d.messages_to_send():
            if isinstance(msg.body, Heads):
                told[dest].append(now)
    assert max(times[0] for times in told.values()) <= 4 * 0.25  # the change, at once
    for times in told.values():  # and no member waits more than 4 intervals after
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert max(gaps) <= 4 * 4.0 + 0.25
    sent = sum(len(t) for t in told.values())
    assert sent <= 7 + 2 * (40 // 4 + 1)  # against 2 x 160 before


def _lone(settings: MeshSection) -> Disseminator:
    """A node whose tree sends it nothing unless the test hands it a chunk."""
    return Disseminator(
        "me",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: ["me", "holder", "holder2", "parent"],
        identities=identities("me", "origin", "other"),
    )


def _wants(d: Disseminator) -> list[tuple[str, tuple[int, ...]]]:
    return [(p, m.body.seqs) for p, m in d.messages_to_send() if isinstance(m.body, Want)]


def _announce(
    d: Disseminator, seq: int, now: float, by: tuple[str, ...] = ("holder", "holder2")
) -> None:
    """Holders announce ``seq`` (two of them: one member's word alone starts no lag)."""
    for holder in by:
        d.handle(Message(holder, Heads((("origin", seq),))), now=now)


def _tick_until_asked(
    d: Disseminator, now: float
) -> tuple[float, list[tuple[str, tuple[int, ...]]]]:
    while True:
        now = round(now + 0.05, 2)
        d.handle_timer(now)
        if wants := _wants(d):
            return now, wants


SLOW = MeshSection(heads_interval_s=0.05, repair_after_s=0.3, chunk_retain_s=60.0)


def test_a_slow_tree_is_waited_for_not_asked_twice() -> None:
    """Large pieces on a slow link reach a node seconds after a holder announced them;
    asking for them at 0.3 s sent a second full copy of each (the repair storm of
    docs/benchmarks.md). The wait learns the tree's lag: after the first late copies
    no chunk is asked for, and the wait stays under the cap."""
    d = _lone(SLOW)
    d.handle(Message("parent", chunk("origin", 1, hops=2)), now=0.0)
    asked_for: set[int] = set()
    now = 1.0
    for seq in range(2, 12):
        announced = now
        _announce(d, seq, now)
        while now < announced + 2.0:
            now = round(now + 0.05, 2)
            d.handle_timer(now)
            asked_for |= {s for _, seqs in _wants(d) for s in seqs}
        d.handle(Message("parent", chunk("origin", seq, hops=2)), now=now)
        now = round(now + 0.5, 2)
    assert asked_for <= {2, 3, 4}, asked_for  # before two seconds of lag were measured
    assert 2.0 < d.repair_wait_s("origin") <= SLOW.repair_after_max_s
    assert d.repaired == 0 and d.duplicates == 0


def test_a_repaired_chunks_late_tree_copy_teaches_the_wait() -> None:
    """A wait set too short never sees a tree copy come first; the tree copy that
    comes after the repair, as a duplicate, is the sample (Karn's problem, reversed),
    even when a second answer came before it; a copy from another member, or one
    its origin did not sign, is not."""
    d = _lone(SLOW)
    d.handle(Message("parent", chunk("origin", 1, hops=1)), now=0.0)  # the tree's sender
    _announce(d, 2, 0.0)
    now, _ = _tick_until_asked(d, 0.0)
    assert now == pytest.approx(0.3, abs=0.06)
    d.handle(Message("holder", chunk("origin", 2, hops=255)), now=0.5)
    d.handle(Message("holder2", chunk("origin", 2, hops=255)), now=0.9)  # a second answer
    assert d.repaired == 1 and d.repair_wait_s("origin") == 0.3
    forged = dataclasses.replace(chunk("origin", 2, hops=3), signature=bytes(64))
    d.handle(Message("parent", forged), now=2.0)
    d.handle(Message("holder2", chunk("origin", 2, hops=3)), now=2.2)  # not the tree's
    assert d.repair_wait_s("origin") == 0.3 and d.duplicates == 3
    d.handle(Message("parent", chunk("origin", 2, hops=3)), now=2.5)
    assert d.repair_wait_s("origin") >= 2.5
    # A second late copy of the same chunk teaches nothing more.
    before = d.repair_wait_s("origin")
    d.handle(Message("parent", chunk("origin", 2, hops=3)), now=9.0)
    assert d.repair_wait_s("origin") == before


def test_late_copies_hold_a_repair_to_the_cap_and_no_longer() -> None:
    """A relay that forwards its copies a minute late (or one that died) can raise
    the wait to ``repair_after_max_s``, never past it: the chunk is still asked for
    then."""
    settings = MeshSection(
        heads_interval_s=0.05, repair_after_s=0.3, repair_after_max_s=4.0, chunk_retain_s=120.0
    )
    d = _lone(settings)
    d.handle(Message("parent", chunk("origin", 1, hops=1)), now=0.0)
    for seq in range(2, 7):
        _announce(d, seq, 0.0)
        d.handle(Message("parent", chunk("origin", seq, hops=1)), now=60.0 * seq)
    assert d.repair_wait_s("origin") == 4.0
    start = 400.0
    _announce(d, 7, start)
    now, _ = _tick_until_asked(d, start)
    assert now - start == pytest.approx(4.0, abs=0.06)


def test_a_relays_repairs_forwarded_down_are_not_the_trees_lag() -> None:
    """A chunk its relay had to repair (forwarded with hops 254) came as late as the
    relay's repair; waiting that long for it in future would make every node below a
    lossy relay slower to repair with each burst."""
    d = _lone(SLOW)
    d.handle(Message("parent", chunk("origin", 1, hops=1)), now=0.0)
    for seq in range(2, 7):
        _announce(d, seq, 10.0 * seq)
        d.handle(Message("parent", chunk("origin", seq, hops=254)), now=10.0 * seq + 5.0)
    assert d.repair_wait_s("origin") == 0.3


def test_one_members_claims_ahead_of_an_origin_teach_no_lag() -> None:
    """Review: a member that announces an origin's numbers before the origin sends
    them made every honest, on-time copy of them look late, and set every origin's
    wait (the fallback for origins not measured) to the cap. A number starts a lag
    sample only when a second member or a signed chunk says it exists."""
    d = _lone(SLOW)
    d.handle(Message("parent", chunk("origin", 1, hops=1)), now=0.0)
    d.handle(Message("evil", Heads((("origin", 60),))), now=0.0)
    for seq in range(2, 20):
        d.handle(Message("parent", chunk("origin", seq, hops=1)), now=50.0 + seq)
        d.handle_timer(50.0 + seq)
        _announce(d, seq, 50.0 + seq)
    assert d.repair_wait_s("origin") == 0.3
    assert d.repair_wait_s("other") == 0.3


def test_a_holder_that_answers_late_holds_up_only_what_was_asked_of_it() -> None:
    """Review: one node-wide answer lag let a member that answers every request just
    before it is repeated slow every re-ask of the node. Each holder's answers set
    the re-ask interval of what was asked of it; and only the answer to a first ask
    is a sample (an earlier ask's answer that comes after a re-ask would read as a
    quick repair)."""
    d = _lone(SLOW)
    d.handle(Message("parent", chunk("origin", 1, hops=1)), now=0.0)
    _announce(d, 2, 0.0, by=("holder",))  # the holders in turn: parent, holder
    now, first = _tick_until_asked(d, 0.0)
    now, second = _tick_until_asked(d, now)
    assert {first[0][0], second[0][0]} == {"parent", "holder"}
    d.handle(Message(second[0][0], chunk("origin", 2, hops=255)), now=now + 0.1)
    assert not any(lag.samples for lag in d.answer_lags.values())  # a second ask's answer
    _announce(d, 3, now + 1.0, by=("holder",))
    now, (ask,) = _tick_until_asked(d, now + 1.0)
    d.handle(Message(ask[0], chunk("origin", 3, hops=255)), now=now + 3.0)
    slow = ask[0]
    assert d.answer_lags[slow].samples == 1 and d.answer_lags[slow].bound_s() >= 3.0
    # A number asked of the slow holder is repeated no sooner than its answers take;
    # the next, asked of the other, at 2 x repair_after_s.
    _announce(d, 4, now + 10.0, by=("holder",))
    asked: list[tuple[float, str]] = []
    now = now + 10.0
    while now < 40.0:
        now = round(now + 0.05, 2)
        d.handle_timer(now)
        asked += [(now, peer) for peer, _ in _wants(d)]
    gaps = {peer: b - a for (a, peer), (b, _) in itertools.pairwise(asked)}
    assert gaps[slow] >= 3.0 and min(gaps.values()) <= 0.7, asked


def test_a_want_is_not_repeated_while_the_answer_is_measured_to_be_on_its_way() -> None:
    """Asking again 0.6 s after the first ask, when a repair takes 3 s to come back
    (a 1 MiB piece at 10 Mbit/s behind others), queued a second full copy."""
    d = _lone(SLOW)
    d.handle(Message("holder", chunk("origin", 1, hops=1)), now=0.0)  # the one holder
    d.handle(Message("holder", Heads((("origin", 2),))), now=0.0)
    now, wants = _tick_until_asked(d, 0.0)
    assert wants == [("holder", (2,))]
    d.handle(Message("holder", chunk("origin", 2, hops=255)), now=3.3)
    asked: list[float] = []
    d.handle(Message("holder", Heads((("origin", 3),))), now=10.0)
    now = 10.0
    while now < 16.0:
        now = round(now + 0.05, 2)
        d.handle_timer(now)
        asked += [now for _ in _wants(d)]
    assert asked[0] == pytest.approx(10.3, abs=0.06)
    assert all(b - a >= 3.0 for a, b in itertools.pairwise(asked)), asked


def test_a_number_missing_past_the_retain_time_is_still_asked_for_then_given_up() -> None:
    """On a slow round an announcer may lack the number it is asked for (it announces
    the highest it holds), a repair takes seconds to come back (so asks are seconds
    apart), and the holders that got the chunk last keep it for ``chunk_retain_s``
    from then: a number missing that long was given up after two or three asks and
    never asked for again, and the round never completed (bench/strategy.py, 2.1 MB
    on the multi-cloud matrix). It is given up only after ``GIVE_UP_ASKS`` asks too."""
    settings = MeshSection(heads_interval_s=0.25, repair_after_s=0.3, chunk_retain_s=10.0)
    d = _lone(settings)
    d.handle(Message("parent", chunk("origin", 1, hops=1)), now=0.0)
    d.handle(Message("holder", Heads((("origin", 2),))), now=0.0)
    now = 0.0
    while not _wants(d):
        now = round(now + 0.25, 2)
        d.handle_timer(now)
    d.handle(Message("holder", chunk("origin", 2, hops=255)), now=now + 3.0)  # 3 s back
    now = 4.0
    d.handle(Message("holder", Heads((("origin", 4),))), now=now)  # holds 4, lacks 3
    d.handle(Message("parent", chunk("origin", 4, hops=1)), now=now)
    answered_at = None
    while now < 60.0 and answered_at is None:
        now = round(now + 0.25, 2)
        if now == 12.0:
            d.handle(Message("late", Heads((("origin", 4),))), now=now)  # holds 3
        d.handle_timer(now)
        if any(peer == "late" for peer, _ in _wants(d)):
            d.handle(Message("late", chunk("origin", 3, hops=255)), now=now)
            answered_at = now
    assert answered_at is not None and answered_at > 4.0 + settings.chunk_retain_s
    assert d.lost == 0 and d.logs["origin"].contiguous & 0xFFFF == 4
    # Nobody holds 5: asked for in turn, then given up once retained and asked enough.
    d.handle(Message("holder", Heads((("origin", 6),))), now=now)
    d.handle(Message("parent", chunk("origin", 6, hops=1)), now=now)
    asks = 0
    end = now + 200.0
    while now < end:
        now = round(now + 0.25, 2)
        d.handle_timer(now)
        asks += sum(5 in seqs for _, seqs in _wants(d))
    assert d.lost == 1 and asks == GIVE_UP_ASKS


def test_a_number_is_asked_for_while_its_live_origin_still_holds_it() -> None:
    """Holders keep a chunk for ``chunk_retain_s``, its origin for
    ``own_chunk_retain_s``: a round of 1 MiB pieces over 5 Mbit/s links outlasted the
    first, a number given up then was never asked for again, and the round never
    ended (bench/strategy.py at rate scale 0.005). While the origin lives, its number
    is asked for until the origin's hold has passed too."""
    settings = MeshSection(
        heads_interval_s=0.25, repair_after_s=0.3, chunk_retain_s=10.0, own_chunk_retain_s=40.0
    )
    for origin_live, given_up_by in ((True, 40.0), (False, 10.0)):
        members = ["holder", "holder2"] + (["origin"] if origin_live else [])
        d = Disseminator(
            "me",
            settings,
            children=lambda origin, route, size: [],
            live=members.copy,
            identities=identities("me", "origin"),
        )
        d.handle(Message("parent", chunk("origin", 1, hops=1)), now=0.0)
        _announce(d, 3, 0.0)
        d.handle(Message("holder", chunk("origin", 3, hops=1)), now=0.0)  # 2 is missing
        now, lost_at = 0.0, None
        while now < 100.0 and lost_at is None:
            now = round(now + 0.25, 2)
            d.handle_timer(now)
            d.messages_to_send()
            if d.lost:
                lost_at = now
        assert lost_at is not None and given_up_by < lost_at < given_up_by + 5.0, origin_live


def test_a_number_no_announcer_holds_is_asked_of_its_origin() -> None:
    """Each announcer announces the highest number it holds, gaps below it or not: on
    a slow round the last four announcers may all lack a number, and asking them in
    turn stalled the round (bench/strategy.py, multi-cloud, 2.1 MB: one round of 180 s).
    Every second ask of a number goes to its origin while it lives."""
    d = Disseminator(
        "me",
        SLOW,
        children=lambda origin, route, size: [],
        live=lambda: ["me", "origin", "holder", "holder2"],
        identities=identities("me", "origin"),
    )
    d.handle(Message("origin", chunk("origin", 1, hops=0)), now=0.0)
    _announce(d, 3, 0.0)
    d.handle(Message("holder", chunk("origin", 3, hops=1)), now=0.0)  # 2 is missing
    targets: list[str] = []
    now = 0.0
    while len(targets) < 4:
        now, wants = _tick_until_asked(d, now)
        targets += [peer for peer, seqs in wants if 2 in seqs]
    assert targets[1] == targets[3] == "origin"
    assert {targets[0], targets[2]} <= {"holder", "holder2"}


def _origin(settings: MeshSection) -> Disseminator:
    return Disseminator(
        "origin",
        settings,
        children=lambda origin, route, size: [],
        live=lambda: ["origin", "me", "holder"],
        identities=identities("origin", "me"),
    )


def _answers(d: Disseminator) -> list[int]:
    return [m.body.seq for _, m in d.messages_to_send() if isinstance(m.body, Chunk)]


def test_an_origin_keeps_its_chunks_past_a_slow_round() -> None:
    """A 2.1 MB round on 10 Mbit/s uplinks takes 15-85 s (bench/strategy.py): a node
    that missed a piece asked, after the other holders' copies had gone, its origin,
    whose copy had gone at ``chunk_retain_s`` too, and the round never completed. The
    origin keeps what it published for ``own_chunk_retain_s``, and no longer."""
    settings = MeshSection(chunk_retain_s=30.0, own_chunk_retain_s=120.0)
    d = _origin(settings)
    first = d.publish(b"piece" * 100, now=0.0)
    d.messages_to_send()
    d.handle(Message("me", Want("origin", (first,))), now=40.0)
    assert _answers(d) == [first]
    second = d.publish(b"later" * 100, now=50.0)
    d.handle_timer(200.0)  # evicts what is past its time
    d.handle(Message("me", Want("origin", (first, second))), now=200.0)
    assert _answers(d) == []
    assert d.chunks.held_bytes == 0


def test_asking_for_a_chunk_keeps_it_no_longer() -> None:
    """A member's WANTs (answered or not) do not keep a chunk past its retain time, so
    they cannot pin chunks and push out those honest members still need."""
    settings = MeshSection(chunk_retain_s=30.0, chunk_retain_bytes=8_000)
    d = _lone(settings)
    d.handle(Message("parent", chunk("origin", 1, bytes(3000), hops=1)), now=0.0)
    d.handle(Message("parent", chunk("origin", 2, bytes(3000), hops=1)), now=10.0)
    for t in range(1, 29):
        d.handle(Message("holder", Want("origin", (1,))), now=float(t))
    d.messages_to_send()
    d.handle(Message("parent", chunk("origin", 3, bytes(3000), hops=1)), now=29.0)
    assert d.kept("origin", 1) is None  # the oldest goes first, asked for or not
    assert d.kept("origin", 2) is not None and d.kept("origin", 3) is not None
    d.handle_timer(41.0)
    assert d.kept("origin", 2) is None


def test_a_busy_publisher_still_holds_others_chunks() -> None:
    """A node's own chunks take at most half of ``chunk_retain_bytes``: one that
    publishes faster than the bound over ``own_chunk_retain_s`` held nobody else's
    chunks, and its children's repair asks went unanswered."""
    settings = MeshSection(chunk_retain_bytes=40_000)
    d = _lone(settings)
    d.handle(Message("parent", chunk("origin", 1, bytes(4000), hops=1)), now=0.0)
    for i in range(20):
        d.publish(bytes(4000), now=1.0 + i)
    assert d.kept("origin", 1) is not None
    assert d.chunks.held_bytes <= 40_000
    own = sum(len(v[0]) for v in d.chunks.own.values())
    assert 16_000 <= own <= 20_000


def test_held_bytes_are_bounded_and_an_origins_own_chunks_go_last() -> None:
    settings = MeshSection(chunk_retain_bytes=10_000)
    d = _lone(settings)
    own = d.publish(bytes(4000), now=0.0)
    for seq in range(1, 4):
        d.handle(Message("parent", chunk("origin", seq, bytes(4000), hops=1)), now=float(seq))
    assert d.chunks.held_bytes <= 10_000
    assert d.kept("me", own) is not None
    assert d.kept("origin", 3) is not None and d.kept("origin", 1) is None
