"""The trainer's side of the flat parameter space: parameters as views into buckets,
and the thread that encodes and hands over what the replica sends."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from ciuic_p2p.core.codec.layout import BucketLayout


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


class Encoder:
    """The thread that encodes and publishes this replica's updates (and hands over
    state snapshots) while the trainer computes the next steps (on a GPU, the codec's
    kernels overlap the same way). It takes one job at a time: a step whose update is
    due while it is busy stays in the model's local progress and goes with the next
    send (merged steps)."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(1)
        self.idle = threading.Event()
        self.idle.set()
        self.error: BaseException | None = None
        self.busy_s = 0.0
        self._thread = threading.Thread(target=self._run, name="ciuic-encoder", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self.idle.clear()
        self.jobs.put(job)

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
