"""The dense baseline: synchronous ring all-reduce of fp32 gradients between trainers,
through the same daemons and QUIC links (DIRECT frames), as torch DDP would do it
without NCCL. Each step: N-1 reduce-scatter rounds, then N-1 all-gather rounds, each
sending 1/N of the vector to the next trainer on the ring (Patarasuk and Yuan 2009:
2(N-1)/N of the vector per trainer, bandwidth-optimal, latency 2(N-1) hops)."""

from __future__ import annotations

import struct
import time

import torch

from ciuic_p2p.train.channel import ChannelError, DaemonChannel

_HEAD = struct.Struct("<QBB")


class RingAllReduce:
    def __init__(self, channel: DaemonChannel, ring: list[str], me: str) -> None:
        if me not in ring:
            raise ValueError("this trainer is not on the ring")
        self.channel = channel
        self.ring = ring
        self.rank = ring.index(me)
        self.world = len(ring)
        self.next = ring[(self.rank + 1) % self.world]
        self.prev = ring[(self.rank - 1) % self.world]
        self._early: dict[tuple[int, int, int], memoryview] = {}
        self.wait_s = 0.0

    def mean_(self, flat: torch.Tensor, step: int, timeout_s: float = 120.0) -> None:
        """Replace ``flat`` (1-D fp32, CPU) with the mean over the ring, in place."""
        n = self.world
        if n == 1:
            return
        bounds = [len(flat) * i // n for i in range(n + 1)]
        seg = [flat[bounds[i] : bounds[i + 1]] for i in range(n)]
        for k in range(n - 1):  # reduce-scatter
            self._send(step, 0, k, seg[(self.rank - k) % n])
            seg[(self.rank - k - 1) % n].add_(self._recv(step, 0, k, timeout_s))
        for k in range(n - 1):  # all-gather
            self._send(step, 1, k, seg[(self.rank + 1 - k) % n])
            seg[(self.rank - k) % n].copy_(self._recv(step, 1, k, timeout_s))
        flat.div_(n)

    def _send(self, step: int, phase: int, k: int, part: torch.Tensor) -> None:
        body = part.contiguous().view(torch.uint8).numpy().data
        self.channel.send_direct(self.next, _HEAD.pack(step, phase, k) + body)

    def _recv(self, step: int, phase: int, k: int, timeout_s: float) -> torch.Tensor:
        key = (step, phase, k)
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while key not in self._early:
            while self.channel.direct:
                peer, payload = self.channel.direct.popleft()
                if peer != self.prev or len(payload) < _HEAD.size:
                    continue
                got = _HEAD.unpack_from(payload)
                self._early[(int(got[0]), int(got[1]), int(got[2]))] = payload[_HEAD.size :]
            if key in self._early:
                break
            if self.channel.closed or time.monotonic() > deadline:
                raise ChannelError(f"ring all-reduce: no segment from {self.prev} (step {step})")
            self.channel.wait_any(0.05)
        self.wait_s += time.perf_counter() - t0
        data = self._early.pop(key)
        return torch.frombuffer(bytearray(data), dtype=torch.float32)
