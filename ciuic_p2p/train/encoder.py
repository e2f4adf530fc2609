"""The trainer's side of the flat parameter space: parameters as views into buckets,
the thread that encodes and hands over what the replica sends, and the gate that
keeps its reads of the model and the training thread's adds apart.

On CUDA the encoder thread runs its kernels on a side stream of its own: the training
thread only records an event after the optimizer's step (no host sync), the side
stream waits for it, and the gate's events order the side stream's read of the
parameters and the training stream's adds of peers' chunks on the device as its lock
orders them on the host. Host syncs (the threshold, the candidates' count, the packed
bytes) block the encoder thread on its own stream, never the training thread."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ciuic_p2p.core.codec.layout import BucketLayout, canonical_name


def check_unsharded(model: torch.nn.Module) -> None:
    """Raise ValueError, naming the parameter and what to do instead, when a trainable
    parameter is sharded (a DTensor: FSDP2's ``fully_shard``, tensor parallelism): the
    hook makes each parameter a view into flat buckets of the whole model, which a
    shard is not (before, attach failed deep inside with "aten.copy_.default got mixed
    torch.Tensor and DTensor")."""
    for name, p in model.named_parameters():
        if p.requires_grad and hasattr(p, "placements") and hasattr(p, "to_local"):
            raise ValueError(
                f"{canonical_name(name)} is a DTensor (sharded by FSDP2's fully_shard or "
                "tensor parallelism): pass the node's ranks as process_group= (attach "
                "takes FSDP2's row shards: docs/guides/frameworks.md)"
            )


def flatten_parameters(model: torch.nn.Module, layout: BucketLayout) -> list[torch.Tensor]:
    """Move the model's trainable parameters into flat fp32 buckets on their device and
    make each parameter a view into its bucket (values kept)."""
    check_unsharded(model)
    params = {canonical_name(n): p for n, p in model.named_parameters()}
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


class ThreadGate:
    """core.replica.parameters.AccessGate between the training thread and the encoder
    thread (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self._lock = threading.Lock()
        self._cuda = device.type == "cuda"
        self._read_done: Any = None
        self._write_done: Any = None

    def enter_write(self, wait: bool) -> bool:
        if not self._lock.acquire(blocking=wait):
            return False
        if self._read_done is not None:
            torch.cuda.current_stream().wait_event(self._read_done)
        return True

    def exit_write(self) -> None:
        if self._cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._write_done = event
        self._lock.release()

    def enter_read(self) -> None:
        self._lock.acquire()
        if self._write_done is not None:
            torch.cuda.current_stream().wait_event(self._write_done)

    def exit_read(self) -> None:
        if self._cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._read_done = event
        self._lock.release()


class Encoder:
    """The thread that encodes and publishes this replica's updates (and hands over
    state snapshots) while the trainer computes the next steps (on a GPU, the codec's
    kernels overlap the same way). It takes one job at a time: a step whose update is
    due while it is busy stays in the model's local progress and goes with the next
    send (merged steps)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._side: Any = None
        if device is not None and device.type == "cuda":
            self._side = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(1)
        self.idle = threading.Event()
        self.idle.set()
        self.error: BaseException | None = None
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name="ciuic-encoder", daemon=True)
        self._thread.start()

    def mark(self) -> Any:
        """On CUDA, an event after the work queued so far on the training stream (the
        optimizer's step), for :meth:`submit`'s job to wait for; None elsewhere."""
        if self._side is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

    def submit(self, job: Callable[[], None], after: Any = None) -> None:
        """Run ``job`` on the encoder thread (on CUDA on the side stream, once the
        training stream has reached ``after``, an event from :meth:`mark`)."""
        self.idle.clear()
        if self._side is None:
            self.jobs.put(job)
            return
        side = self._side

        def on_side_stream() -> None:
            with self._stream(side, after):
                job()
            side.synchronize()  # its tensors are done before the next job reuses them

        self.jobs.put(on_side_stream)

    @staticmethod
    @contextlib.contextmanager
    def _stream(side: Any, after: Any) -> Iterator[None]:
        if after is not None:
            side.wait_event(after)
        with torch.cuda.stream(side):
            yield

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            t0 = time.perf_counter()
            try:
                job()
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
