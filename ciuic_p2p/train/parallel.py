"""Parts of one computation on several threads: the ``run_parts`` the pure codec takes
(core.codec.select). The CPU top-k scan of a large bucket splits into one part per
torch thread; numpy releases the GIL inside each, so they run at once. One pool per
process, made at first use; the first part runs on the calling thread."""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

R = TypeVar("R")


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(
        max_workers=max(1, torch.get_num_threads() - 1), thread_name_prefix="ciuic-scan"
    )


def thread_parts(fn: Callable[[int], R], parts: int) -> list[R]:
    """``[fn(0), ..., fn(parts - 1)]``, parts 1.. on the pool, part 0 here."""
    if parts <= 1:
        return [fn(i) for i in range(parts)]
    jobs = [_pool().submit(fn, i) for i in range(1, parts)]
    first = fn(0)
    return [first, *(job.result() for job in jobs)]
