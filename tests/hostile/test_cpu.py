"""Bounded CPU per member and an endpoint one local user cannot block (issue 44, point 6).

- A member carried 184 fresh certificates in every gossip frame, from a pool of 5,000
  that flushed the 4,096-entry refusal cache: every one cost a certificate check, and a
  node spent a whole core on them (honest updates took 622 ms instead of 31). Now each
  sender's credential checks are bounded by its own token bucket
  (core.mesh.identities): what lies past it is dropped unchecked and counted, and no
  other sender pays for it.
- 64 half-open HTTP connections from another local account left ``/metrics`` and
  ``/api/status`` answering 0 of 12 requests (daemon.web).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import time
from pathlib import Path

import aiohttp
import pytest

from ciuic_p2p.admission import Trust
from ciuic_p2p.config import WebSection
from ciuic_p2p.core.mesh.identities import CHECK_BURST, CHECKS_PER_S, Identities
from ciuic_p2p.core.mesh.messages import MAX_MESSAGE_BYTES, update_size
from ciuic_p2p.daemon.web import WebServer
from ciuic_p2p.errors import AdmissionError
from tests.hostile.attack import fresh_certificates
from tests.hostile.harness import HonestMesh, until

# -- the core: one sender's checks, on virtual time ------------------------------------------


class Checks:
    """A credential check that counts its calls: ``ok`` credentials are accepted."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, node: str, credential: bytes) -> bytes:
        self.calls += 1
        if credential.startswith(b"ok"):
            return bytes(32)
        raise AdmissionError("not a certificate of the cluster")


def identities(check: Checks) -> Identities:
    return Identities("me", b"ok-me", lambda data: bytes(64), check)


def test_a_pool_of_fresh_credentials_costs_its_sender_a_bounded_number_of_checks() -> None:
    check = Checks()
    ids = identities(check)
    check.calls = 0
    # 5,000 distinct bad credentials, 500 a second for 10 s (virtual time), cycled twice.
    for i in range(10_000):
        now = i / 500
        assert not ids.learn(f"n{i % 5000}", b"bad %d" % (i % 5000), sender="liar", now=now)
    assert check.calls <= CHECK_BURST + CHECKS_PER_S * 20 + 1
    assert ids.counters["credentials_unchecked"] >= 10_000 - check.calls - 64
    # Meanwhile an honest sender's first announcement of a new member is taken at once.
    assert ids.learn("new", b"ok-new", sender="honest", now=20.0)
    assert ids.knows("new")


def test_an_honest_sender_announcing_many_members_at_once_is_not_throttled() -> None:
    """A member's sync answer carries every member's credential at one instant."""
    ids = identities(Checks())
    assert all(ids.learn(f"m{i}", b"ok %d" % i, sender="seed", now=0.0) for i in range(2000))
    assert ids.counters["credentials_unchecked"] == 0


def test_a_liars_refusals_never_spend_an_honest_senders_checks() -> None:
    """Buckets are per sender: the liar's empty one leaves the others' full."""
    ids = identities(Checks())
    for i in range(1000):
        ids.learn(f"x{i}", b"bad %d" % i, sender="liar", now=0.0)
    refused = [ids.learn(f"y{i}", b"bad", sender="skewed", now=0.0) for i in range(CHECK_BURST)]
    assert refused == [False] * CHECK_BURST
    assert ids.counters["credentials_unchecked"] == 1000 - CHECK_BURST  # only the liar's


def test_a_credential_accepted_before_is_not_checked_again() -> None:
    check = Checks()
    ids = identities(check)
    assert ids.learn("m", b"ok-m", sender="a", now=0.0)
    ids.forget("m")
    calls = check.calls
    assert ids.learn("m", b"ok-m", sender="b", now=1.0)
    assert check.calls == calls and ids.counters["credentials_cached"] == 1
    ids.recheck()  # the trust changed: what was accepted under the old one is checked again
    ids.forget("m")
    assert ids.learn("m", b"ok-m", sender="b", now=2.0)
    assert check.calls > calls


def test_a_refusal_repeated_by_its_sender_costs_no_check() -> None:
    check = Checks()
    ids = identities(check)
    for t in range(100):
        assert not ids.learn("revoked", b"bad", sender="a", now=float(t))
    assert check.calls == 2  # its own credential at construction, then one check
    assert ids.counters["credentials_unchecked"] == 0


# -- the daemons: a member's flood of certificates ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class CountingTrust(Trust):
    """The cluster's trust, counting the credentials it checks by node name."""

    checked: list[str] = dataclasses.field(default_factory=list, compare=False)

    def check_member(self, node: str, der: bytes, now: dt.datetime) -> bytes:
        self.checked.append(node)
        return super().check_member(node, der, now)


