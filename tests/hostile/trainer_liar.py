"""A member's malicious trainer: a process on its own daemon's trainer socket, with a
valid certificate behind it, that publishes what it likes for a run (issue 44's
hostile review, as bench/hostile.py's training section runs it).

- ``flip``: every tick, the honest updates it was delivered since the last tick
  (decoded as sent, unweighted), sign-flipped times ``--scale``;
- ``push``: one fixed random direction, ``--scale`` times the norm of those updates.

Each tick it publishes ``--copies`` such updates, each at a fresh step number just
ahead of the newest honest step it has seen, and states ``--claim`` replicas in every
chunk header (0: the replicas it really sees, the run's members plus itself). It says
JOIN for the run every second, so the honest replicas count it as one of theirs.
The chunks are well formed and signed by its daemon: nothing a receiver can refuse
by their bytes alone.

    python -m tests.hostile.trainer_liar --socket nodes/m/trainer.sock --run R \\
        --attack flip --scale 5 --claim 1 --duration-s 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from ciuic_p2p.config import Config, load_layered
from ciuic_p2p.core.codec.bucket import BucketEncoder, BucketSpec, ChunkSource, apply_chunk
from ciuic_p2p.core.codec.chunk import parse_chunk
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.messages import (
    LayoutSummary,
    PayloadKind,
    decode_payload,
    encode_presence,
    envelope,
    run_id_of,
)
from ciuic_p2p.errors import CiuicError
from ciuic_p2p.lab.tasks import make_task
from ciuic_p2p.train.channel import DaemonChannel
from ciuic_p2p.train.encoder import flatten_parameters


class LiarTrainer:
    def __init__(self, args: argparse.Namespace, config: Config) -> None:
        self.args = args
        self.channel = DaemonChannel.connect(Path(args.socket), timeout_s=30)
        welcome = self.channel.hello(args.run, timeout_s=30)
        task = make_task(args.task)
        torch.manual_seed(args.seed)
        model = task.model()
        self.layout = BucketLayout.for_module(
            model, dense_below_numel=config.codec.dense_below_numel
        )
        self.buckets = flatten_parameters(model, self.layout)
        self.run_id = run_id_of(args.run)
        source = ChunkSource(
            self.run_id,
            bytes.fromhex(welcome["public_key"]),
            int(welcome["incarnation"]),
            self.layout.layout_id,
        )
        self.encoders = [
            BucketEncoder(
                i,
                info.numel,
                BucketSpec.from_config(config.codec, info.numel, info.sparse),
                source,
            )
            for i, info in enumerate(self.layout.buckets)
        ]
        self.sums = [torch.zeros_like(b) for b in self.buckets]
        gen = torch.Generator().manual_seed(args.seed + 1000)
        self.direction = [torch.randn(b.numel(), generator=gen) for b in self.buckets]
        self.front = 0
        """The newest honest step seen."""
        self.fresh = 0
        self.counts = {"honest_chunks": 0, "published_updates": 0, "published_chunks": 0}

    def _read(self) -> None:
        while self.channel.deliveries:
            _peer, payload = self.channel.deliveries.popleft()
            with contextlib.suppress(CiuicError, ValueError):
                msg = decode_payload(payload)
                if msg.kind is not PayloadKind.UPDATE:
                    continue
                header, _ = parse_chunk(msg.body)
                if header.bucket >= len(self.sums):
                    continue
                apply_chunk(msg.body, self.sums[header.bucket])
                self.front = max(self.front, header.step)
                self.counts["honest_chunks"] += 1

    def _join(self) -> None:
        summary = LayoutSummary(self.layout.layout_id, len(self.layout.slots), self.layout.numel)
        self.channel.publish(
            encode_presence(PayloadKind.JOIN, self.run_id, self.front, False, summary)
        )

    def _claim(self) -> int:
        if self.args.claim:
            return int(self.args.claim)
        return len(self.channel.alive) or 1

    def _publish(self) -> None:
        norm = math.sqrt(sum(float(s.pow(2).sum()) for s in self.sums))
        if norm == 0.0:
            return
        if self.args.attack == "flip":
            updates = [-self.args.scale * s for s in self.sums]
        else:
            total = math.sqrt(sum(float(d.pow(2).sum()) for d in self.direction))
            updates = [self.args.scale * norm / total * d for d in self.direction]
        for s in self.sums:
            s.zero_()
        for _copy in range(self.args.copies):
            self.fresh = max(self.fresh + 1, self.front + 1)
            for enc, update in zip(self.encoders, updates, strict=True):
                enc.replicas = self._claim()
                for chunk in enc.encode(update, self.fresh):
                    self.channel.publish(envelope(PayloadKind.UPDATE) + chunk)
                    self.counts["published_chunks"] += 1
            self.counts["published_updates"] += 1

    def run(self) -> dict[str, int]:
        t0 = time.monotonic()
        next_join = next_tick = t0
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        while (
            time.monotonic() - t0 < self.args.duration_s
            and not self.channel.closed
            and not stop.is_set()
        ):
            self.channel.wait_any(0.02)
            self._read()
            now = time.monotonic()
            if now >= next_join:
                self._join()
                next_join = now + 1.0
            if now >= next_tick:
                self._publish()
                next_tick = now + self.args.tick_s
        self.channel.close()
        return self.counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.hostile.trainer_liar")
    p.add_argument("--socket", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--config", default=None)
    p.add_argument("--task", default="digits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attack", choices=["flip", "push"], default="flip")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--claim", type=int, default=1, help="replicas stated (0: the truth)")
    p.add_argument("--copies", type=int, default=2, help="updates published per tick")
    p.add_argument("--tick-s", type=float, default=0.1)
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--out", help="write the counts here as JSON")
    args = p.parse_args(argv)
    config = load_layered(args.config, {}) if args.config else Config.wan()
    counts = LiarTrainer(args, config).run()
    if args.out:
        Path(args.out).write_text(json.dumps(counts))
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
