"""What a stranger (no credential, any source address) can cost a node: findings 1, 3,
8 and 9 of the hardening issue. Datagrams come from many addresses of 127.0.0.0/8;
every flood is bounded in count."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import io
import logging
import random
import time

import pytest
from cryptography.hazmat.primitives import serialization

from ciuic_p2p.config import LogSection
from ciuic_p2p.core.link.auth import ServerAdmission, build_auth, check_auth
from ciuic_p2p.core.link.frames import FrameType, encode_frame
from ciuic_p2p.errors import AdmissionError, CiuicError
from ciuic_p2p.guard import Guard, install_loop_handler
from ciuic_p2p.logsetup import configure_logging
from ciuic_p2p.transport.base import FrameReceived
from tests.hostile.attack import Sprayer, client_hello, long_header, random_datagrams, source_hosts
from tests.transport.conftest import FAST, NOW, Cluster, NodeFactory
from tests.transport.rawclient import RawClient
from tests.transport.test_quic import next_of

pytestmark = pytest.mark.network


async def seen_by_gate(server: object, count: int, timeout_s: float = 10.0) -> None:
    """Until the gate has decided about ``count`` datagrams (they are sent faster than
    the node, in this same process, reads them)."""
    gate = server.gate  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    while gate.opened_total + gate.retries_sent + sum(gate.dropped.values()) < count:
        assert time.monotonic() < deadline, "the datagrams did not all arrive"
        await asyncio.sleep(0.01)


async def good_exchange(make_node: NodeFactory, server: object) -> None:
    """A member connects and one frame gets through: the node still serves."""
    good = await make_node()
    await good.connect((server.host, server.port))  # type: ignore[attr-defined]
    await good.send(server.local_key, FrameType.GOSSIP, b"still there?")  # type: ignore[attr-defined]
    got = await next_of(server, FrameReceived, peer=good.local_key)  # type: ignore[arg-type]
    assert isinstance(got, FrameReceived) and got.payload == b"still there?"


async def test_datagrams_of_versions_we_do_not_speak_make_no_state_and_raise_nothing(
    make_node: NodeFactory,
) -> None:
    """Finding 1: about 8 such datagrams of 1200 bytes made aioquic raise IndexError in
    two loop callbacks each; the log limiter's DropEvent then went out through the
    loop's exception handler and the daemon exited with status 1 (the process test in
    test_daemon_attacks.py runs it against `ciuic-node run`)."""
    configure_logging(LogSection(format="json"), stream=io.StringIO())
    loop_guard = Guard("test-loop")
    install_loop_handler(asyncio.get_running_loop(), loop_guard)
    server = await make_node()
    rng = random.Random(1)
    floods = [long_header(0x1A2A3A4A, rng=rng) for _ in range(200)]
    floods += [long_header(0, rng=rng), long_header(0xFF00001D, rng=rng)]  # VN, a draft
    floods += random_datagrams(300, seed=2)
    sprayer = Sprayer(source_hosts(100))
    try:
        await sprayer.spray((server.host, server.port), floods)
        await seen_by_gate(server, len(floods))
        await good_exchange(make_node, server)
    finally:
        sprayer.close()
    assert server.gate.dropped["unsupported QUIC version"] >= 200
    assert server.guard.total == 0 and loop_guard.total == 0
    assert server.gate.pending == 0  # nothing was made of them


async def test_a_fault_in_a_loop_callback_is_counted_and_the_loop_goes_on() -> None:
    """Finding 1, in general: any exception repeated about 10 times a minute in a loop
    callback ended the daemon (a full disk's ENOSPC did)."""
    configure_logging(LogSection(format="json"), stream=io.StringIO())
    guard = Guard("test-loop")
    loop = asyncio.get_running_loop()
    install_loop_handler(loop, guard)

    def full_disk() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    for _ in range(50):
        loop.call_soon(full_disk)
        logging.getLogger("quic").warning("the same library warning, again")
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert guard.counts["loop"] == 50
    assert guard.call("datagram", full_disk) is None and guard.counts["datagram"] == 1


async def test_fake_initials_past_the_threshold_get_a_retry_and_cost_no_state(
    make_node: NodeFactory,
) -> None:
    """Finding 3: each fake Initial cost 1.4 ms of CPU, a pending connection for 2 s and
    an audit entry; nothing capped them (200k in 60 s pinned a core)."""
    settings = dataclasses.replace(FAST, retry_above_pending=8, auth_timeout_s=1.0)
    server = await make_node(settings=settings)
    rng = random.Random(3)
    fakes = [long_header(1, rng=rng) for _ in range(3000)]
    sprayer = Sprayer(source_hosts(500))
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, server.gate.pending)
            await asyncio.sleep(0.005)

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await sprayer.spray((server.host, server.port), fakes)
        await good_exchange(make_node, server)  # a member gets in meanwhile (via Retry)
        await seen_by_gate(server, len(fakes))
    finally:
        watcher.cancel()
        sprayer.close()
    assert peak <= settings.retry_above_pending + 1  # + the good node's own
    assert server.gate.retries_sent >= 2900
    assert server.gate.opened_total <= settings.retry_above_pending + 2
    deadline = time.monotonic() + 5
    while server.gate.pending > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert server.gate.pending == 0  # the fakes' few connections timed out and settled


