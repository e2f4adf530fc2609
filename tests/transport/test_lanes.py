"""A node's bulk traffic over several lane processes."""

from __future__ import annotations

import os

import pytest
import torch

from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource
from ciuic_p2p.core.codec.chunk import Codec, parse_chunk
from ciuic_p2p.core.codec.origin import sign_chunk
from ciuic_p2p.transport.lanes import LanePool, lane_of
from tests.transport.conftest import FAST, Cluster

pytestmark = pytest.mark.network


@pytest.mark.timeout(120)
async def test_chunks_spread_over_lanes_arrive_once_each_verified(cluster: Cluster) -> None:
    pools = []
    keys = []
    for _ in range(2):
        key, cert = cluster.node_credentials()
        pool = LanePool(key, cert, cluster.ca.certificate, lanes=2, settings=FAST)
        await pool.start()
        pools.append(pool)
        keys.append(key)
    a, b = pools
    try:
        assert await a.connect(b.addresses) == keys[1].public_key
        source = ChunkSource(b"r" * 16, keys[0].public_key, 1, 7)
        spec = BucketSpec(codec=Codec.DENSE_FP32, chunk_payload_bytes=64 * 1024)
        chunks = BucketEncoder(0, 200_000, spec, source).encode(torch.randn(200_000), step=1)
        for c in chunks:
            sign_chunk(c, keys[0])
        assert {lane_of(bytes(c), 2) for c in chunks} == {0, 1}  # both lanes carry traffic
        for c in chunks:
            a.send(keys[1].public_key, bytes(c))
        got = [await b.next_chunk() for _ in chunks]
        assert {p for p, _ in got} == {keys[0].public_key}
        starts = sorted(parse_chunk(c)[0].range_start for _, c in got)
        assert starts == sorted(parse_chunk(c)[0].range_start for c in chunks)
    finally:
        pids = [p.pid for pool in pools for p in pool._procs]
        for pool in pools:
            await pool.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
