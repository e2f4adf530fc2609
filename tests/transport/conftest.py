"""Fixtures for transport tests: a cluster CA and nodes holding its credentials."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
import pytest_asyncio
from cryptography import x509

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.config import TransportSection
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport import backend
from ciuic_p2p.transport.quic import QuicTransport

NOW = dt.datetime.now(dt.UTC)
FAST = TransportSection(auth_timeout_s=0.5, stall_timeout_s=1.0, connect_timeout_s=3.0)


@dataclass
class Cluster:
    ca: ClusterCA
    trust: Trust

    def node_credentials(self) -> tuple[NodeKey, x509.Certificate]:
        key = NodeKey.generate()
        return key, self.ca.issue(key.public_key, NOW)


@pytest.fixture
def cluster() -> Cluster:
    ca = ClusterCA.create("test-cluster", NOW)
    return Cluster(ca, Trust(ca.certificate))


NodeFactory = Callable[..., Awaitable[QuicTransport]]


BACKENDS = list(backend.OFFERED)
"""Every transport test runs on every QUIC backend offered (transport.backend)."""


@pytest.fixture(params=BACKENDS)
def quic_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest_asyncio.fixture
async def make_node(cluster: Cluster, quic_backend: str) -> AsyncIterator[NodeFactory]:
    nodes: list[QuicTransport] = []

    async def factory(
        trust: Trust | None = None,
        settings: TransportSection = FAST,
        credentials: tuple[NodeKey, x509.Certificate] | None = None,
    ) -> QuicTransport:
        key, cert = credentials or cluster.node_credentials()
        settings = dataclasses.replace(settings, quic_backend=quic_backend)  # type: ignore[arg-type]
        node = QuicTransport(key, cert, trust or cluster.trust, settings=settings)
        await node.start()
        nodes.append(node)
        return node

    yield factory
    for node in nodes:
        await node.close()
