"""Holding a stream's later copies until host work has finished: a split restore enqueues the loads of pages
still being read from disk at once, behind a gate that opens when the read is done (the caller's thread never
waits on the disk to queue what follows). The gate itself is the Rust core's (``HostGate``, enqueued by a
native thread in order after the stream's earlier background submissions)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import torch

from .. import _native


def gate_until(device: torch.device, stream: Any, future: concurrent.futures.Future[Any],
               previous: Any = None) -> tuple[Any, Any]:
    """``(submission, gate)``: work submitted on CUDA ``stream`` after the submission (pass it as the next
    background submission's ``previous``) does not start on the device before ``future`` is done, whatever its
    result: the caller looks at that before it uses what the work made. ``(None, None)`` when ``future`` is
    already done (nothing to wait for).

    The gate opens from the future's completion callback, which runs on the thread that completed it and needs
    the GIL: a caller that has seen the future done opens it too (``gate.open()``, idempotent), so a thread that
    then blocks on the device while holding the GIL cannot wait on a callback that waits on it. A gate dropped
    unopened opens."""
    if future.done():
        return None, None
    gate = _native.HostGate()
    index = device.index if device.index is not None else torch.cuda.current_device()
    sub = _native.submit_gate_background(index, int(stream.cuda_stream), gate, previous)
    future.add_done_callback(lambda _done: gate.open())
    return sub, gate
