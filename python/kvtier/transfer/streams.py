"""The streams a transfer engine issues on beside the caller's: the side streams K and V spread over, and the
detour that copy-engine batches issued from a default stream run on."""

from __future__ import annotations

import threading
from typing import Any

import torch

from .. import _native

#: Stream handles torch reports for a default stream: the legacy NULL stream, ``cudaStreamLegacy`` and
#: ``cudaStreamPerThread``.
DEFAULT_STREAMS = (0, 1, 2)

#: The raw handle of a device's current stream without making a ``torch.cuda.Stream`` (torch's generated code
#: reads it so): ``torch.cuda.current_stream`` cost 3.2 µs of a warm per-layer call's ~30 on the H200
#: (benches/results/h200-probe-host-cost.json). None where this torch lacks it (then the public API is used).
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class Streams:
    """Side streams per caller stream and detours per calling thread, made on first use and kept (one set
    per engine)."""

    def __init__(self) -> None:
        self._side: dict[Any, list[Any]] = {}  # (device, caller stream) -> side streams, LRU order
        self._detours: dict[Any, Any] = {}  # (device, thread) -> (stream default-stream copies run on, fork, join)
        self._batch_api: bool | None = None  # the driver has cuMemcpyBatchAsync (see fork)

    def side_streams(self, device: torch.device, want: int) -> list[Any]:
        """``want`` side streams for the current stream of ``device``: one set per caller stream (the last 8
        kept), so a LayerLoader's V copies never queue behind a backup's on a shared side stream."""
        if want <= 0:
            return []
        key = (device, torch.cuda.current_stream(device).cuda_stream)
        have = self._side.pop(key, [])
        while len(have) < want:
            have.append(torch.cuda.Stream(device))
        self._side[key] = have  # most recently used last
        while len(self._side) > 8:
            self._side.pop(next(iter(self._side)))
        return have[:want]

    def detour(self, device: torch.device) -> Any:
        """``(stream, fork event, join event)`` of the calling thread on ``device`` (see
        :meth:`kvtier.transfer.TransferEngine.detour_stream`)."""
        key = (device, threading.get_ident())
        d = self._detours.get(key)
        if d is None:
            # non-blocking: joined by events only. The fork and join events are re-recorded for every call: a
            # stream wait applies to the record made before it, so reusing them saves creating two per call.
            d = self._detours[key] = (torch.cuda.Stream(device), torch.cuda.Event(), torch.cuda.Event())
        return d

    def fork(self, device: torch.device, caller: Any, batch: bool) -> Any:
        """None when copy-engine batches (``batch``: the engine submits them) may be submitted on ``caller``
        itself. Otherwise (``caller`` is a default stream, which the batch API refuses) the detour ``(stream,
        fork, join)``, its stream made to wait for everything ``caller`` was given so far; :meth:`join` then
        makes ``caller`` wait for what the detour was given."""
        if not (batch and caller.cuda_stream in DEFAULT_STREAMS):
            return None
        # whether the driver has the batch API: asked once (should the core later turn batching off after a
        # refused batch, copies from a default stream still take the detour: same order, a fork/join more)
        if self._batch_api is None:
            self._batch_api = _native.cuda_batch_supported()
        if not self._batch_api:
            return None
        d = self.detour(device)
        d[1].record(caller)
        d[0].wait_event(d[1])
        return d

    @staticmethod
    def join(caller: Any, d: Any) -> None:
        """Make ``caller`` wait for what the detour ``d`` (:meth:`fork`) was given."""
        d[2].record(d[0])
        caller.wait_event(d[2])

    def clear(self) -> None:
        """Drop the side streams (a closing engine calls it)."""
        self._side.clear()
