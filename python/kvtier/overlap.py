"""Stream and event discipline for host↔device KV transfers.

- :class:`LayerLoader` issues ``load_to_device_per_layer`` for every layer on a side stream and records one
  CUDA event per layer; :meth:`LayerLoad.wait` makes the *current* (compute) stream wait for that layer
  only, so layer i+1 moves while layer i computes. Three event sets rotate (as HiCache does), so up to
  three loads may be in flight; a set is reused only after its previous load has finished.
- :func:`backup_async` orders a device→host backup after the producer of the device KV (an event, or the
  caller's current stream at the time of the call) and reports completion with an event, never by
  blocking the caller.

On CPU device pools every call runs synchronously and waits are no-ops.
"""

from __future__ import annotations

from typing import Any

import torch

from ._errors import InvalidArgumentError
from ._device import device_of


class LayerLoad:
    """One in-flight per-layer load. Keeps its index tensors alive until it completes.

    For the ``direct`` backend the copies are submitted by a native thread (a large load would otherwise
    hold the calling thread inside the driver until most of it had been transferred); :meth:`wait` then
    blocks the host only until that thread has enqueued the layer, which is as far ahead of the copy engine
    as the driver's queue allows."""

    def __init__(self, events: list[Any] | None, refs: tuple[Any, ...], submission: Any = None) -> None:
        self._events = events
        self._refs = refs
        self._submission = submission

    def wait(self, layer: int) -> None:
        """Make the current stream wait until ``layer`` has arrived on the device."""
        if self._events is None:
            return
        if not 0 <= layer < len(self._events):
            raise InvalidArgumentError(f"invalid argument `layer`: must be in [0, {len(self._events)}), got {layer}")
        if self._submission is not None:
            self._submission.wait_recorded(layer)
        stream = torch.cuda.current_stream()
        for ev in self._events[layer]:  # one per lane (K and V may move on separate streams)
            stream.wait_event(ev)

    def done(self) -> bool:
        """True once every layer has arrived."""
        if self._events is None:
            return True
        return (self._submission is None or self._submission.finished()) and all(ev.query() for ev in self._events[-1])

    def synchronize(self) -> None:
        """Block the host until every layer has arrived."""
        if self._events is not None:
            if self._submission is not None:
                self._submission.join()
            for ev in self._events[-1]:
                ev.synchronize()


class LayerLoader:
    """Per-layer loads of ``host_pool`` into ``device_pool`` on a side stream (see the module docs).

    Args:
        host_pool: a kvtier host pool.
        device_pool: the device pool the host pool was built for.
        io_backend: ``"direct"`` or ``"kernel"``.
        stream: the transfer stream (default: a new stream on the device pool's device).
        event_sets: how many loads may be in flight at once (default 3).
    """

    def __init__(self, host_pool: Any, device_pool: Any, io_backend: str = "direct", *, stream: Any = None, event_sets: int = 3) -> None:
        if event_sets < 1:
            raise InvalidArgumentError(f"invalid argument `event_sets`: must be >= 1, got {event_sets}")
        if io_backend not in ("direct", "kernel"):
            raise InvalidArgumentError(f"invalid argument `io_backend`: {io_backend!r}; expected 'direct' or 'kernel'")
        self.host_pool, self.device_pool, self.io_backend = host_pool, device_pool, io_backend
        self.device = device_of(device_pool)
        self.cuda = self.device.type == "cuda"
        self.layer_num = host_pool.layer_num
        if self.cuda:
            self.stream = stream if stream is not None else torch.cuda.Stream(self.device)
            engine = getattr(host_pool, "engine", None)
            lanes = engine.lanes_for(io_backend, host_pool.sides()) if engine is not None else 1
            # per set, per layer: one event per lane
            self._sets = [[[torch.cuda.Event() for _ in range(lanes)] for _ in range(self.layer_num)]
                          for _ in range(event_sets)]
            with torch.cuda.stream(self.stream):  # create the events (torch does so on first record)
                for events in self._sets:
                    for evs in events:
                        for ev in evs:
                            ev.record()
            self._loads: list[LayerLoad | None] = [None] * event_sets
            self._last_submission = None
        self._next = 0

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor, *, after: Any = None) -> LayerLoad:
        """Issue all layers; returns a :class:`LayerLoad`. ``after``: an event the copies must follow
        (default: the current stream at the time of the call, e.g. the allocation of ``device_indices``)."""
        if not self.cuda:
            for layer in range(self.layer_num):
                self.host_pool.load_to_device_per_layer(self.device_pool, host_indices, device_indices, layer, self.io_backend)
            return LayerLoad(None, ())
        slot = self._next % len(self._sets)
        self._next += 1
        events = self._sets[slot]
        previous = self._loads[slot]
        if previous is not None:
            self._loads[slot] = None  # even if the old load failed: its error was its waiter's to see
            try:
                previous.synchronize()  # the load that used this set must be finished before reuse
            except Exception:  # noqa: BLE001 - a failed submission has waited for what it enqueued
                pass
        if after is None:
            after = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self.stream):
            fused = getattr(self.host_pool, "load_all_layers", None)
            submission = None
            if fused is not None:  # kvtier pools: validate and plan once, one native call for every layer
                # background submissions on this stream follow each other in call order
                submission = fused(self.device_pool, host_indices, device_indices, self.io_backend, events,
                                   after=after, previous=self._last_submission)
                if submission is not None:
                    self._last_submission = submission
            else:
                self.stream.wait_event(after)
                for layer in range(self.layer_num):
                    self.host_pool.load_to_device_per_layer(self.device_pool, host_indices, device_indices, layer, self.io_backend)
                    for ev in events[layer]:
                        ev.record(self.stream)
        if isinstance(device_indices, torch.Tensor) and device_indices.is_cuda:
            device_indices.record_stream(self.stream)
        if isinstance(host_indices, torch.Tensor) and host_indices.is_cuda:
            host_indices.record_stream(self.stream)
        load = LayerLoad(events, (host_indices, device_indices, after), submission)
        self._loads[slot] = load
        return load


def backup_async(
    host_pool: Any,
    device_pool: Any,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    io_backend: str = "direct",
    *,
    after: Any = None,
    stream: Any = None,
) -> Any:
    """Device → host backup of every layer on ``stream`` (default: a new side stream), ordered after
    ``after`` (an event; default: the current stream now, i.e. after whatever produced the KV). Returns an
    event that completes with the backup (``None`` for CPU device pools, which copy synchronously)."""
    device = device_of(device_pool)
    if device.type != "cuda":
        host_pool.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)
        return None
    if after is None:
        after = torch.cuda.current_stream(device).record_event()
    stream = stream if stream is not None else torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        stream.wait_event(after)
        host_pool.backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)
        done = stream.record_event()
    for t in (host_indices, device_indices):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)
    return done
