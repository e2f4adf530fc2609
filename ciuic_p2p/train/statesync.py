"""A replica's state, as :class:`~ciuic_p2p.train.hook.MeshSync` keeps it: restoring
from the mesh or a checkpoint at attach, handing snapshots to the daemon for joiners,
writing checkpoints (when the schedule says, at the end, on SIGTERM), and the shared
store's ``put``/``get`` (docs/architecture.md, "How a node joins a run")."""

from __future__ import annotations

import contextlib
import io
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from ciuic_p2p.config import Config
from ciuic_p2p.core.codec.layout import BucketLayout
from ciuic_p2p.core.replica.rule import Replica
from ciuic_p2p.core.replica.schedule import ReplicaSchedule
from ciuic_p2p.core.store.messages import ANY_VERSION
from ciuic_p2p.core.store.runstate import (
    RunWindow,
    agreement_refusal,
    run_window,
    state_refusal,
)
from ciuic_p2p.core.store.statefile import (
    DTYPES,
    StateFormatError,
    pack_state,
    read_header,
    unpack_state,
)
from ciuic_p2p.logsetup import get_logger
from ciuic_p2p.train.channel import ChannelError, DaemonAway, DaemonChannel
from ciuic_p2p.train.checkpoint import Checkpoint, load_newest, write_checkpoint
from ciuic_p2p.train.encoder import Encoder

log = get_logger("ciuic.train")
MAX_STATE_TRIES = 4
"""States refused (each of other writers) before a joiner gives up on the mesh's."""
SAMPLE_SPANS = 4
SAMPLE_SPAN_BYTES = 8192
"""What a joiner samples of each other replica's state: 4 spans of 8 KiB at random
places of the parameters. A state forged over a fraction f of the parameters escapes
all four with probability (1 - f)^4 (a third of the model: 20%; half: 6%)."""


