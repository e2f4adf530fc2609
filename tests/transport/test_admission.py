"""Every way in without valid credentials is refused, and logged and counted."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID
from structlog.testing import capture_logs

from ciuic_p2p.admission import ClusterCA, Trust
from ciuic_p2p.core.link.auth import build_auth
from ciuic_p2p.core.link.frames import FrameType, encode_frame
from ciuic_p2p.identity import NodeKey
from ciuic_p2p.transport.quic import BULK_STREAM, CONTROL_STREAM, TransportError
from tests.conftest import eventually
from tests.transport.conftest import NOW, Cluster, NodeFactory
from tests.transport.rawclient import RawClient

pytestmark = pytest.mark.network


def der(cert: object) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)  # type: ignore[attr-defined,no-any-return]


async def refused_client(server_addr: tuple[str, int], send: list[tuple[int, bytes]]) -> str:
    client = await RawClient.connect(server_addr)
    try:
        for stream, data in send:
            client.send(stream, data)
        reason = await client.wait_closed()
        assert not client.received, "the server sent application data before authentication"
        return reason
    finally:
        client.close()


async def test_client_without_credentials_is_closed_after_the_deadline(
    make_node: NodeFactory,
) -> None:
    server = await make_node()
    reason = await refused_client((server.host, server.port), [])
    assert "not authenticated in time" in reason and server.refused == 1 and not server.peers()


async def test_client_opening_a_stream_before_authenticating_is_refused(
    make_node: NodeFactory,
) -> None:
    server = await make_node()
    frame = encode_frame(FrameType.CHUNK, b"x" * 100)
    reason = await refused_client((server.host, server.port), [(BULK_STREAM, frame)])
    assert "unexpected stream" in reason and server.refused == 1


async def test_frame_other_than_auth_first_is_refused(make_node: NodeFactory) -> None:
    server = await make_node()
    frame = encode_frame(FrameType.GOSSIP, b"hi")
    reason = await refused_client((server.host, server.port), [(CONTROL_STREAM, frame)])
    assert "before authentication" in reason


async def test_replayed_proof_from_another_connection_is_refused(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    server = await make_node()
    key, cert = cluster.node_credentials()
    first = await RawClient.connect((server.host, server.port))
    # A proof made for the first connection, captured and replayed on a second one.
    proof = build_auth(
        key,
        der(cert),
        cluster.trust.cluster,
        server.local_key,
        first.server_cid(),
        first.quic.original_destination_connection_id,
    )
    first.close()
    reason = await refused_client(
        (server.host, server.port), [(CONTROL_STREAM, encode_frame(FrameType.AUTH, proof))]
    )
    assert "does not verify" in reason


async def test_valid_proof_on_a_raw_client_is_accepted(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    server = await make_node()
    key, cert = cluster.node_credentials()
    client = await RawClient.connect((server.host, server.port))
    proof = build_auth(
        key,
        der(cert),
        cluster.trust.cluster,
        server.local_key,
        client.server_cid(),
        client.quic.original_destination_connection_id,
    )
    client.send(CONTROL_STREAM, encode_frame(FrameType.AUTH, proof))
    await eventually(server.peers)
    assert server.peers() == [key.public_key] and server.refused == 0
    client.close()


@pytest.mark.parametrize("who", ["self_signed", "other_cluster", "revoked"])
async def test_nodes_without_a_valid_credential_are_refused(
    make_node: NodeFactory, cluster: Cluster, who: str
) -> None:
    if who == "revoked":
        key, cert = cluster.node_credentials()
        crl = cluster.ca.revocation_list([cert.serial_number], NOW)
        server = await make_node(trust=Trust(cluster.ca.certificate, crl))
        client = await make_node(credentials=(key, cert), trust=cluster.trust)
        expected = "revoked"
    else:
        server = await make_node()
        foreign = ClusterCA.create("test-cluster" if who == "self_signed" else "other", NOW)
        key = NodeKey.generate()
        client = await make_node(
            credentials=(key, foreign.issue(key.public_key, NOW)), trust=cluster.trust
        )
        expected = "not signed by this cluster's CA" if who == "self_signed" else "CA"
    with capture_logs() as logs, pytest.raises(TransportError):
        await client.connect((server.host, server.port))
    await eventually(lambda: server.refused)
    assert server.refused == 1 and not server.peers()
    refusals = [e for e in logs if e["event"] == "peer_refused"]
    assert refusals and expected in refusals[0]["reason"]
    assert refusals[0]["address"].startswith("127.0.0.1:")
    assert key.peer_id in refusals[0]["claimed"] or "CN=ciuic" in refusals[0]["claimed"]


async def test_client_refuses_a_server_of_another_cluster(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    other = ClusterCA.create("other", NOW)
    key = NodeKey.generate()
    server = await make_node(
        credentials=(key, other.issue(key.public_key, NOW)), trust=Trust(other.certificate)
    )
    client = await make_node()
    with pytest.raises(TransportError, match="refused"):
        await client.connect((server.host, server.port))
    assert client.refused == 1


def self_signed(key: NodeKey) -> x509.Certificate:
    """A node certificate its own key signed: the shape of a valid one, no CA behind it."""
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "test-cluster"),
            x509.NameAttribute(NameOID.COMMON_NAME, key.peer_id),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=1))
        .not_valid_after(NOW + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key.private_key, None)
    )


async def test_truly_self_signed_node_certificate_is_refused(
    make_node: NodeFactory, cluster: Cluster
) -> None:
    server = await make_node()
    key = NodeKey.generate()
    client = await make_node(credentials=(key, self_signed(key)), trust=cluster.trust)
    with pytest.raises(TransportError, match="refused"):
        await client.connect((server.host, server.port))
    await eventually(lambda: server.refused)
    assert server.refused == 1 and not server.peers()
