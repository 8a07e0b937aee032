"""What one :class:`~kvtier.integrations.transformers.KVTier` shares with its caches and its calibration:
:class:`TierRuntime` (the model's KV geometry, the host pool and controller, the counters, the tier's transfer
stream and its clock), with the counters (:class:`TransformersStats`) and the clock (:class:`Marks`).

The bottom of the transformers integration: it imports nothing of it. ``KVTier`` builds one runtime and hands it
to every cache it makes; the user never receives it.

Nothing here waits for the GPU: a forward is timed by two CUDA events (the clock on the CPU) and read once the
later one has passed, at the next forward or the next restore."""

from __future__ import annotations

import atexit
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ... import _native
from ..._errors import ClosedError
from ...pools_base import host_memory_available
from ...transfer.gate import gate_until


@dataclass
class TransformersStats:
    """Counters of one :class:`KVTier` (every cache it made)."""

    caches: int = 0
    restored_pages: int = 0  # pages of a prompt served instead of computed ...
    restored_host_pages: int = 0  # ... from the host pool
    restored_store_pages: int = 0  # ... from the store (or the cluster tier behind it)
    recomputed_head_tokens: int = 0  # cached tokens recomputed while the rest of their prefix loaded (split plans)
    computed_tokens: int = 0  # tokens whose KV the model computed (summed over layers / layers)
    adopted_pages: int = 0  # full pages handed to the index (then to the store)
    layer_loads: int = 0  # host -> device per-layer loads
    on_demand_loads: int = 0  # ... of which a layer waited for because it had not been prefetched
    unverified_sequences: int = 0  # caches fed tokens the pre-hook did not see (nothing of them persisted)
    resident_layers: int = 0  # layers the last cache kept on the device (its window; window="auto" sizes it)


#: the share of the device's free memory (at a sequence's start) an automatic window's slots may take
AUTO_WINDOW_SHARE = 0.5


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation can take on ``device`` now: on CUDA the driver's free memory plus what torch's
    caching allocator holds unused; on the CPU the kernel's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return host_memory_available()