class StateKeeper:
    """One replica's state and its copies: in the mesh, in checkpoints."""

    def __init__(
        self,
        *,
        config: Config,
        channel: DaemonChannel,
        replica: Replica,
        layout: BucketLayout,
        buckets: list[torch.Tensor],
        optimizer: torch.optim.Optimizer | None,
        encoder: Encoder,
        schedule: ReplicaSchedule,
        checkpoint_dir: Path | None,
    ) -> None:
        self.config = config
        self.channel = channel
        self.replica = replica
        self.layout = layout
        self.buckets = buckets
        self.optimizer = optimizer
        self.encoder = encoder
        self.schedule = schedule
        run_hex = replica.source.run_id.hex()
        self.state_name = "state/" + run_hex
        self.checkpoint_path = (
            None if checkpoint_dir is None else checkpoint_dir / f"{run_hex}.ckpt"
        )
        self.snapshots_sent = 0
        self.checkpoints_written = 0
        self.checkpoints_failed = 0
        self._ckpt: Checkpoint | None = None
        self._state_ask: tuple[int, float] | None = None
        """The state fetch under way (request ID, when asked), once one is."""

    def load_checkpoint(self) -> None:
        self._ckpt = load_newest(self.checkpoint_path) if self.checkpoint_path else None

    def ask_state_if_behind(self) -> None:
        """Start fetching the run's state as soon as a replica is known to be past this
        node's checkpoint: attach goes on waiting for the other replicas' answers while
        the daemon fetches."""
        if self._state_ask is not None:
            return
        ckpt_step = self._ckpt.step if self._ckpt else 0
        if max((p.step for p in self.replica.peers.values()), default=0) > ckpt_step:
            # A state the daemon prefetched after a restart will do: it holds the
            # chunks since, and this replica drops those the state holds.
            self._state_ask = (self._ask_state(self.writers(), held_ok=True), time.monotonic())

    def writers(self) -> set[str]:
        """Whose state may be taken: the run's replicas (and this node: a state its
        daemon prefetched and holds as its own)."""
        stateless = self.replica.roster.stateless  # sharded replicas hand none
        return {*(p for p in self.replica.peers if p not in stateless), self.replica.peer}

    def window(self) -> RunWindow | None:
        announced = {k: p.step for k, p in self.replica.peers.items()}
        bound = self.config.train.staleness_bound_steps
        behind = max(bound, self.config.store.state_version_slack_steps)
        return run_window(announced, bound, behind)

    def start_of(self, version: int) -> int:
        """Where a replica starts from a state of ``version``: its own step, or the
        run's (the replicas' lower median) where it is a little further on (their
        chunks since are held for this trainer); a claim beyond the staleness bound is
        no replica's word to start from."""
        window = self.window()
        peer_step = max((p.step for p in self.replica.peers.values()), default=0)
        run_step = peer_step if window is None else window.step
        ahead = min(run_step, version + self.config.train.staleness_bound_steps)
        return max(version, ahead)

    def _ask_state(self, writers: set[str], held_ok: bool) -> int:
        """Ask the daemon for a state of the run written by one of ``writers``, no
        further on than the run's window (core.store.runstate)."""
        ckpt_step = self._ckpt.step if self._ckpt else 0
        window = self.window()
        return self.channel.ask_object(
            self.state_name,
            min_version=ckpt_step + 1,
            slack=self.config.store.state_version_slack_steps,
            held_ok=held_ok,
            writers=sorted(writers),
            max_version=None if window is None else window.high,
            # A state that others must vouch for is one writer's, not a mix.
            one_writer=self._vouching(),
        )

    def _vouching(self) -> bool:
        """Whether a state must agree with other replicas' samples: where the run has
        two or more other replicas (with one, there is nobody else to ask)."""
        stateless = self.replica.roster.stateless
        return sum(1 for p in self.replica.peers if p not in stateless) >= 2

    def _vouch(
        self, data: bytes | bytearray | memoryview, whose: set[str], window: RunWindow | None
    ) -> dict[str, Any]:
        """Sample other replicas' states at random spans of the parameters and compare
        them with ``data`` (core.store.runstate.agreement_refusal); raises
        :class:`StateFormatError` when they do not vouch for it; what was measured."""
        s = self.config.store
        stateless = self.replica.roster.stateless
        others = [
            p
            for p in self.replica.peers
            if p not in whose and p != self.replica.peer and p not in stateless
        ]
        rng = random.Random(os.urandom(16))  # spans nobody can foresee
        rng.shuffle(others)
        vouchers = others[: s.state_vouchers]
        header, start = read_header(data)
        spans = sample_spans(header, start, rng, SAMPLE_SPANS, SAMPLE_SPAN_BYTES)
        distances: dict[str, float | None] = dict.fromkeys(vouchers)
        if vouchers and spans:
            low = 0 if window is None else window.low
            high = ANY_VERSION if window is None else window.high
            got = self.channel.sample_state(
                self.state_name, vouchers, [(at, n) for at, n, _ in spans],
                min_version=low, max_version=high, timeout_s=s.fetch_timeout_s + 30.0,
            )  # fmt: skip
            for voucher, answer in got.items():
                if isinstance(answer, tuple):
                    distances[voucher] = span_distance(data, answer[1], spans)
        why = agreement_refusal(distances, s.state_agreement_tolerance)
        verdict = {
            "vouchers": len(vouchers),
            "distances": {w: None if d is None else round(d, 4) for w, d in distances.items()},
        }
        log.info("state_vouched" if why is None else "state_not_vouched", **verdict)
        if why is not None:
            raise StateFormatError(why)
        return verdict

    def _take_state(
        self, opt: torch.optim.Optimizer | None
    ) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        """The first state fetched that agrees with the run (core.store.runstate, and
        every value finite), unpacked into the buckets: its meta and the daemon's
        report; each one refused on the way (its writers are not asked again). Empty
        dicts when none was taken."""
        assert self._state_ask is not None
        rid, _ = self._state_ask
        s = self.config.store
        writers = self.writers()
        refused: list[dict[str, Any]] = []
        while True:
            try:
                data, got = self.channel.object_got(rid, self.state_name, s.fetch_timeout_s + 30.0)
            except ChannelError:
                if not refused:
                    raise
                return {}, {}, refused
            window = self.window()
            version = int(got["version"])

            whose = {str(w) for w in got.get("writers") or [got.get("writer")] if w}

            def check(
                meta: dict[str, Any],
                version: int = version,
                window: RunWindow | None = window,
                data: bytearray = data,
                whose: set[str] = whose,
                got: dict[str, Any] = got,
            ) -> None:
                why = (
                    None
                    if window is None
                    else state_refusal(window, version, meta.get("applied", {}))
                )
                if why is not None:
                    raise StateFormatError(why)
                if self._vouching():  # before a single value is copied in
                    got["vouched"] = self._vouch(data, whose, window)

            try:
                meta = unpack_state(
                    data, self.layout.layout_id, self.buckets, opt, self._momentum(), check
                )
                return meta, got, refused
            except StateFormatError as exc:
                # A state of another model is no replica's either: asked again too.
                refused.append({"writers": sorted(whose), "version": version, "reason": str(exc)})
                log.warning(
                    "state_refused", writers=sorted(whose), version=version, reason=str(exc)
                )
                writers -= whose
                if not writers or len(refused) >= MAX_STATE_TRIES or not whose:
                    return {}, {}, refused
                rid = self._ask_state(writers, held_ok=False)

    def restore(self) -> dict[str, Any]:
        """Start from the newest state there is: the replicas' (fetched from the nearest
        up-to-date one) when they are past this node's checkpoint, else the checkpoint,
        else (a run that starts now) the model as it is. A replica never trains from
        its fresh weights while the others are mid-run: a failed fetch raises. A
        fetched state is taken only when it agrees with the run (its step within the
        replicas' window, its floors within what each origin announced, every value
        finite: core.store.runstate); one that does not is refused, logged
        (``state_refused``) and listed in the info's ``refused``, and another replica's
        is asked for; when none agrees, the checkpoint or the model as it is."""
        t0 = time.monotonic()
        r = self.replica
        ckpt = self._ckpt
        opt = self.optimizer if self.config.store.sync_optimizer_state else None
        info: dict[str, Any] = {"source": "fresh", "step": 0}
        self.ask_state_if_behind()
        refused: list[dict[str, Any]] = []
        got: dict[str, Any] = {}
        if self._state_ask is not None:
            _, asked_at = self._state_ask
            meta, got, refused = self._take_state(opt)
            info["while_waiting_s"] = round(t0 - asked_at, 3)  # fetched during attach's wait
            t0 = asked_at
        if got:
            version = int(got["version"])
            start = self.start_of(version)
            applied = meta.get("applied", {})
            info = {**info, "source": "mesh", "step": start, "state_version": got["version"]}
            info.update(got)
            info["daemon_s"] = got.get("seconds")  # query and transfer; "seconds": all
        elif ckpt is not None:
            try:
                meta = unpack_state(
                    ckpt.state, self.layout.layout_id, self.buckets, opt, self._momentum()
                )
            except StateFormatError as exc:
                raise ChannelError(f"{ckpt.path} does not fit this model: {exc}") from None
            start = ckpt.step
            applied = meta.get("applied", {})
            info = {"source": "checkpoint", "step": start, "bytes": len(ckpt.state)}
        else:
            start, applied, meta = 0, {}, {}
        if refused:
            info["refused"] = refused
        if refused and not got:
            # No state on the mesh agreed with the run: this node's checkpoint, or
            # (none) the model as it is, rather than a state that would take it over.
            log.warning("state_refused_all", refused=len(refused), source=info["source"])
        next_round = meta.get("next_round")
        r.start_at(
            start,
            applied if isinstance(applied, dict) else {},
            next_round if isinstance(next_round, int) else None,
            finals_of(meta.get("finals"), self.config.train.staleness_bound_steps),
            reached_of(meta.get("reached")),
        )
        info["seconds"] = round(time.monotonic() - t0, 3)
        if info["source"] != "fresh":
            log.info("state_restored", **{k: v for k, v in info.items() if k != "id"})
        return info

    def _pack(self) -> tuple[bytearray, bytes]:
        self.replica.flush()
        opt = self.optimizer if self.config.store.sync_optimizer_state else None
        r = self.replica
        return pack_state(
            self.layout.layout_id, r.shared_params(), opt, r.state_meta(), r.shared_momentum()
        )

    def _momentum(self) -> list[torch.Tensor]:
        outer = self.replica.outer
        return outer.buffers if outer is not None else []

    def hand_state(self, write_checkpoint_too: bool) -> None:
        """Snapshot the state (training thread: a consistent copy) and hand it to the
        daemon for joiners, and to the checkpoint file, on the encoder thread."""
        self.channel.snapshot_wanted.clear()
        blob, compat = self._pack()
        step = self.replica.step
        path = self.checkpoint_path if write_checkpoint_too else None
        if path is not None:
            self.schedule.checkpointed(time.monotonic())

        def job() -> None:
            try:
                self.channel.put_parts(self.state_name, step, blob, compat)
                self.snapshots_sent += 1
            except DaemonAway:
                pass  # restarting: the next snapshot goes to the daemon that comes back
            if path is not None:
                self._write_checkpoint(path, step, blob, compat)

        self.encoder.submit(job)

    def _write_checkpoint(
        self, path: Path, step: int, blob: bytes | bytearray, compat: bytes
    ) -> bool:
        """Write one; False when the disk refused it (full, not writable): logged, and
        training goes on (checkpoints are on by default: a full disk must not end a
        run that the mesh keeps anyway)."""
        try:
            digest = write_checkpoint(path, step, blob, compat)
        except OSError as exc:
            self.checkpoints_failed += 1
            log.error(
                "checkpoint_not_written",
                path=str(path),
                step=step,
                error=exc.strerror or str(exc),
                hint="training goes on; free the disk or set store.checkpoint_dir",
            )
            return False
        self.checkpoints_written += 1
        # The daemon's audit log records it; a daemon gone by now changes nothing here.
        with contextlib.suppress(ChannelError):
            self.channel.checkpoint_written(path, step, digest)
        return True

    def checkpoint(self) -> Path | None:
        """Write a checkpoint now (this thread, atomically); its path, or None when no
        checkpoint directory is set or the disk refused it (logged)."""
        if self.checkpoint_path is None:
            return None
        self.encoder.idle.wait(self.config.train.finish_timeout_s)
        blob, compat = self._pack()
        written = self._write_checkpoint(self.checkpoint_path, self.replica.step, blob, compat)
        self.schedule.checkpointed(time.monotonic())
        return self.checkpoint_path if written else None

    def put(self, name: str, obj: Any) -> int:
        """Have the mesh hold ``obj`` (a state dict, tensors, plain values) under
        ``name``; the version it got. Held here and by the ``store.replicas`` nearest
        members, so it outlives this node."""
        if name.startswith("state/"):
            raise ValueError("names under state/ are the runs' own")
        buf = io.BytesIO()
        torch.save(obj, buf)
        return int(self.channel.put_object(name, buf.getbuffer())["version"])

    def get(self, name: str, min_version: int = 0) -> Any:
        """The newest version of ``name`` that the mesh holds (from the nearest holders,
        verified by hash), loaded with ``weights_only``."""
        data, _ = self.channel.get_object(name, min_version=min_version, patient=False)
        return torch.load(io.BytesIO(data), weights_only=True)