async def test_pending_connections_are_capped_per_network_and_in_all(
    make_node: NodeFactory,
) -> None:
    """Finding 3: no cap on pending connections: idle handshakes (completed, then no
    AUTH) held memory and a slot for auth_timeout_s each, as many as were sent."""
    settings = dataclasses.replace(
        FAST,
        max_pending_connections=10,
        max_pending_per_prefix=4,
        retry_above_pending=1000,
        auth_timeout_s=4.0,
    )
    server = await make_node(settings=settings)
    addr = (server.host, server.port)

    async def idle_handshake(host: str) -> RawClient | None:
        try:
            return await RawClient.connect(addr, local_host=host, timeout_s=1.5)
        except TimeoutError:
            return None

    one_network = [f"127.9.0.{i}" for i in range(2, 10)]  # 8 hosts, one /24
    many = [f"127.9.{i}.2" for i in range(1, 13)]  # 12 networks
    clients = await asyncio.gather(*(idle_handshake(h) for h in one_network))
    assert sum(c is not None for c in clients) == 4
    more = await asyncio.gather(*(idle_handshake(h) for h in many))
    assert sum(c is not None for c in more) == 6  # 10 in all
    assert server.gate.pending == 10
    assert server.gate.dropped["too many connections pending from one network"] >= 4
    assert server.gate.dropped["too many connections pending"] >= 6
    for c in clients + more:
        if c is not None:
            c.close()
    deadline = time.monotonic() + 8
    while server.gate.pending and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert server.gate.pending == 0 and server.refused >= 10  # timed out, settled
    await good_exchange(make_node, server)


async def test_new_connections_past_the_handshake_rate_are_dropped(
    make_node: NodeFactory,
) -> None:
    """Finding 9: stranger load (500 idle handshakes, 20k ClientHellos) took the loop
    from the members, who then suspected the node. A TLS handshake is about 1.5 ms of
    CPU here: the rate caps what strangers can take."""
    settings = dataclasses.replace(FAST, handshakes_per_s=20, retry_above_pending=10_000)
    server = await make_node(settings=settings)
    addr = (server.host, server.port)
    # Initials the gate would open a connection for (not answer with a Retry).
    padded_after = not server.backend.retry_padded_initials
    hellos = [client_hello(addr, padded_after) for _ in range(400)]
    sprayer = Sprayer(source_hosts(200, first_octet=2))
    t0 = time.monotonic()
    try:
        await sprayer.spray(addr, hellos)
    finally:
        sprayer.close()
    await seen_by_gate(server, len(hellos))
    elapsed = time.monotonic() - t0
    assert server.gate.opened_total <= 20 + 20 * elapsed + 1
    assert server.gate.dropped["handshake rate limit"] >= 400 - server.gate.opened_total - 5
    await asyncio.sleep(1.1)  # the bucket refills: members still get in
    await good_exchange(make_node, server)


def _mutate(der: bytes, old: bytes, new: bytes) -> bytes:
    assert old in der
    return der.replace(old, new, 1)