class Marks:
    """Points in time on the model's device: ``mark()`` now; ``after(start, end, fn)`` calls ``fn(seconds)``
    once ``end`` has passed (polled by :meth:`poll`, never waited for)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._waiting: list[tuple[Any, Any, Any]] = []

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def after(self, start: Any, end: Any, fn: Any) -> None:
        self._waiting.append((start, end, fn))
        if len(self._waiting) > 256:  # a caller that never polls: keep the newest
            del self._waiting[:128]

    def poll(self, wait: bool = False) -> None:
        keep = []
        for start, end, fn in self._waiting:
            if not self.cuda:
                fn(end - start)
            elif wait or end.query():
                end.synchronize()
                fn(start.elapsed_time(end) / 1e3)
            else:
                keep.append((start, end, fn))
        self._waiting = keep


class _Running:
    """The release threads running in the process (:meth:`TierRuntime.release_later`, every tier's)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.count = 0


_RELEASING = _Running()
EXIT_RELEASE_WAIT_S = 10.0


@atexit.register
def _wait_for_releases_at_exit() -> None:
    """A release thread still inside torch or the native core when the interpreter finalizes aborts the process:
    the exit waits for them (at most :data:`EXIT_RELEASE_WAIT_S`; a release waits for reads with deadlines)."""
    end = time.monotonic() + EXIT_RELEASE_WAIT_S
    with _RELEASING.cv:
        while _RELEASING.count and time.monotonic() < end:
            _RELEASING.cv.wait(max(0.0, end - time.monotonic()))


class TierRuntime:
    """The state one ``KVTier`` and its caches share (every attribute is read by both; ``KVTier`` builds it).

    Geometry: ``layers``, ``window``, ``heads``, ``k_dim``, ``v_dim``, ``dtype``, ``device``, ``cuda``,
    ``page_size``, ``host_tokens``. Tiers: ``host`` (the pinned host pool), ``controller``. The model:
    ``model`` (a weak reference), ``cache_kwarg`` (the name its forward takes a cache by), ``text_config`` and
    ``attn_implementation`` (the attention the namespace was made with). Policy and counters: ``restore``,
    ``stats``. Measuring: ``marks`` (the clock), ``observe`` (whether forwards are timed now). Transfers:
    ``stream`` (None on the CPU), ``lanes``, and :meth:`transfer` / :meth:`drain` / :meth:`fence`.
    ``closed``: set by ``KVTier.close``."""

    def __init__(self, *, layers: int, window: int | None, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device, page_size: int, host_tokens: int, host: Any, controller: Any,
                 stats: TransformersStats, restore: str, model: Any, cache_kwarg: str, text_config: Any,
                 attn_implementation: Any, stream: Any, lanes: int) -> None:
        self.layers, self.window, self.heads, self.k_dim, self.v_dim = layers, window, heads, k_dim, v_dim
        self.dtype, self.device, self.cuda = dtype, device, device.type == "cuda"
        self.page_size, self.host_tokens = page_size, host_tokens
        self.host, self.controller, self.stats, self.restore = host, controller, stats, restore
        self.model, self.cache_kwarg = model, cache_kwarg
        self.text_config, self.attn_implementation = text_config, attn_implementation
        self.marks = Marks(device)
        self.observe = True
        self.stream, self.lanes = stream, lanes
        self.closed = False
        self._sub: Any = None  # the last background submission on self.stream (transfers follow it in order)
        self._subs: list[Any] = []  # every submission since the last fence: each one's error must be seen
        self._subs_lock = threading.Lock()
        self._head_stream: Any = None
        # a split restore's tail loads when every layer is resident (CUDA): a stream of their own, so they wait
        # for the store's read only, never behind the head's backups on ``stream``
        self._tail_stream: Any = None
        self._tail_sub: Any = None
        self._releasing = 0  # caches collected whose release runs on a thread of its own (release_later)
        self._released = threading.Condition()

    def resident_layers(self, slot_bytes: int) -> int:
        """Layers a new sequence keeps on the device, ``slot_bytes`` being one layer's slot for it: the fixed
        window, or (``window="auto"``, :attr:`window` None) every layer when their slots take at most
        :data:`AUTO_WINDOW_SHARE` of the device's free memory now, else as many as do (at least
        ``min(2, layers)``: a layer computes while the next one loads)."""
        if self.window is not None:
            return int(self.window)
        fit = int(AUTO_WINDOW_SHARE * free_bytes(self.device)) // max(1, slot_bytes)
        return max(min(2, self.layers), min(self.layers, fit))

    def release_later(self, release: Any) -> None:
        """``release()`` on a thread of its own: the release of a garbage-collected cache, which may wait for a
        store read or transfers in flight, and a collection can run on any thread, inside any lock (the
        controller's among them, which a stalled read's deadline takes before it opens the gates that those
        transfers wait behind). :meth:`wait_releases` waits for it."""
        if sys.is_finalizing():  # (the process is ending: its pages go with it)
            return
        with self._released:
            self._releasing += 1
        with _RELEASING.cv:
            _RELEASING.count += 1
        started = False
        try:
            threading.Thread(target=self._release, args=(release,), name="kvtier-release-cache", daemon=True).start()
            started = True
        finally:
            if not started:  # (no thread to be had: nothing is released; the counts are right)
                self._release(lambda: None)

    def _release(self, release: Any) -> None:
        try:
            release()
        finally:
            with self._released:
                self._releasing -= 1
                self._released.notify_all()
            with _RELEASING.cv:
                _RELEASING.count -= 1
                _RELEASING.cv.notify_all()

    def wait_releases(self) -> None:
        """Until every collected cache's pages are back (:meth:`release_later`)."""
        with self._released:
            while self._releasing:
                self._released.wait()

    def check_open(self) -> None:
        """Raises :class:`ClosedError` once the tier is closed."""
        if self.closed:
            raise ClosedError("KVTier is closed")

    def transfer(self, win: Any, layer_idx: int, host: torch.Tensor, dev: torch.Tensor, *, to_host: bool,
                 tail: bool = False) -> Any:
        """One layer between host pages and its window slot. On CUDA: on the transfer stream (``tail``: the tail
        stream, :meth:`tail_stream`), after the compute stream's work so far, submitted by a native thread (the
        Python thread never waits on the driver, so the model's next kernels are enqueued meanwhile) in order
        after that stream's previous transfer; returns what the slot's next user waits for (:meth:`wait`). On
        the CPU: done on return (None)."""
        if self.stream is None:
            copy = self.host.backup_from_device_per_layer if to_host else self.host.load_to_device_per_layer
            copy(win, host, dev, layer_idx, "direct")
            return None
        stream = self.tail_stream() if tail else self.stream
        after = torch.cuda.current_stream(self.device).record_event()
        events = [torch.cuda.Event() for _ in range(self.lanes)]
        for ev in events:
            ev.record(stream)  # (creates it; the transfer records it again after its copies)
        with torch.cuda.stream(stream):
            sub = self.host.copy_layer(win, host, dev, layer_idx, "direct", to_host=to_host, events=events, after=after,
                                        previous=self._tail_sub if tail else self._sub)
        self._track(sub, tail)
        return sub, events

    def transfer_layers(self, win: Any, host: torch.Tensor, dev: torch.Tensor, *, to_host: bool) -> list[Any]:
        """Every layer between host pages and its slot in one call (a window of every layer): what
        :meth:`transfer` does for each layer, on the transfer stream, validated and submitted once. Returns
        each layer's pending transfer (what its slot's next user waits for)."""
        if self.stream is None:
            copy = self.host.backup_from_device_all_layer if to_host else self._load_all_cpu
            copy(win, host, dev, "direct")
            return [None] * self.layers
        after = torch.cuda.current_stream(self.device).record_event()
        events = [[torch.cuda.Event() for _ in range(self.lanes)] for _ in range(self.layers)]
        for layer in events:
            for ev in layer:
                ev.record(self.stream)  # (creates it; the transfer records it again after its layer's copies)
        with torch.cuda.stream(self.stream):
            sub = self.host.copy_layers(win, host, dev, "direct", to_host=to_host, events=events, after=after,
                                        previous=self._sub)
        self._track(sub)
        return [(sub, layer, i) for i, layer in enumerate(events)]

    def _load_all_cpu(self, win: Any, host: torch.Tensor, dev: torch.Tensor, backend: str) -> None:
        for layer in range(self.layers):
            self.host.load_to_device_per_layer(win, host, dev, layer, backend)

    def _track(self, sub: Any, tail: bool = False) -> None:
        """A background submission on the transfer (or tail) stream: the next one there follows it; its error
        must be seen."""
        if sub is not None:
            if tail:
                self._tail_sub = sub
            else:
                self._sub = sub
            with self._subs_lock:
                self._subs.append(sub)

    def tail_stream(self) -> Any:
        """The CUDA stream a split restore's tail loads run on when every layer is resident (made once)."""
        if self._tail_stream is None:
            self._tail_stream = torch.cuda.Stream(self.device)
        return self._tail_stream

    def head_stream(self) -> Any:
        """The CUDA stream a split restore computes its head on (made once; None on the CPU)."""
        if self.stream is None:
            return None
        if self._head_stream is None:
            self._head_stream = torch.cuda.Stream(self.device)
        return self._head_stream

    def hold_transfers_until(self, future: Any, *, tail: bool = False) -> Any:
        """Transfers issued after this call on the transfer stream (``tail``: the tail stream) do not start on
        the device before ``future`` is done (a split restore's tail read: its pages' loads are enqueued before
        their bytes are there). Returns the gate (``open()`` it once the future is seen done; see
        :func:`kvtier.transfer.gate.gate_until`), or None. On the CPU nothing: the caller waits for the future
        before its first copy of those pages."""
        if self.stream is None:
            return None
        if tail:
            sub, gate = gate_until(self.device, self.tail_stream(), future, self._tail_sub)
        else:
            sub, gate = gate_until(self.device, self.stream, future, self._sub)
        self._track(sub, tail)
        return gate

    def hold_tail_at(self, gate: Any) -> None:
        """Transfers issued after this call on the tail stream do not start on the device before ``gate``
        (a ``kvtier._native.HostGate``) is opened (CUDA only)."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._track(_native.submit_gate_background(index, int(self.tail_stream().cuda_stream), gate, self._tail_sub),
                    True)

    @staticmethod
    def wait(stream: Any, pending: Any) -> None:
        """``stream`` waits for a transfer from :meth:`transfer` or one layer's of :meth:`transfer_layers` (once
        that layer's events are recorded: layer i of a submission of every layer waits for its own events, not
        the first layer's)."""
        if pending is None or stream is None:
            return
        if isinstance(pending, list):  # (a slot waited for by two streams' transfers: a split's head and tail)
            for one in pending:
                TierRuntime.wait(stream, one)
            return
        sub, events, index = pending if len(pending) == 3 else (*pending, 0)
        if sub is not None:
            sub.wait_recorded(index)
        for ev in events:
            stream.wait_event(ev)

    def _joined(self, take: bool = True) -> None:
        """Every background submission has enqueued its copies; the first that failed raises its error (``take``:
        once, to this caller; else they stay for the tier's own drain or fence to see)."""
        with self._subs_lock:
            subs = self._subs
            if take:
                self._subs = []
            else:
                subs = list(subs)
        for sub in subs:
            sub.join()

    def drain(self, take: bool = True) -> None:
        """Wait until every transfer this tier issued has completed (a failed one raises its error, once
        both streams are idle: what is freed after it is never touched again). ``take=False`` (a release on a
        thread of its own): the submissions' errors stay for the tier's next drain or fence."""
        try:
            self._joined(take)
        finally:
            if self.stream is not None:
                self.stream.synchronize()
            if self._tail_stream is not None:
                self._tail_stream.synchronize()

    def after_tail(self) -> None:
        """The compute stream and the transfer stream wait (on the device) for what the tail stream holds: a
        tail settled or cut back, its slots and pages may be written or given back by work queued on them."""
        if self._tail_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._tail_stream)
            self.stream.wait_stream(self._tail_stream)

    def fence(self) -> Any:
        """A CUDA event after every transfer this tier has issued so far (None on the CPU); raises the error of
        any that failed, so nothing is adopted after a backup that did not happen."""
        if self.stream is None:
            return None
        self._joined()  # their copies are enqueued: an event recorded now follows them
        if self._tail_stream is not None:  # (and those on the tail stream)
            self.stream.wait_stream(self._tail_stream)
        return self.stream.record_event()
