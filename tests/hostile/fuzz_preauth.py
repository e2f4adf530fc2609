#!/usr/bin/env python3
"""Coverage-guided fuzzing of the path a stranger reaches before authentication.

Each input goes, unhandled, to one of the two functions the node itself calls with a
stranger's bytes:

- ``QuicTransport.receive_datagram``: what the UDP socket calls for every datagram
  (the gate, aioquic's header parsing and decryption, connection set-up). It never
  raises by design (ciuic_p2p.guard counts what it cannot handle), so the target
  re-raises anything the transport's guard caught: an ``internal_error`` is a failure;
- ``LinkSession.receive`` of an accepting link session (core.link.session): what
  both transports call with a pre-auth link's control-stream bytes (framing, ``AUTH``,
  ``check_auth``, the certificate checks of ``Trust.verify``). It ends a session with
  a ``Closed`` event and never raises: anything that comes out is a failure.

Seeds: a real client Initial, valid and broken ``AUTH`` frames with a real node
certificate of the cluster, and the certificates a fuzzer once found to break the
parser.

    python tests/hostile/fuzz_preauth.py -runs=1000000   # atheris (libFuzzer)
    python tests/hostile/fuzz_preauth.py --mutate 20000  # seeded, no atheris

With atheris the corpus is kept in ``~/.cache/ciuic-p2p/fuzz-preauth`` (or a
directory named on the command line), seeded on first use.

With atheris (``pip install atheris``) it is coverage-guided; without it, ``--mutate N``
runs N seeded random mutations of the seeds (what ``make test`` runs, briefly, when
atheris is missing). Either way it exits 0 only if no input made either function raise
or the transport's guard catch anything.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import LogSection, TransportSection
from ciuic_p2p.core.link.auth import build_auth
from ciuic_p2p.core.link.frames import FrameType, encode_frame
from ciuic_p2p.core.link.session import Lane, LinkSession, LocalIdentity
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.logsetup import configure_logging
from ciuic_p2p.transport.quic import QuicTransport

NOW = dt.datetime(2026, 12, 1, tzinfo=dt.UTC)
SOURCE = ("127.3.0.1", 4433)


def _client_initial(addr: tuple[str, int]) -> bytes:
    from aioquic.quic.configuration import QuicConfiguration  # noqa: PLC0415
    from aioquic.quic.connection import QuicConnection  # noqa: PLC0415

    from ciuic_p2p.transport.link import ALPN  # noqa: PLC0415

    quic = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=[ALPN]))
    quic.connect(addr, now=0.0)
    return quic.datagrams_to_send(now=0.0)[0][0]


class Target:
    """One transport and one cluster, built once; :meth:`one` per input."""

    def __init__(self) -> None:
        # The node's own logging (rate-limited JSON), written nowhere: part of the path.
        self._devnull = open(os.devnull, "w")  # noqa: SIM115 (closed by close())
        configure_logging(LogSection(format="json"), stream=self._devnull)
        self.ca = ClusterCA.create("fuzz", NOW - dt.timedelta(days=1))
        self.trust = Trust(self.ca.certificate)
        key = NodeKey.generate()
        self.key = key
        cert = self.ca.issue(key.public_key, NOW - dt.timedelta(days=1))
        self.transport = QuicTransport(key, cert, self.trust, wallclock=lambda: NOW)
        self.identity = LocalIdentity(key, cert.public_bytes(serialization.Encoding.DER))
        self.settings = TransportSection()
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self.transport.start())
        member_key = NodeKey.generate()
        member = self.ca.issue(member_key.public_key, NOW - dt.timedelta(days=1))
        der = member.public_bytes(serialization.Encoding.DER)
        proof = build_auth(member_key, der, "fuzz", key.public_key, b"s" * 8, b"o" * 8)
        self.seeds = [
            b"\x00" + _client_initial((self.transport.host, self.transport.port)),
            b"\x01" + encode_frame(FrameType.AUTH, proof),
            b"\x01" + encode_frame(FrameType.AUTH, proof[:-1] + b"\x00"),
            b"\x01" + encode_frame(FrameType.AUTH, proof) + encode_frame(FrameType.GOSSIP, b"hi"),
            b"\x01" + encode_frame(FrameType.PING, b"x" * 16),
        ]
        for old, new in ((b"\xa0\x03\x02\x01\x02", b"\xa0\x03\x02\x01\x05"),):
            bad = der.replace(old, new, 1)
            self.seeds.append(b"\x01" + encode_frame(FrameType.AUTH, proof.replace(der, bad, 1)))
        self.inputs = 0

    def one(self, data: bytes) -> None:
        """Feed one input (see the module docstring); raises on any failure."""
        self.inputs += 1
        if not data:
            return
        if data[0] & 1 == 0:
            self.loop.run_until_complete(self._datagram(data[1:]))
            caught = self.transport.guard.last
            if caught is not None:
                self.transport.guard.last = None
                raise AssertionError(f"internal error on a datagram: {caught!r}") from caught
        else:  # the control stream's bytes, to the accepting link session itself
            session = LinkSession(
                dialed=False,
                identity=self.identity,
                trust=self.trust,
                settings=self.settings,
                now=0.0,
            )
            session.bind_server(b"s" * 8, b"o" * 8)
            session.receive(Lane.CONTROL, data[1:], 0.0, NOW)  # events only, never raises
            while session.next_event() is not None:
                pass

    def close(self) -> None:
        self.loop.run_until_complete(self.transport.close())
        self.loop.close()
        self._devnull.close()

    async def _datagram(self, data: bytes) -> None:
        self.transport.receive_datagram(data, SOURCE)
        await asyncio.sleep(0)  # let what it scheduled run (transmits, timers)


def mutate(rng: random.Random, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(4)
        if op == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 1 and data:
            del data[rng.randrange(len(data)) :][: rng.randint(1, 64)]
        elif op == 2:
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 32))
        elif data:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    return bytes(data)


def run_mutations(count: int, seed: int = 0, report: Callable[[str], None] = print) -> int:
    """``count`` seeded mutations of the seeds; the number of inputs run."""
    target = Target()
    rng = random.Random(seed)
    t0 = time.perf_counter()
    try:
        for _ in range(count):
            target.one(mutate(rng, rng.choice(target.seeds)))
    finally:
        target.close()
    report(f"fuzz_preauth: {target.inputs} inputs in {time.perf_counter() - t0:.1f} s, typed only")
    return target.inputs


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[1] == "--mutate":
        run_mutations(int(argv[2]) if len(argv) > 2 else 10_000)
        return 0
    import atheris  # type: ignore[import-untyped]  # noqa: PLC0415

    target = Target()
    atheris.instrument_all()  # our code and aioquic's and cryptography's Python, loaded now
    corpus = [Path(arg) for arg in argv[1:] if not arg.startswith("-")]
    if not corpus:  # kept between runs: each run starts where the last one got to
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        corpus = [cache / "ciuic-p2p" / "fuzz-preauth"]
        argv = [*argv, str(corpus[0])]
    corpus[0].mkdir(parents=True, exist_ok=True)
    if not any(corpus[0].iterdir()):  # libFuzzer starts from the seeds
        for i, seed in enumerate(target.seeds):
            (corpus[0] / f"seed-{i}").write_bytes(seed)
    atheris.Setup(argv, target.one)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