def crafted_certificates(cluster: Cluster) -> dict[str, bytes]:
    """Certificates whose fields the cryptography library refuses to parse, each in
    its own way (a fuzzer found them): at load, on the issuer, on a name's type."""
    _, cert = cluster.node_credentials()
    der = cert.public_bytes(serialization.Encoding.DER)
    cn = b"\x06\x03\x55\x04\x03\x0c"  # commonName, UTF8String
    org = b"\x06\x03\x55\x04\x0a\x0c"  # organizationName, UTF8String
    at = der.index(cn) + len(cn) + 1  # the issuer's CN value
    return {
        "InvalidVersion": _mutate(der, b"\xa0\x03\x02\x01\x02", b"\xa0\x03\x02\x01\x05"),
        "ValueError": der[:at] + b"\x85" + der[at + 1 :],  # not UTF-8
        "TypeError": _mutate(der, org, org[:-1] + b"\x03"),  # a BIT STRING name
    }


def auth_payload(der: bytes) -> bytes:
    return bytes([1]) + len(der).to_bytes(2, "little") + der + bytes(64)


@pytest.mark.parametrize("kind", ["InvalidVersion", "ValueError", "TypeError"])
def test_certificates_that_break_the_parser_are_typed_refusals(cluster: Cluster, kind: str) -> None:
    """Finding 8: check_auth and Trust.verify let x509.InvalidVersion, ValueError and
    TypeError through; the connection then lived to the 2 s timer, logged with the
    wrong reason."""
    payload = auth_payload(crafted_certificates(cluster)[kind])
    with pytest.raises(AdmissionError):
        check_auth(payload, cluster.trust, NOW, b"k" * 32, b"c" * 8, b"d" * 8)
    admission = ServerAdmission(cluster.trust, b"k" * 32, b"c" * 8, b"d" * 8)
    with pytest.raises(AdmissionError):
        admission.receive(encode_frame(FrameType.AUTH, payload), NOW)


def test_mutated_proofs_raise_only_typed_errors(cluster: Cluster) -> None:
    """The same, over 3000 seeded mutations of a valid proof (the fuzz target in
    tests/hostile/fuzz_preauth.py goes much further)."""
    key, cert = cluster.node_credentials()

    valid = build_auth(
        key,
        cert.public_bytes(serialization.Encoding.DER),
        "test-cluster",
        b"k" * 32,
        b"c" * 8,
        b"d" * 8,
    )
    rng = random.Random(8)
    for _ in range(3000):
        mutated = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        with contextlib.suppress(CiuicError):
            check_auth(bytes(mutated), cluster.trust, NOW, b"k" * 32, b"c" * 8, b"d" * 8)


async def test_known_member_sources_get_in_while_strangers_hold_every_slot(
    cluster: Cluster,
) -> None:
    """Review: a stranger that follows the Retry from a few networks held every pending
    slot, and a member's (re)join failed. Addresses where a member was authenticated
    before are exempt from the caps (not from the Retry)."""
    from ciuic_p2p.transport.quic import QuicTransport  # noqa: PLC0415

    settings = dataclasses.replace(
        FAST, max_pending_connections=4, max_pending_per_prefix=2, auth_timeout_s=4.0
    )
    key, cert = cluster.node_credentials()
    server = QuicTransport(
        key, cert, cluster.trust, settings=settings, known_source=lambda a: a[0] == "127.0.0.1"
    )
    await server.start()
    member_key, member_cert = cluster.node_credentials()
    member = QuicTransport(member_key, member_cert, cluster.trust, settings=FAST)
    await member.start()
    strangers = []
    try:
        for host in ("127.8.1.2", "127.8.1.3", "127.8.2.2", "127.8.2.3", "127.8.3.2"):
            with contextlib.suppress(TimeoutError):
                strangers.append(await RawClient.connect((server.host, server.port), host, 1.5))
        assert server.gate.pending == 4 and len(strangers) == 4  # every slot held
        assert await member.connect((server.host, server.port)) == server.local_key
    finally:
        for c in strangers:
            c.close()
        await member.close()
        await server.close()