Span = tuple[int, int, torch.dtype]
"""(offset in the state's bytes, bytes, dtype of the values there)."""


def sample_spans(
    header: dict[str, Any], start: int, rng: random.Random, count: int, span_bytes: int
) -> list[Span]:
    """``count`` spans of at most ``span_bytes`` at places drawn uniformly over the
    parameter buckets' bytes (each span inside one bucket, on whole values)."""
    buckets: list[tuple[int, int, torch.dtype]] = []
    for entry in header.get("tensors", []):
        key, dtype, _, offset, nbytes = entry
        torch_dtype = DTYPES.get(str(dtype))
        floating = torch_dtype is not None and torch_dtype.is_floating_point
        if str(key).startswith("bucket/") and floating and nbytes > 0:
            assert torch_dtype is not None
            buckets.append((start + int(offset), int(nbytes), torch_dtype))
    total = sum(n for _, n, _ in buckets)
    spans: list[Span] = []
    for _ in range(count if total else 0):
        at = rng.randrange(total)
        for offset, nbytes, dtype in buckets:
            if at < nbytes:
                size = torch.empty((), dtype=dtype).element_size()
                first = at // size * size
                length = min(span_bytes, nbytes - first) // size * size
                spans.append((offset + first, max(size, length), dtype))
                break
            at -= nbytes
    return spans