@pytest.mark.network
async def test_a_flood_of_fresh_certificates_costs_bounded_checks_and_delays_no_chunk(
    tmp_path: Path,
) -> None:
    pool = fresh_certificates(5000)
    names = {c.node for c in pool}
    per_frame = (MAX_MESSAGE_BYTES - 256) // update_size(pool[0])  # about 170
    mesh = HonestMesh(tmp_path, ["a", "b", "c"])
    trust = CountingTrust(mesh.ca.certificate)
    mesh.trust = trust
    await mesh.form()
    liar = mesh.liar()
    await liar.start()
    try:
        await liar.join("a", "b", "c")
        await until(lambda: mesh.agree([liar.peer_id]), 20, "the liar is a member everywhere")
        a, b = mesh.daemons["a"], mesh.daemons["b"]
        stop = asyncio.Event()

        async def flood() -> int:
            """40 frames a second for at most 3 s, cycling through the pool."""
            sent, t0 = 0, time.monotonic()
            while not stop.is_set() and time.monotonic() - t0 < 3.0:
                start = (sent * per_frame) % len(pool)
                await liar.gossip("a", *(pool + pool)[start : start + per_frame])
                sent += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), t0 + sent / 40 - time.monotonic())
            return sent

        def unchecked() -> int:
            return int(a.status()["credentials"].get("credentials_unchecked", 0))

        def checked() -> int:
            return sum(1 for n in trust.checked if n in names)

        t0 = time.monotonic()
        flooding = asyncio.get_running_loop().create_task(flood())
        await until(lambda: unchecked() > 0 or checked() > 2 * CHECK_BURST, 5, "the flood")
        seq = b.broadcast(b"honest, during the flood")
        took = await until(
            lambda: (b.peer_id, seq) in mesh.origins_delivered("a"), 5, "b's chunk at a"
        )
        # A member joining meanwhile is announced to a by the others, and taken.
        d = await mesh.start("d")
        await d.join(b.address)
        joined = await until(lambda: d.peer_id in a.mesh.view(), 5, "a takes the newcomer")
        frames = await flooding
        elapsed = time.monotonic() - t0
        await until(lambda: unchecked() + checked() >= frames * per_frame // 2, 5, "all read")
        print(f"{frames} frames of {per_frame} certificates: {checked()} checked, ", end="")
        print(f"{unchecked()} unchecked; chunk in {took:.3f} s, newcomer in {joined:.3f} s")
        assert frames >= 60
        assert checked() <= CHECK_BURST + CHECKS_PER_S * (time.monotonic() - t0 + 1)
        assert took < 1.0, took
        assert elapsed < 6.0
        # The mesh still works: the liar's lies made no member.
        await until(lambda: mesh.agree([liar.peer_id]), 10, "the views agree")
    finally:
        await liar.close()
        await mesh.close()


# -- the web endpoint: one local user's half-open connections -----------------------------------


async def get(port: int, path: str, token: str | None = None) -> int:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}", headers=headers) as response,
    ):
        await response.read()
        return response.status


@pytest.mark.network
@pytest.mark.parametrize(
    "first_bytes",
    [b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n", b""],
    ids=["part_of_a_head", "nothing"],
)
async def test_64_half_open_connections_leave_metrics_and_status_answering(
    tmp_path: Path, first_bytes: bytes
) -> None:
    async with HonestMesh(tmp_path, ["a"]) as mesh:
        await mesh.form()
        web = WebServer(mesh.daemons["a"], WebSection(port=0), token_path=tmp_path / "web.token")
        port = await web.start()
        stop = asyncio.Event()
        opened = 0

        async def hold_one() -> None:
            """One half-open request, opened again whenever the server closes it."""
            nonlocal opened
            while not stop.is_set():
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                try:
                    writer.write(first_bytes)  # and never the end of a head
                    opened += 1
                    with contextlib.suppress(ConnectionError, TimeoutError):
                        await asyncio.wait_for(reader.read(), 20)
                finally:
                    writer.close()

        holders = [asyncio.get_running_loop().create_task(hold_one()) for _ in range(64)]
        try:
            await until(lambda: opened >= 64, 5, "64 half-open connections")
            await until(lambda: web.open_connections >= 32, 5, "the server holds them")
            answered, t0 = 0, time.monotonic()
            for i in range(12):  # one every 0.1 s: held connections young and old
                await until(lambda: time.monotonic() >= t0 + i / 10, 1, "the next request")  # noqa: B023
                path, token = ("/metrics", None) if i % 2 else ("/api/status", web.token)
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    answered += await asyncio.wait_for(get(port, path, token), 2.0) == 200
            print(
                f"answered {answered} of 12 in {time.monotonic() - t0:.2f} s; {opened} opened, ",
                end="",
            )
            print(f"{web.half_open_closed} closed, {web.open_connections} open")
            assert answered == 12
            # Bounded all along: new connections get their chance to speak, half-open
            # ones that spoke are closed to make room.
            assert web.open_connections <= 2 * WebSection().max_connections
            assert web.half_open_closed >= opened - 2 * WebSection().max_connections
        finally:
            stop.set()
            for task in holders:
                task.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            await web.close()
