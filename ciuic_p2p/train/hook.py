"""The training-loop hook: two lines in a PyTorch loop.

    sync = ciuic_p2p.attach(model, optimizer, run="my-run")   # once
    for x, y in data:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad(); loss.backward(); optimizer.step()
        sync.step()                                            # after each step
    sync.finish()                                              # wait for the others' last chunks

``attach`` makes the model's parameters views into flat buckets on their own device
(core.codec.layout), connects to the node's daemon (the trainer socket; or an embedded
daemon) and waits until ``min_replicas`` members are up. ``step`` never waits for the
network: it encodes this step's update (on the tensor's device; only packed chunk
bytes reach the host), hands it to the daemon, applies the peers' chunks that have
arrived, and returns. It waits only when a live replica is more than
``staleness_bound_steps`` behind; that wait is counted in ``stats``.

The update rule and its references: core.replica.rule.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ciuic_p2p.config import Config
from ciuic_p2p.core.codec.bucket import ChunkSource
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.final import FinalSummary
from ciuic_p2p.core.replica.intake import Prepared
from ciuic_p2p.core.replica.messages import (
    LayoutSummary,
    PayloadKind,
    TrainWireError,
    decode_payload,
    encode_done,
    encode_presence,
    run_id_of,
)
from ciuic_p2p.core.replica.parameters import AddSink
from ciuic_p2p.core.replica.rule import RefusedChunk, Replica
from ciuic_p2p.core.replica.schedule import (
    EncodeParams,
    EncodeUpdate,
    HandState,
    ReplicaSchedule,
    ScheduleAction,
    StepFacts,
    WaitForEncoder,
)
from ciuic_p2p.errors import LayoutMismatchError
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.train.channel import ChannelError, DaemonChannel, LocalDaemon
from ciuic_p2p.train.checkpoint import DAEMON_NAMED, CheckpointChoice, daemon_named_dir
from ciuic_p2p.train.encoder import Encoder, ThreadGate, flatten_parameters
from ciuic_p2p.train.parallel import thread_parts
from ciuic_p2p.train.shardckpt import ShardCheckpoints, ShardKeeper
from ciuic_p2p.train.sharded import Shard, shard_of
from ciuic_p2p.train.shardfetch import RangeFetch, start_from_mesh
from ciuic_p2p.train.statesync import StateKeeper
from ciuic_p2p.train.stats import SyncStats

__all__ = ["MeshSync", "flatten_parameters"]

LAYOUT_GRACE_S = 3.0
"""How long a replica that heard a replica of its run with another parameter layout
waits to hear one of its own model before it stops (:class:`LayoutMismatchError`):
two trainers of different models in one run both stop within seconds, whatever
``min_replicas`` is, instead of each training alone for the whole run. A replica
that hears one of its own model never stops for another's claim: a member can then
stop only a trainer that had nobody to train with."""
REJOIN_WINDOW_S = 30.0
"""After its daemon came back, how long a replica says JOIN again (asking for answers)
whenever the daemon's members change: the daemon rejoins the mesh after it serves
its trainer."""
JOIN_ANSWER_WAIT_S = 5.0
FIRST_ANSWER_WAIT_S = 3.0
"""How long attach listens for a run's replicas that are already training, when the
mesh has other members and it needs no more replicas than itself."""
WAIT_REPORT_INTERVAL_S = 5.0
"""How often attach says how many replicas joined while it waits for them."""
log = get_logger("ciuic.train")


def _is_chunk(arrived: Any) -> bool:
    """An update or parameter chunk (raw, or as the reader thread prepared it)."""
    if isinstance(arrived, tuple):
        with contextlib.suppress(TrainWireError):
            return decode_payload(arrived[1]).kind in (PayloadKind.UPDATE, PayloadKind.PARAMS)
        return False
    return isinstance(arrived, Prepared) and arrived.kind in (
        PayloadKind.UPDATE,
        PayloadKind.PARAMS,
    )


class MeshSync:
    """What :func:`attach` returns; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        channel: DaemonChannel,
        *,
        run: str,
        config: Config,
        optimizer: torch.optim.Optimizer | None = None,
        min_replicas: int = 1,
        join_timeout_s: float = 120.0,
        seed: int = 0,
        embedded: LocalDaemon | None = None,
        checkpoint_dir: CheckpointChoice = None,
        sink: AddSink | None = None,
        process_group: Any = None,
    ) -> None:
        """``sink``: told of every add to the parameters (core.replica.mirror: a node's
        other local ranks replay them). ``process_group``: the node's ranks that shard
        the model (FSDP2, train.sharded); this is one rank's replica of its shard."""
        self.model = model
        self.optimizer = optimizer
        self.channel = channel
        self.config = config
        self.embedded = embedded
        self.layout = BucketLayout.for_module(
            model, dense_below_numel=config.codec.dense_below_numel
        )
        self.shard: Shard | None = None
        """This rank's shard of a sharded replica (None: a whole replica)."""
        if process_group is None:
            self.buckets = flatten_parameters(model, self.layout)
        else:
            self.shard = shard_of(model, self.layout, process_group)
            self.buckets = self.shard.tensors
        welcome = self._hello(run)
        self.peer = str(welcome["peer"])
        source = ChunkSource(
            run_id=run_id_of(run),
            origin=bytes.fromhex(welcome["public_key"]),
            incarnation=int(welcome["incarnation"]),
            layout_id=self.layout.layout_id,
        )
        self.replica = Replica(
            self.layout,
            self.buckets,
            source,
            self.peer,
            config.codec,
            config.train,
            seed,
            run_parts=thread_parts,
            gate=ThreadGate(self.buckets[0].device),
            sink=sink,
            pieces=None if self.shard is None else self.shard.pieces,
        )
        ckpt_dir: Path | None = None
        if checkpoint_dir == DAEMON_NAMED:
            named, why = daemon_named_dir(welcome.get("checkpoint_dir"), os.environ)
            if self.shard is not None:  # the first rank's: every rank writes in one place
                named, why = self.shard.broadcast((named, why))
            ckpt_dir = named
            log.info("checkpoint_dir", path=str(ckpt_dir) if ckpt_dir else None, why=why)
        elif isinstance(checkpoint_dir, Path):
            ckpt_dir = checkpoint_dir
        channel.prepare_deliveries(self.replica.prepare)
        self.encoder = Encoder(self.buckets[0].device)
        self.schedule = ReplicaSchedule(
            checkpoint_interval_s=config.store.checkpoint_interval_s, now=time.monotonic()
        )
        self.state = StateKeeper(
            config=config,
            channel=channel,
            replica=self.replica,
            layout=self.layout,
            buckets=self.buckets,
            optimizer=optimizer,
            encoder=self.encoder,
            schedule=self.schedule,
            checkpoint_dir=ckpt_dir if self.shard is None else None,
        )
        self.shard_state = ShardKeeper(
            None
            if self.shard is None or ckpt_dir is None
            else ShardCheckpoints(
                ckpt_dir,
                source.run_id.hex(),
                self.shard,
                model,
                self.layout,
                optimizer if config.store.sync_optimizer_state else None,
            ),
            self.replica,
            self.encoder,
            interval_s=config.store.checkpoint_interval_s,
            wait_s=config.train.finish_timeout_s,
            now=time.monotonic(),
        )
        """A sharded replica's checkpoints (train.shardckpt: DCP, every rank its shard)."""
        self._alive_seen: list[str] | None = None
        self.wait_s = 0.0
        self.max_wait_s = 0.0
        """The longest a single step waited for other replicas (a stall)."""
        self.round_waits = 0
        """Round ends (outer mode) that waited for the encoder instead of merging."""
        self.hook_s = 0.0
        self.finished = False
        self._terminate = False
        self._stats_report: dict[str, Any] | None = None
        self._ready = False
        """True once the state is restored: only then may peers have it."""
        self._layout_said_at = -1.0
        self.layout_mismatch: str | None = None
        """The last JOIN of this run refused for another parameter layout."""
        self._layout_mismatch_at: float | None = None
        """When the first was refused (monotonic s)."""
        self._away_said = False
        self._reconnects_seen = 0
        self._loss: float | torch.Tensor | None = None
        """The newest loss given to :meth:`step`."""
        self._rejoin_until = 0.0
        self._early: list[Any] = []
        self.final_round: FinalSummary | None = None
        """How :meth:`finish`'s last round went (core.replica.final)."""
        """Peer chunks that arrived before the state was restored, applied after it
        (applied before, they went into weights the restored state then replaced)."""
        self.replicas_heard_s: dict[str, float] = {}
        """When attach first saw each member alive, registered, and reported (s)."""
        t0 = time.monotonic()
        if self.shard is None:
            self.state.load_checkpoint()
        else:
            self.shard_state.find()
        self._await_replicas(min_replicas, join_timeout_s)
        self.replicas_wait_s = time.monotonic() - t0
        """How long attach waited for the run's other replicas to answer."""
        self.restored = self.state.restore() if self.shard is None else self._restore_shard()
        self._ready = True
        self._apply_early()
        self.start_step = self.replica.step
        """The step this replica begins at: 0, or where its state came from (a peer's
        state or this node's checkpoint); continue the loop's schedule from here."""
        self._say_join()  # where it stands now

    def _restore_shard(self) -> dict[str, Any]:
        """A sharded replica starts from the run's state, each rank fetching its rows
        (train.shardfetch), when a replica is past its newest checkpoint; else from that
        checkpoint; else from the model as it is (collective)."""
        assert self.shard is not None
        fetch = RangeFetch(
            self.channel, self.state.state_name, self.shard, self.layout, self.model,
            self.optimizer if self.config.store.sync_optimizer_state else None,
            self.config.store.fetch_timeout_s + 30.0,
        )  # fmt: skip
        found = self.shard_state.found_step
        return (
            start_from_mesh(fetch, self.state, found, self.buckets)
            or self.shard_state.restore()
            or {"source": "fresh", "step": 0}
        )

    def _hello(self, run: str) -> dict[str, Any]:
        """Say which run this replica trains (a sharded replica's first rank, then its
        other ranks under the first's incarnation: daemon.rankwriters)."""
        shard = self.shard
        if shard is None:
            return self.channel.hello(run)
        if shard.rank == 0:
            welcome = self.channel.hello(run, ranks=shard.ranks)
            shard.broadcast(int(welcome["incarnation"]))
            return welcome
        incarnation = int(shard.broadcast(None))
        return self.channel.hello(run, rank=shard.rank, incarnation=incarnation)

    def _say_join(self, ask: bool = False) -> None:
        """Publish this replica's JOIN (a sharded replica's first rank speaks for it)."""
        if self.shard is None or self.shard.rank == 0:
            self.channel.publish(self._join(ask))

    def _join(self, ask: bool = False) -> bytes:
        layout = LayoutSummary(self.layout.layout_id, len(self.layout.slots), self.layout.numel)
        return encode_presence(
            PayloadKind.JOIN,
            self.replica.source.run_id,
            self.replica.step,
            ask,
            layout,
            stateless=self.shard is not None,  # a sharded replica hands no state yet
        )

    def _await_replicas(self, count: int, timeout_s: float) -> None:
        """Say JOIN, asking for answers (again every second: a trainer that attaches
        later hears it), until ``count`` replicas of this run, this one included, are
        known and each has said its step (or ``JOIN_ANSWER_WAIT_S`` passed since the
        count was reached: a member that died meanwhile does not hold us up)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        self._say_join(ask=True)
        said = told = t0
        counted: float | None = None
        r = self.replica
        heard = self.replicas_heard_s
        while True:
            now = time.monotonic()
            for name in self.channel.alive:
                heard.setdefault("alive " + name[:12], round(now - t0, 3))
            for name, p in r.peers.items():
                heard.setdefault("registered " + name[:12], round(now - t0, 3))
                if p.reported:
                    heard.setdefault("reported " + name[:12], round(now - t0, 3))
            if r.replicas >= count:
                counted = counted or time.monotonic()
                # Enough replicas: go once those known said their step, and, when none
                # answered yet while the mesh has other members, after one answer's
                # time (a run under way must not be missed by a joiner that asked
                # for fewer replicas than it has).
                others = any(name != self.peer for name in self.channel.alive)
                unheard = others and not r.peers and now - t0 < FIRST_ANSWER_WAIT_S
                if all(p.reported for p in r.peers.values()) and not unheard:
                    break
                if time.monotonic() - counted > JOIN_ANSWER_WAIT_S:
                    break
            if time.monotonic() - said >= 1.0:
                self._say_join(ask=True)
                said = time.monotonic()
            if time.monotonic() - told >= WAIT_REPORT_INTERVAL_S:
                told = time.monotonic()
                log.info(
                    "waiting_for_replicas",
                    joined=r.replicas,
                    of=count,
                    left_s=round(deadline - told),
                    members_alive=len(self.channel.alive),
                )
            self._check_layout()
            if time.monotonic() > deadline or self.channel.closed:
                raise ChannelError(
                    f"only {self.replica.replicas} of {count} replicas of this run joined "
                    f"within {timeout_s:g} s"
                    + (f" ({self.channel.error})" if self.channel.error else "")
                    + (f"; {self.layout_mismatch}" if self.layout_mismatch else "")
                )
            self.channel.wait_any(0.1)
            self.poll()
            if r.replicas >= count and self.shard is None:
                # Not before: the writers asked and the run's window are those of every
                # replica asked for, not of the first to answer (a member's, maybe).
                self.state.ask_state_if_behind()

    # -- the loop --------------------------------------------------------------------------

    def step(self, loss: float | torch.Tensor | None = None) -> None:
        """Call once after each ``optimizer.step()``. ``loss`` (optional): this step's
        training loss, carried to the daemon with the next statistics report (its
        ``status``, page and ``ciuic_trainer_loss``); a tensor is read only then, so
        a loss on a GPU costs no synchronisation at every step."""
        t0 = time.perf_counter()
        if loss is not None:
            self._loss = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        if self._terminate:
            self._exit_on_sigterm()
        if self.channel.closed:
            self._daemon_gone()
        self.encoder.check()
        # Peers' chunks first: their adds then run before this step's encoder job
        # starts its scan, not beside it (on a busy host the two fought for the cores
        # and for the gate).
        self._apply_arrived()
        self._check_layout()
        r = self.replica
        update_due = r.local_step()
        params_due = r.wants_params()
        if self._daemon_away():
            # Updates go on as usual while the daemon is away: the channel keeps them
            # and sends them when it is back, each of its own step (one merged update
            # of a hundred steps was refused for its norm). Near the channel's bound,
            # nothing more is taken: the residual keeps it, merged.
            params_due = False
            if self.channel.pending_full():
                update_due = False
        facts = self._facts(update_due=update_due, params_due=params_due)
        for action in self.schedule.after_step(facts, time.monotonic()):
            self._carry_out(action)
        if self.shard is not None:
            self.shard_state.after_step(time.monotonic())
        self._between_steps()  # after the update: a snapshot never delays it
        self._answer_stop()
        if not self.channel.away:  # away, the others cannot be heard: never wait for them
            self._wait_while_blocked()
        self.hook_s += time.perf_counter() - t0

    def _facts(self, *, update_due: bool = False, params_due: bool = False) -> StepFacts:
        return StepFacts(
            step=self.replica.step,
            update_due=update_due,
            params_due=params_due,
            encoder_idle=self.encoder.idle.is_set(),
            snapshot_wanted=self.channel.snapshot_wanted.is_set() and not self.channel.away,
            ready=self._ready,
            checkpointing=self.state.checkpoint_path is not None,
            round_end=update_due and self.replica.outer is not None,
        )

    def _carry_out(self, action: ScheduleAction) -> None:
        r, enc = self.replica, self.encoder
        if isinstance(action, WaitForEncoder):
            # Bounded: a job stuck past it is queued behind anyway (jobs run in order).
            w0 = time.perf_counter()
            enc.idle.wait(self.config.train.finish_timeout_s)
            self._count_wait(time.perf_counter() - w0)
            self.round_waits += 1
        elif isinstance(action, HandState):
            if self.shard is None:
                self.state.hand_state(write_checkpoint_too=action.checkpoint)
            else:  # a sharded replica hands no state yet: a joiner asks another
                self.channel.snapshot_wanted.clear()
        elif isinstance(action, EncodeParams):
            alone = r.snapshot_params()
            enc.submit(lambda: self._publish(r.encode_params(alone)), enc.mark())
        elif isinstance(action, EncodeUpdate):
            taken = r.take_update()
            fragment = r.snapshot_params() if action.with_params else None

            def job() -> None:
                self._publish(r.encode_update(taken))
                if fragment is not None:  # after the update: it never waits for a mix
                    self._publish(r.encode_params(fragment))

            enc.submit(job, enc.mark())
        else:
            ch = self.channel
            if ch.stats:
                r.adapt(int(ch.stats.get("backlog_bytes", 0)))
            # Sent by the encoder thread with its next chunks: a send from this thread
            # wakes the daemon, which on a busy machine can take this thread's core
            # (5 ms a request measured with 4 nodes on 2 cores).
            report: dict[str, Any] = {
                "step": r.step,
                "encode_s": enc.busy_s,
                "decode_s": ch.decode_s,
                "wait_s": self.wait_s,
                "hook_s": self.hook_s,
                "clipped": r.stats.clipped,
                "weight_raised": r.stats.weight_raised,
                "set_aside": dict(r.stats.set_aside),
            }
            if self._loss is not None:
                report["loss"] = float(self._loss)
            # Whole, in one assignment: the encoder thread takes and clears it.
            self._stats_report = report

    def _wait_while_blocked(self) -> None:
        """Wait while a live replica is past the staleness bound behind, excusing it
        after ``stall_grace_s`` (dead or far too slow: go on)."""
        r = self.replica
        ch = self.channel
        if not r.blocking():
            return
        w0 = time.perf_counter()
        grace = self.config.train.stall_grace_s
        self._send_stats_report()  # waiting anyway: the daemon hears it now
        while behind := r.blocking():
            if ch.closed:
                raise ChannelError(ch.error or "the daemon went away")
            if self.schedule.stalled(time.perf_counter() - w0, grace):
                r.excuse(behind)
                log.warning("replicas_excused", step=r.step, behind=behind)
                break
            ch.wait_any(0.02)
            self.poll()
        self._count_wait(time.perf_counter() - w0)

    def _count_wait(self, waited: float) -> None:
        self.wait_s += waited
        self.max_wait_s = max(self.max_wait_s, waited)

    def _daemon_gone(self) -> None:
        """The daemon stopped (or crashed): keep what this replica learned in a
        checkpoint before giving up, so that a restart loses nothing."""
        with contextlib.suppress(Exception):
            self.encoder.idle.wait(self.config.train.finish_timeout_s)
        path = self.state.checkpoint()
        where = f"; checkpoint of step {self.replica.step} written to {path}" if path else ""
        raise ChannelError(f"{self.channel.error or 'the daemon went away'}{where}")

    def _answer_stop(self) -> None:
        """The daemon is stopping (STOPPING): write a checkpoint now, at a step's
        boundary, and tell it; training goes on, and the channel reconnects when a
        daemon serves the socket again."""
        if not self.channel.stop_asked.is_set() or not self._ready:
            return
        self.channel.stop_asked.clear()
        path = self.state.checkpoint()
        log.info(
            "daemon_stopping",
            step=self.replica.step,
            checkpoint=str(path) if path else None,
            hint="training goes on; updates are kept and sent when a daemon is back",
        )
        self.channel.ready_to_stop(self.replica.step, path)

    def _exit_on_sigterm(self) -> None:
        path = self.state.checkpoint()
        log.info("terminated", step=self.replica.step, checkpoint=str(path) if path else None)
        self.close()
        raise SystemExit(143)

    def _publish(self, payloads: list[bytes]) -> None:
        for payload in payloads:
            self.channel.publish(payload)
        self._send_stats_report()

    def _send_stats_report(self) -> None:
        """Ask the daemon for its statistics (the backlog that :meth:`Replica.adapt`
        reads), telling it this trainer's figures."""
        report, self._stats_report = self._stats_report, None
        if report is not None:
            self.channel.request_stats(report)

    def poll(self) -> int:
        """Apply every peer chunk that has arrived (each exactly once); how many."""
        n = self._apply_arrived()
        self._between_steps()
        return n

    def _apply_arrived(self) -> int:
        r = self.replica
        ch = self.channel
        if ch.alive is not self._alive_seen:
            self._alive_seen = ch.alive
            r.set_alive(ch.alive)
            if time.monotonic() < self._rejoin_until:
                self._say_join(ask=True)
        n = 0
        for arrived in ch.take_deliveries():
            if not self._ready and _is_chunk(arrived):
                self._early.append(arrived)
                if isinstance(arrived, tuple):
                    r.register(arrived[0], arrived[1])
                else:
                    r.register(arrived.origin, None, arrived.step)
                continue
            n += self._apply_one(arrived)
        r.settle()  # and flushes what was applied
        return n

    def _daemon_away(self) -> bool:
        """Whether the daemon is away (restarting), saying so once per absence; when
        it is back, this replica says JOIN again: the new daemon's mesh and the other
        replicas learn where it stands."""
        ch = self.channel
        if ch.away:
            if not self._away_said:
                self._away_said = True
                self.replica.daemon_lost()
                log.warning(
                    "daemon_away",
                    step=self.replica.step,
                    error=ch.error,
                    hint="training goes on; updates are kept and sent when a daemon "
                    "serves the trainer socket again",
                )
            return True
        if ch.reconnects != self._reconnects_seen:
            self._reconnects_seen = ch.reconnects
            self._away_said = False
            log.info("daemon_back", step=self.replica.step, away_s=round(ch.away_s, 3))
            self.replica.daemon_back()
            # The daemon that came back may not have rejoined the mesh yet: say JOIN,
            # asking for answers, each time its members change for a while.
            self._rejoin_until = time.monotonic() + REJOIN_WINDOW_S
            self._say_join(ask=True)
        return False

    def _check_layout(self) -> None:
        """Raise :class:`LayoutMismatchError` when replicas of this run with another
        layout were heard ``LAYOUT_GRACE_S`` ago and none with this one's since."""
        at = self._layout_mismatch_at
        if at is None or time.monotonic() - at < LAYOUT_GRACE_S:
            return
        if any(p.reported or p.applied for p in self.replica.peers.values()):
            return
        raise LayoutMismatchError(
            f"{self.layout_mismatch}; none of this run's replicas heard in "
            f"{LAYOUT_GRACE_S:g} s trains this model, so this one would train alone"
        )

    def _between_steps(self) -> None:
        r = self.replica
        for action in self.schedule.between_steps(self._facts()):
            self._carry_out(action)  # a joiner is waiting for the state
        if r.joined:  # a replica that just joined learns of this one, and where it is
            r.joined.clear()
            self._say_join()

    def _apply_one(self, arrived: Any) -> int:
        r = self.replica
        # Decoded on the reader thread, unless it arrived before the replica existed.
        item = r.prepare(*arrived) if isinstance(arrived, tuple) else arrived
        try:
            r.apply(item)
            return 1
        except RefusedChunk as exc:
            if exc.reason == "layout" and exc.kind is PayloadKind.JOIN:
                # Say this replica's layout back, so the other side fails as loudly
                # (its JOIN may have been the one that reached this trainer first).
                now = time.monotonic()
                if now - self._layout_said_at >= 1.0:  # at most once a second, whoever asks
                    self._layout_said_at = now
                    self._say_join()
                # Logged now, fatal only after LAYOUT_GRACE_S with no replica of this
                # model heard (_check_layout): the claim is another member's.
                self.layout_mismatch = str(exc)
                if self._layout_mismatch_at is None:
                    self._layout_mismatch_at = now
                log.error("layout_mismatch", step=r.step, error=str(exc))
                return 0
            if exc.set_aside_until is not None:
                log.error(
                    "origin_set_aside",
                    step=r.step,
                    origin=exc.origin,
                    until_step=exc.set_aside_until,
                    error=str(exc),
                    hint="a member refused again and again: if it is not a faulty "
                    "version of ours, revoke it (ciuic-node ca revoke --dir CA_DIR "
                    "ITS_CERT.pem, then hand revoked.pem to every node)",
                )
            elif exc.reason != "set_aside":  # counted; said once when it was set aside
                # A duplicate is the mesh's at-least-once delivery (a relay's repair, a
                # leaving daemon's resend), not a fault: counted, not warned about.
                # A last round's copy refused is said once, in its summary
                # (final_round_incomplete), not once per chunk.
                quiet = exc.reason == "duplicate" or exc.kind is PayloadKind.FINAL
                level = log.debug if quiet else log.warning
                level("chunk_refused", step=r.step, reason=exc.reason, error=str(exc))
            return 0

    def _apply_early(self) -> None:
        """Apply the chunks that came while attach waited and fetched; the updates the
        restored state holds are dropped by their header, undecoded."""
        r = self.replica
        early, self._early = self._early, []
        held = 0
        for arrived in early:
            if isinstance(arrived, tuple) and r.held_by_state(*arrived):
                held += 1
            else:
                self._apply_one(arrived)
        r.settle()
        self.restored["early_chunks"] = len(early)
        self.restored["early_held_by_state"] = held

    def finish(self, timeout_s: float | None = None) -> bool:
        """Send what is left of this replica's update, say it is done, and wait (bounded)
        until every live replica's chunks have all been applied here. True if all were."""
        r = self.replica
        ch = self.channel
        limit = self.config.train.finish_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        # A daemon restarting when the run ends: wait for it (within the timeout), or
        # the last updates and DONE would go nowhere.
        ch.wait(lambda: not ch.away, limit)
        self._daemon_away()
        if not self.finished:
            self.finished = True
            enc = self.encoder
            if not enc.idle.wait(limit):
                raise ChannelError(f"the encoder did not finish within {limit:g} s")
            # What error feedback still holds goes too, dense (train.finish_dense): each
            # replica's own residual kept the replicas apart for good.
            # A replica that never stepped has nothing held back (and sends nothing:
            # a peer must not take its zeros for training together).
            dense = self.config.train.finish_dense and r.outer is None and r.stats.steps > 0
            if dense or r.last_send_step < r.step:  # merged steps still pending
                taken = r.take_final() if dense else r.take_update()
                enc.submit(lambda: self._publish(r.encode_update(taken, dense=dense)), enc.mark())
                if not enc.idle.wait(limit):
                    raise ChannelError(f"the encoder did not finish within {limit:g} s")
            enc.check()
            # The trainer's own step (the daemon reports it): the last update's stamp
            # may lie past it, and receivers settle by the chunks they apply. A
            # sharded replica's first rank says the chunks of all its ranks.
            sent = r.stats.chunks_sent
            if self.shard is not None:
                sent = self.shard.total(sent)
            if self.shard is None or self.shard.rank == 0:
                ch.publish(encode_done(r.source.run_id, r.step, sent))

        def all_in() -> bool:
            self.poll()
            return all(
                p.done_at is not None and p.applied + p.held_by_state + p.refused >= p.chunks_sent
                for p in r.peers.values()
            )

        while not all_in() and time.monotonic() < deadline and not ch.closed:
            ch.wait_any(0.05)
        complete = all_in()
        if not complete:
            short = {
                k: [p.applied + p.held_by_state + p.refused, p.chunks_sent, p.done_at]
                for k, p in r.peers.items()
                if p.done_at is None or p.applied + p.held_by_state + p.refused < p.chunks_sent
            }
            log.warning(
                "finish_incomplete",
                step=r.step,
                short=dict(list(short.items())[:16]),  # origin: [reached, its DONE's, at]
                hint="these replicas' chunks did not all reach this one within the timeout "
                "(DONE not heard: at None); see the daemon's log and its counters",
            )
        reached = r.stats.applied + sum(p.held_by_state for p in r.peers.values())
        if reached == 0 and (r.peers or self.layout_mismatch is not None):
            # Replicas of this run were there, and nothing of theirs reached the model:
            # a run that "finished" alone must not look like one that trained together.
            log.error(
                "no_peer_update_applied",
                step=r.step,
                replicas_seen=len(r.peers),
                refused=dict(r.stats.refused),
                layout_mismatch=self.layout_mismatch,
                hint="this replica trained alone: see the refusals and the daemon's log",
            )
            complete = False
        r.settle(everything=True)
        if not self._final_round(limit):
            complete = False
        if self.shard is not None:
            # Every rank leaves finish() together: the first rank's session ending
            # must not cut a rank still waiting for the last round's copies.
            complete = bool(self.shard.total(int(not complete)) == 0)
        if self.shard is None and self.encoder.idle.wait(limit):  # joiners start from here
            self.state.hand_state(write_checkpoint_too=self.state.checkpoint_path is not None)
            self.encoder.idle.wait(limit)
        elif self.shard is not None:
            self.shard_state.write(time.monotonic())
        return complete

    def _final_round(self, limit: float) -> bool:
        """The run's last round (core.replica.final): every replica averages the same
        copies of the replicas' parameters, so that the run ends as one model. Its
        members are the replicas whose DONE was heard at a step within the staleness
        bound of this one's (one that ended long before is not averaged in); it waits
        at most ``limit`` for their copies. False when a member's copy did not come
        whole (the replicas may then end apart); a second call answers as the first."""
        r, ch = self.replica, self.channel
        if self.final_round is not None:
            return self.final_round.complete
        if self.config.train.finish_average == "off" or r.intake.final is not None:
            return True
        bound = self.config.train.staleness_bound_steps
        members = [
            name
            for name, p in r.peers.items()
            if p.done_at is not None
            and abs(p.done_at - r.step) <= bound
            and not r.intake.influence.set_aside(name, r.step)
        ]
        if self.shard is not None:  # every rank averages the same copies: the first's
            members = list(self.shard.broadcast(members))
        if not members:
            return True
        if not self.encoder.idle.wait(limit):
            raise ChannelError(f"the encoder did not finish within {limit:g} s")
        t0 = time.monotonic()
        r.start_final(members, ch.publish)
        deadline = t0 + limit
        while not r.final_complete and time.monotonic() < deadline and not ch.closed:
            ch.wait_any(0.05)
            self.poll()
            r.fold_final()
        ended = r.end_final()
        assert ended is not None
        summary = replace(ended, seconds=round(time.monotonic() - t0, 3))
        self.final_round = summary
        fields = asdict(summary)
        if summary.complete and not summary.counted_otherwise:
            log.info("final_round", step=r.step, **fields)
            return True
        # A member that averaged another number of copies heard other DONEs: said,
        # not failed (a member can claim any count).
        log.warning(
            "final_round_incomplete" if not summary.complete else "final_round_counts_differ",
            step=r.step,
            **fields,
            hint="the replicas may end apart: see the refusals, the members missing "
            "(train.finish_timeout_s) and the daemon's log",
        )
        return summary.complete

    # -- reporting ---------------------------------------------------------------------------

    @property
    def stats(self) -> SyncStats:
        """This replica's figures (keys documented in train.stats and
        docs/reference/api.md)."""
        r = self.replica
        s = r.stats
        return {
            "peer": self.peer,
            "step": r.step,
            "replicas": r.replicas,
            "sends": s.sends,
            "merged_steps": self.schedule.merged_steps,
            "backoffs": s.backoffs,
            "hook_traffic_bytes": r.traffic_bytes(),
            "hook_held_bytes": r.held_bytes(),
            "params_skipped": self.schedule.params_skipped,
            "chunks_sent": s.chunks_sent,
            "bytes_published": s.bytes_published,
            "applied": s.applied,
            "applied_by_origin": {k: p.applied for k, p in r.peers.items()},
            "applied_from": dict(s.applied_from),
            "held_by_state_by_origin": {k: p.held_by_state for k, p in r.peers.items()},
            "refused_by_origin": {k: p.refused for k, p in r.peers.items()},
            "sent_by_origin": {k: p.chunks_sent for k, p in r.peers.items()},
            "params_mixed": s.params_mixed,
            "excused": s.excused,
            "before_state": s.before_state,
            "start_step": self.start_step,
            "restored": self.restored,
            "snapshots_sent": self.state.snapshots_sent,
            "checkpoints_written": self.state.checkpoints_written + self.shard_state.written,
            "checkpoint_path": None if self.checkpoint_path is None else str(self.checkpoint_path),
            "other_runs": s.other_runs,
            "refused": dict(s.refused),
            "clipped": s.clipped,
            "weight_raised": s.weight_raised,
            "set_aside": dict(s.set_aside),
            "agreement_by_origin": {
                k: round(o.agreement, 3) for k, o in r.intake.influence.origins.items()
            },
            "last_refusal": s.last_refusal,
            "staleness_p50": s.staleness_quantile(0.5),
            "staleness_p99": s.staleness_quantile(0.99),
            "staleness_bound": self.config.train.staleness_bound_steps,
            "send_interval": r.send_interval,
            "density": r.density,
            "residual_norm": s.residual_norm,
            "residual_norm_max": s.residual_norm_max,
            "wait_s": self.wait_s,
            "max_wait_s": self.max_wait_s,
            "round_waits": self.round_waits,
            "hook_s": self.hook_s,
            "encoder_s": self.encoder.busy_s,
            "udp_bytes_sent": int(self.channel.stats.get("udp_bytes_sent", 0)),
            "mode": self.config.train.mode,
            "rounds_completed": r.outer.rounds_completed if r.outer is not None else 0,
            "final_round": None if self.final_round is None else asdict(self.final_round),
        }

    def summary(self) -> str:
        """This replica's run in one line, for a person (``stats`` has the figures)."""
        s = self.stats
        refused = sum(s["refused"].values())
        line = (
            f"step {s['step']}: {s['sends']} sends, {s['bytes_published'] / 1e6:.2f} MB "
            f"published; applied {s['applied']} update chunks from {len(s['applied_from'])} "
            f"peer(s); staleness p50 {s['staleness_p50']} p99 {s['staleness_p99']} of "
            f"{s['staleness_bound']} steps; waited {s['wait_s']:.1f} s; {refused} refused"
        )
        final = self.final_round
        if final is not None:
            line += f"; ended as the mean of {final.members} replicas" + (
                "" if final.complete else f" ({len(final.missing)} missing: not one model)"
            )
        if s["checkpoint_path"]:
            line += f"; checkpoint {s['checkpoint_path']}"
        return line

    # -- the state and the store --------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path | None:
        """Where this replica's checkpoints go (a sharded replica's: a directory of
        DCP checkpoints, train.shardckpt); None when nowhere."""
        if self.shard is not None:
            return self.shard_state.path
        return self.state.checkpoint_path

    def checkpoint(self) -> Path | None:
        """Write a checkpoint now (this thread, atomically); its path, or None when no
        checkpoint directory is set. A sharded replica's ranks call it together (each
        writes its shard)."""
        if self.shard is not None:
            return self.shard_state.write(time.monotonic())
        return self.state.checkpoint()

    def begin_at(self, step: int) -> int:
        """Count this replica's steps from ``step`` (a framework's step count restored
        from its own checkpoint), if it started fresh: neither the mesh nor this node's
        checkpoint gave it a state. Before the first :meth:`step`; the step it now
        begins at (``start_step``, unchanged when it came from a state)."""
        if self.replica.stats.steps:
            raise RuntimeError("begin_at before the first step()")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.restored.get("source") == "fresh" and step > self.start_step:
            self.replica.start_at(step)
            self.start_step = step
            self._say_join()  # where it stands now
        return self.start_step

    def install_sigterm(self) -> None:
        """On SIGTERM, the next :meth:`step` writes a checkpoint, closes and exits
        (status 143); before the first step, exit at once. Main thread only."""

        def handler(signum: int, frame: object) -> None:
            self._terminate = True

        signal.signal(signal.SIGTERM, handler)

    def put(self, name: str, obj: Any) -> int:
        """Have the mesh hold ``obj`` (a state dict, tensors, plain values) under
        ``name``; the version it got. Held here and by the ``store.replicas`` nearest
        members, so it outlives this node."""
        return self.state.put(name, obj)

    def get(self, name: str, min_version: int = 0) -> Any:
        """The newest version of ``name`` that the mesh holds (from the nearest holders,
        verified by hash), loaded with ``weights_only``."""
        return self.state.get(name, min_version)

    def close(self) -> None:
        if self.channel.closed and self.encoder.idle.is_set():
            self.encoder.close()
        else:
            self.channel.close()
            self.encoder.close()
        if self.embedded is not None:
            self.embedded.stop()

    def __enter__(self) -> MeshSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