def span_distance(state: bytes | bytearray | memoryview, sample: bytes, spans: list[Span]) -> float:
    """The relative distance ``||a - b|| / max(||a||, ||b||)`` between ``state``'s values
    at ``spans`` and ``sample`` (those spans of another state, end to end); 2.0 (the
    most two vectors differ by, relatively) for a sample of the wrong size or with
    values that are not finite."""
    view = memoryview(state)
    if len(sample) != sum(n for _, n, _ in spans):
        return 2.0
    diff_sq = a_sq = b_sq = 0.0
    at_sample = 0
    for at, n, dtype in spans:
        a = torch.frombuffer(bytearray(view[at : at + n]), dtype=dtype).double()
        b = torch.frombuffer(bytearray(sample[at_sample : at_sample + n]), dtype=dtype).double()
        at_sample += n
        diff_sq += float((a - b).square().sum())
        a_sq += float(a.square().sum())
        b_sq += float(b.square().sum())
    if not all(math.isfinite(x) for x in (diff_sq, a_sq, b_sq)):
        return 2.0
    scale = math.sqrt(max(a_sq, b_sq))
    return 0.0 if scale == 0.0 else min(2.0, math.sqrt(diff_sq) / scale)


MAX_FINALS = 4096
"""Origins a state's ``finals`` may name (as many as accounts are kept for)."""


