"""What a node may choose as its QUIC library, and what it refuses."""

from __future__ import annotations

import dataclasses
import importlib.metadata

import pytest
from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic.configuration import QuicConfiguration as AioquicConfiguration
from aioquic.quic.connection import QuicConnection as AioquicConnection
from aioquic.quic.packet import pull_quic_header

from ciuic_p2p.config import config_from_toml
from ciuic_p2p.core.link.frames import FrameType
from ciuic_p2p.errors import ConfigError
from ciuic_p2p.transport import backend
from ciuic_p2p.transport.base import FrameReceived
from ciuic_p2p.transport.gate import InitialGate, Open, Reply
from ciuic_p2p.transport.quic import QuicTransport
from tests.transport.conftest import FAST, Cluster
from tests.transport.test_quic import next_of


def test_both_backends_are_offered_and_installed() -> None:
    assert set(backend.OFFERED) == {"aioquic", "qh3"}
    assert [backend.unsupported_reason(name) for name in backend.OFFERED] == [None, None]


@pytest.mark.parametrize(
    ("found", "refused"),
    [
        ("1.9.4", False),
        ("1.12.0", False),
        ("1.10rc1", False),
        ("2.1.0", False),
        ("2.4.1", False),
        ("2.0.4", True),
        ("1.8.1", True),
        ("3.0.0", True),
    ],
)
def test_qh3_is_taken_only_in_its_tested_lines(
    monkeypatch: pytest.MonkeyPatch, found: str, refused: bool
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: found)
    reason = backend.unsupported_reason("qh3")
    assert (reason is not None) == refused
    if refused:
        assert reason is not None and found in reason and "2.1 <= qh3 < 3" in reason
        with pytest.raises(ValueError, match=r"needs 1\.9 <= qh3 < 2 or 2\.1 <= qh3 < 3"):
            backend.QuicBackend("qh3")


def test_reno_needs_aioquic() -> None:
    with pytest.raises(ConfigError, match="qh3 always runs CUBIC"):
        config_from_toml('[transport]\ncongestion_control = "reno"\n')
    cfg = config_from_toml('[transport]\ncongestion_control = "reno"\nquic_backend = "aioquic"\n')
    assert cfg.transport.congestion_control == "reno"


def test_qh3_without_package_metadata_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert "no version to check" in str(backend.unsupported_reason("qh3"))


@pytest.mark.network
@pytest.mark.parametrize("dialer", ["aioquic", "qh3"])
async def test_the_two_libraries_interoperate_both_ways(cluster: Cluster, dialer: str) -> None:
    """A mesh may mix them (upgraded node by node): each dials the other, they
    authenticate and carry control and bulk frames both ways. A qh3 2.x server answers
    aioquic's padded first datagram with a Retry (transport.backend)."""
    nodes: list[QuicTransport] = []
    try:
        for name in (dialer, "aioquic" if dialer == "qh3" else "qh3"):
            key, cert = cluster.node_credentials()
            settings = dataclasses.replace(FAST, quic_backend=name)  # type: ignore[arg-type]
            node = QuicTransport(key, cert, cluster.trust, settings=settings)
            await node.start()
            nodes.append(node)
        a, b = nodes
        assert await a.connect((b.host, b.port)) == b.local_key
        bulk = bytes(range(256)) * 4096  # 1 MiB
        await a.send(b.local_key, FrameType.CHUNK, bulk)
        await b.send(a.local_key, FrameType.GOSSIP, b"hello")
        got = await next_of(b, FrameReceived)
        assert isinstance(got, FrameReceived) and got.payload == bulk
        back = await next_of(a, FrameReceived)
        assert isinstance(back, FrameReceived) and back.payload == b"hello"
        retried = b.backend.retry_padded_initials and a.backend.name == "aioquic"
        assert (b.gate.retries_sent > 0) == retried
    finally:
        for node in nodes:
            await node.close()


def test_the_gate_answers_a_padded_initial_with_a_retry_where_the_library_needs_it() -> None:
    """qh3 2.x counts only the packets of a first datagram toward its anti-amplification
    budget: aioquic's Initial, padded after the packet, gets a Retry there, and is
    opened as usual elsewhere; the Initial that comes back with the token is opened."""
    conf = AioquicConfiguration(is_client=True, alpn_protocols=["x"])
    client = AioquicConnection(configuration=conf)
    addr = ("192.0.2.7", 4433)
    client.connect(addr, now=0.0)
    first = client.datagrams_to_send(now=0.0)[0][0]
    header = pull_quic_header(Buffer(data=first), host_cid_length=8)
    assert header.packet_length < len(first)  # padded after the packet
    versions = [header.version or 1]
    assert isinstance(InitialGate(FAST, versions).decide(header, len(first), addr, 0.0), Open)
    gate = InitialGate(FAST, versions, retry_padded=True)
    answer = gate.decide(header, len(first), addr, 0.0)
    assert isinstance(answer, Reply) and gate.retries_sent == 1 and gate.opened_total == 0
    client.receive_datagram(answer.data, addr, now=0.01)
    again = client.datagrams_to_send(now=0.01)[0][0]
    retried = pull_quic_header(Buffer(data=again), host_cid_length=8)
    assert retried.token and isinstance(gate.decide(retried, len(again), addr, 0.01), Open)
