"""The training-loop hook: two lines in a PyTorch loop.

    sync = ciuic_p2p.attach(model, optimizer, run="my-run")   # once
    for x, y in data:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        sync.step()                                            # after each step
    sync.finish()                                              # wait for the others' last chunks

``attach`` makes the model's parameters views into flat buckets on their own device
(core.layout), connects to the node's daemon (the trainer socket; or an embedded
daemon) and waits until ``min_replicas`` members are up. ``step`` never waits for the
network: it encodes this step's update (on the tensor's device; only packed chunk
bytes reach the host), hands it to the daemon, applies the peers' chunks that have
arrived, and returns. It waits only when a live replica is more than
``staleness_bound_steps`` behind; that wait is counted in ``stats``.

The update rule and its references: core.replica.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ciuic_p2p.config import Config, trainer_socket_path
from ciuic_p2p.core.codec import ChunkSource
from ciuic_p2p.core.layout import BucketLayout
from ciuic_p2p.core.replica import RefusedChunk, Replica
from ciuic_p2p.core.trainwire import Kind, encode_done, encode_presence, run_id_of
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.train.channel import ChannelError, DaemonChannel
from ciuic_p2p.train.embedded import EmbeddedDaemon

STATS_EVERY_STEPS = 8
STALL_WARNING_S = 10.0
log = get_logger("ciuic.train")


def flatten_parameters(model: torch.nn.Module, layout: BucketLayout) -> list[torch.Tensor]:
    """Move the model's trainable parameters into flat fp32 buckets on their device and
    make each parameter a view into its bucket (values kept)."""
    params = dict(model.named_parameters())
    devices = {p.device for p in params.values()}
    if len(devices) != 1:
        raise ValueError(f"the model's parameters span devices {sorted(map(str, devices))}")
    for name, p in params.items():
        if p.requires_grad and p.dtype != torch.float32:
            raise ValueError(f"{name} is {p.dtype}: the hook trains fp32 parameters")
    buckets = layout.new_buckets(next(iter(devices)))
    views = layout.views(buckets)
    with torch.no_grad():
        for name, view in views.items():
            view.copy_(params[name])
            params[name].data = view
    return buckets


class _Encoder:
    """The thread that encodes and publishes this replica's updates while the trainer
    computes the next steps (on a GPU, the codec's kernels overlap the same way).
    It takes one job at a time: a step whose update is due while it is busy stays in
    the model's local progress and goes with the next send (merged steps)."""

    def __init__(self, replica: Replica, channel: DaemonChannel) -> None:
        self.replica = replica
        self.channel = channel
        self.jobs: queue.Queue[tuple[str, list[torch.Tensor], int] | None] = queue.Queue(1)
        self.idle = threading.Event()
        self.idle.set()
        self.error: BaseException | None = None
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name="ciuic-encoder", daemon=True)
        self._thread.start()

    def submit(self, kind: str, tensors: list[torch.Tensor], step: int) -> None:
        self.idle.clear()
        self.jobs.put((kind, tensors, step))

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            kind, tensors, step = job
            t0 = time.perf_counter()
            try:
                r = self.replica
                encode = r.encode_update if kind == "update" else r.encode_params
                for payload in encode(tensors, step):
                    self.channel.publish(payload)
            except BaseException as exc:  # handed to the trainer at its next step
                self.error = exc
            finally:
                self.busy_s += time.perf_counter() - t0
                self.idle.set()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        # The channel is closed first, so a publish blocked in sendmsg fails and the
        # thread reaches the queue; never block here.
        try:
            self.jobs.put(None, timeout=10)
        except queue.Full:
            return
        self._thread.join(timeout=10)