def finals_of(raw: object, bound: int) -> dict[str, tuple[int, int]]:
    """A state's ``finals`` (core.replica.rule ``final_stamps``), each checked: a last
    step and a stamp at most the staleness bound past it; anything else is dropped
    (a state's meta is a peer's word)."""
    finals: dict[str, tuple[int, int]] = {}
    if not isinstance(raw, dict):
        return finals
    for origin, pair in list(raw.items())[:MAX_FINALS]:
        if (
            isinstance(origin, str)
            and isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
            and 0 <= pair[0] < pair[1] <= pair[0] + bound
        ):
            finals[origin] = (pair[0], pair[1])
    return finals


MAX_REACHED = 1 << 40
"""The most chunks of one origin a state may say it holds."""


def reached_of(raw: object) -> dict[str, tuple[int, int]] | None:
    """A state's ``reached`` (core.replica.rule ``reached_counts``), each pair
    checked; None for a state without one (an older writer's), and entries out of
    range are dropped (a state's meta is a peer's word)."""
    if not isinstance(raw, dict):
        return None
    reached: dict[str, tuple[int, int]] = {}
    for origin, pair in list(raw.items())[:MAX_FINALS]:
        if (
            isinstance(origin, str)
            and isinstance(pair, list)
            and len(pair) == 2
            and all(type(n) is int for n in pair)
            and 0 <= pair[1] <= pair[0] <= MAX_REACHED
        ):
            reached[origin] = (pair[0], pair[1])
    return reached