class MeshSync:
    """What :func:`attach` returns; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        channel: DaemonChannel,
        *,
        run: str,
        config: Config,
        min_replicas: int = 1,
        join_timeout_s: float = 120.0,
        seed: int = 0,
        embedded: EmbeddedDaemon | None = None,
    ) -> None:
        self.model = model
        self.channel = channel
        self.config = config
        self.embedded = embedded
        self.layout = BucketLayout.for_module(
            model, dense_below_numel=config.codec.dense_below_numel
        )
        self.buckets = flatten_parameters(model, self.layout)
        welcome = channel.hello(run)
        self.peer = str(welcome["peer"])
        source = ChunkSource(
            run_id=run_id_of(run),
            origin=bytes.fromhex(welcome["public_key"]),
            incarnation=int(welcome["incarnation"]),
            layout_id=self.layout.layout_id,
        )
        self.replica = Replica(
            self.layout, self.buckets, source, self.peer, config.codec, config.train, seed
        )
        channel.prepare = self.replica.prepare
        self._alive_seen: list[str] | None = None
        self._join = encode_presence(Kind.JOIN, source.run_id)
        self._await_replicas(min_replicas, join_timeout_s)
        self.encoder = _Encoder(self.replica, channel)
        self.wait_s = 0.0
        self.hook_s = 0.0
        self.merged_steps = 0
        self.params_skipped = 0
        self.finished = False

    def _await_replicas(self, count: int, timeout_s: float) -> None:
        """Say JOIN (again every second: a trainer that attaches later hears it) until
        ``count`` replicas of this run, this one included, are known."""
        deadline = time.monotonic() + timeout_s
        self.channel.publish(self._join)
        said = time.monotonic()
        while self.replica.replicas < count:
            if time.monotonic() - said >= 1.0:
                self.channel.publish(self._join)
                said = time.monotonic()
            if time.monotonic() > deadline or self.channel.closed:
                raise ChannelError(
                    f"only {self.replica.replicas} of {count} replicas of this run joined "
                    f"within {timeout_s:g} s"
                    + (f" ({self.channel.error})" if self.channel.error else "")
                )
            self.channel.wait_any(0.1)
            self.poll()

    # -- the loop --------------------------------------------------------------------------

    def step(self) -> None:
        """Call once after each ``optimizer.step()``."""
        t0 = time.perf_counter()
        r = self.replica
        ch = self.channel
        enc = self.encoder
        enc.check()
        if r.local_step():
            if enc.idle.is_set():
                enc.submit("update", r.take_update(), r.step)
            else:
                self.merged_steps += 1
        if r.wants_params():
            if enc.idle.is_set():
                enc.submit("params", r.snapshot_params(), r.step)
            else:  # the encoder is behind: this round of the mix is skipped, counted
                self.params_skipped += 1
        if r.step % STATS_EVERY_STEPS == 0:
            if ch.stats:
                r.adapt(int(ch.stats.get("backlog_bytes", 0)))
            ch.request_stats()
        self.poll()
        if r.blocking():
            w0 = warned = time.perf_counter()
            while r.blocking():
                if ch.closed:
                    raise ChannelError(ch.error or "the daemon went away")
                ch.wait_any(0.05)
                self.poll()
                if time.perf_counter() - warned > STALL_WARNING_S:
                    warned = time.perf_counter()
                    log.warning(
                        "waiting_for_replicas",
                        step=r.step,
                        behind=r.blocking(),
                        waited_s=round(warned - w0, 1),
                    )
            self.wait_s += time.perf_counter() - w0
        self.hook_s += time.perf_counter() - t0

    def poll(self) -> int:
        """Apply every peer chunk that has arrived (each exactly once); how many."""
        r = self.replica
        ch = self.channel
        if ch.alive is not self._alive_seen:
            self._alive_seen = ch.alive
            r.set_alive(ch.alive)
        n = 0
        for arrived in ch.take_deliveries():
            # Decoded on the reader thread, unless it arrived before the replica existed.
            item = r.prepare(*arrived) if isinstance(arrived, tuple) else arrived
            try:
                r.apply(item)
                n += 1
            except RefusedChunk as exc:
                log.warning("chunk_refused", reason=exc.reason, error=str(exc))
        r.settle()  # and flushes what was applied
        if r.joined:  # a replica that just joined learns of this one
            r.joined.clear()
            ch.publish(self._join)
        return n

    def finish(self, timeout_s: float | None = None) -> bool:
        """Send what is left of this replica's update, say it is done, and wait (bounded)
        until every live replica's chunks have all been applied here. True if all were."""
        r = self.replica
        ch = self.channel
        limit = self.config.train.finish_timeout_s if timeout_s is None else timeout_s
        if not self.finished:
            self.finished = True
            enc = self.encoder
            if not enc.idle.wait(limit):
                raise ChannelError(f"the encoder did not finish within {limit:g} s")
            if r.last_send_step < r.step:  # merged steps still pending: send them
                enc.submit("update", r.take_update(), r.step)
                if not enc.idle.wait(limit):
                    raise ChannelError(f"the encoder did not finish within {limit:g} s")
            enc.check()
            ch.publish(encode_done(r.source.run_id, r.step, r.stats.chunks_sent))

        def all_in() -> bool:
            self.poll()
            return all(
                p.done_at is not None and p.applied + p.refused >= p.chunks_sent
                for p in r.peers.values()
            )

        deadline = time.monotonic() + limit
        while not all_in() and time.monotonic() < deadline and not ch.closed:
            ch.wait_any(0.05)
        complete = all_in()
        r.settle(everything=True)
        return complete

    # -- reporting ---------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        r = self.replica
        s = r.stats
        return {
            "peer": self.peer,
            "step": r.step,
            "replicas": r.replicas,
            "sends": s.sends,
            "merged_steps": self.merged_steps,
            "params_skipped": self.params_skipped,
            "chunks_sent": s.chunks_sent,
            "bytes_published": s.bytes_published,
            "applied": s.applied,
            "applied_by_origin": {k: p.applied for k, p in r.peers.items()},
            "refused_by_origin": {k: p.refused for k, p in r.peers.items()},
            "sent_by_origin": {k: p.chunks_sent for k, p in r.peers.items()},
            "params_mixed": s.params_mixed,
            "other_runs": s.other_runs,
            "refused": dict(s.refused),
            "last_refusal": s.last_refusal,
            "staleness_p50": s.staleness_quantile(0.5),
            "staleness_p99": s.staleness_quantile(0.99),
            "staleness_bound": self.config.train.staleness_bound_steps,
            "send_interval": r.send_interval,
            "density": r.density,
            "residual_norm": s.residual_norm,
            "residual_norm_max": s.residual_norm_max,
            "wait_s": self.wait_s,
            "hook_s": self.hook_s,
            "encoder_s": self.encoder.busy_s,
            "udp_bytes_sent": int(self.channel.stats.get("udp_bytes_sent", 0)),
        }

    def close(self) -> None:
        self.channel.close()
        self.encoder.close()
        if self.embedded is not None:
            self.embedded.stop()

    def __enter__(self) -> MeshSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attach(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    run: str = "default",
    socket_path: str | Path | None = None,
    daemon: EmbeddedDaemon | None = None,
    config: Config | None = None,
    min_replicas: int = 1,
    join_timeout_s: float = 120.0,
    seed: int = 0,
) -> MeshSync:
    """Attach a model to the node's daemon (see the module docstring).

    ``config`` should be the node's (``ciuic_p2p.config.load_config(path)``): its
    ``codec`` and ``train`` sections steer the hook; the default is the WAN preset.
    ``socket_path`` defaults to ``train.socket_path``, or ``trainer.sock`` in
    ``node.state_dir`` (``/var/lib/ciuic``) when that is unset; pass ``daemon`` (an
    :class:`EmbeddedDaemon`) to run the daemon in this process instead. Call before
    the optimizer's first step (its state must not exist yet: parameters become views
    into the buckets). ``run`` names the training run: chunks of other runs are
    refused."""
    cfg = config or Config.wan()
    if optimizer is not None and optimizer.state:
        raise ValueError("attach before the optimizer's first step")
    started = False
    if daemon is not None:
        if not daemon.address:
            daemon.start()
            started = True
        try:
            channel = daemon.connect()
        except BaseException:
            if started:
                daemon.stop(leave=False)
            raise
    else:
        channel = DaemonChannel.connect(socket_path or trainer_socket_path(cfg))
    try:
        return MeshSync(
            model,
            channel,
            run=run,
            config=cfg,
            min_replicas=min_replicas,
            join_timeout_s=join_timeout_s,
            seed=seed,
            embedded=daemon,
        )
    except BaseException:
        channel.close()
        if started and daemon is not None:
            daemon.stop(leave=False)
        raise
