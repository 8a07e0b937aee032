"""Copy engines between a host pool's K and V buffers and a device pool's per-layer tensors.

The host pools validate every argument (the index checks run in Rust) before calling
:meth:`TransferEngine.copy` with the K side and the V side (separate copies, each with its own geometry).
Which engine runs depends on where the device tensors live:

- CPU tensors: the Rust core plans byte chunks (contiguous on both sides) once per index pair and copies
  them with the GIL released, re-checking every chunk against both buffers' extents.
- CUDA tensors and a pinned host buffer, ordered on the caller's current stream:
  - ``direct``: the Rust core plans chunks contiguous on both sides (one per page and layer for
    page_first_direct) and submits them to the copy engine with ``cuMemcpyBatchAsync`` in batches of 1,024
    (no SM is used), or one ``cuMemcpyAsync`` each where the batch API is missing. The batch API refuses
    the legacy default stream: copies issued from a default stream run on an engine-owned stream forked
    from the caller's and joined back into it (:meth:`TransferEngine.detour_stream`), so they keep their
    place in its order. LayerLoader's loads are submitted by a native thread (see ``_native.Submission``).
  - ``kernel``: a Triton gather/scatter (:mod:`kvtier.kernels`) that reads/writes pinned host memory from
    the GPU with a bounded number of thread blocks, launched natively once compiled; K and V run
    concurrently on the caller's stream and a side stream joined back into it (``KVTIER_TRANSFER_LANES``).
    Large backups of ``page_first`` pools are staged: gathered into device buffers, moved by the copy engine.
  Host buffers, plans, events and index tensors are kept alive until the work that uses them has completed
  (an event recorded after it, and for a background submission, the end of the submission).
- CUDA tensors with an unpinned host buffer (pinning failed): a torch gather/scatter, correct but slow.
"""

from __future__ import annotations

import collections
import operator
import threading
from typing import Any
from collections.abc import Sequence

import torch

from . import _native, _staging, config, kernels
from ._errors import InvalidArgumentError
from ._side import Side


# Words per tile of the kernel backend: with 8 warps, 2,048 (16 KiB) moved as much as 4,096 with 16 warps
# at 256 pages (88-90 % load, 94 % SM-written backup), and overlapped better beside matmuls (1.10x against
# 1.17x, compute at ~60 % of the transfer): half the threads per block leave more of each SM to compute
# (benches/results/2026-11-29-h200-probe-{1,3}.json).
KERNEL_TILE_WORDS = 2048


#: Stream handles torch reports for a default stream: the legacy NULL stream, ``cudaStreamLegacy`` and
#: ``cudaStreamPerThread``.
DEFAULT_STREAMS = (0, 1, 2)

#: The raw handle of a device's current stream without making a ``torch.cuda.Stream`` (torch's generated code
#: reads it so): ``torch.cuda.current_stream`` cost 3.2 µs of a warm per-layer call's ~30 on the H200
#: (benches/results/h200-probe-host-cost.json). None where this torch lacks it (then the public API is used).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

#: The host mapping of a side (what a copy's holds keep alive).
_REGION = operator.attrgetter("buffer._region")


class TransferEngine:
    """Executes validated K-or-V copies; see the module docs. Copies may be issued from several threads (on
    distinct streams); closing the pool must not race with copies still being issued."""

    def __init__(self) -> None:
        self._inflight: collections.deque[tuple[Any, Any, tuple]] = collections.deque()
        self._inflight_lock = threading.Lock()
        self._ptr_tables: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()  # (list, offsets)
        self.blocks = config.kernel_blocks()
        self.num_warps = config.kernel_warps()
        self.batch = config.direct_batch()
        self.tile_words = KERNEL_TILE_WORDS  # words per kernel tile (see kvtier.kernels); benches sweep it
        self.prefetch = True
        self.lanes = config.transfer_lanes()
        self._side_streams: dict[Any, list] = {}  # (device, caller stream) -> side streams, LRU order
        self._detours: dict[Any, Any] = {}  # (device, thread) -> (stream default-stream copies run on, fork, join)
        # (device, stream) -> [event after the last warm load, its refs, the event's handle]
        self._marks: dict[Any, list] = {}
        self._batch_api: bool | None = None  # the driver has cuMemcpyBatchAsync (see _fork)
        self.last_submit: tuple[int, int] | None = None  # (copies, batch calls) of the last direct submission
        self.staged_backup = config.kernel_backup() == "staged"
        self.staging_bytes = config.staging_bytes()
        # staged only from this many bytes per backup: below, fixed per-run costs outweigh the copy engine's
        # larger PCIe writes (16 pages of A: staged 80-84 %, SM writes 84-87 %; 256 pages: 97 % against 92-94 %)
        self.staged_min_bytes = 4 * self.staging_bytes
        self.kernel_below = config.direct_kernel_below()  # see route()
        self.direct_staged = config.direct_backup() == "staged"
        self._staging: dict[Any, _staging.Staging] = {}
        self._stage_lock = threading.Lock()

    # -- lifetime of in-flight copies ----------------------------------------------------------------
    def _hold(self, refs: tuple, event: Any = None, submission: Any = None) -> None:
        """Keep ``refs`` alive until the current stream (of the current device: callers run under
        ``torch.cuda.device``) passes this point — or, for a background submission, until it has finished
        and ``event`` (its last events) has completed."""
        if event is None:
            event = torch.cuda.Event()
            event.record()
        with self._inflight_lock:
            self._inflight.append((event, submission, refs))
            while self._inflight and self._released(self._inflight[0]):
                self._inflight.popleft()

    @staticmethod
    def _released(entry) -> bool:
        event, submission, _ = entry
        if submission is not None and not submission.finished():
            return False
        return all(ev.query() for ev in event) if isinstance(event, (list, tuple)) else event.query()

    def synchronize(self) -> None:
        """Wait for every copy this engine issued (used before a pool releases its memory)."""
        for mark in list(self._marks.values()):
            mark[0].synchronize()
        while True:
            with self._inflight_lock:
                if not self._inflight:
                    return
                event, submission, _ = self._inflight.popleft()
            if submission is not None:
                try:
                    submission.join()
                except Exception:  # noqa: BLE001 - the error reaches the load's own waiter; a failed
                    pass  # submission has waited for everything it enqueued before it reports finished
            for ev in event if isinstance(event, (list, tuple)) else (event,):
                ev.synchronize()

    def close(self) -> None:
        """Waits for every copy, then drops the staging buffers and side streams (a closing pool calls it)."""
        self.synchronize()
        self._marks.clear()
        self._staging.clear()
        self._side_streams.clear()

    def lanes_for(self, backend: str, sides: Sequence[Side] = ()) -> int:
        """Streams a ``backend`` transfer of ``sides`` spreads K and V over: ``self.lanes`` for ``kernel`` (and
        for ``direct`` transfers that :meth:`route` runs as kernels); 1 for the copy engine, which measured
        slower with K and V on two streams (geometry C loads: 41 % of the ceiling on one stream, 7 % on two;
        16 pages of A: 62.5 % against 75.2 %; benches/RESULTS.md)."""
        if backend == "kernel" or (sides and self.route(backend, sides, "cuda") == "kernel"):
            return self.lanes
        return 1

    def route(self, backend: str, sides: Sequence[Side], device_type: str, *, to_host: bool = False,
              tokens: int = 0, per_layer: bool = False) -> str:
        """How a ``backend`` transfer of ``tokens`` between ``sides`` and a ``device_type`` pool moves:
        ``"cpu"`` (Rust memcpy), ``"torch"`` (unpinned host memory), ``"kernel"`` (Triton gather/scatter),
        ``"staged"`` (a kernel gathers whole pages into device staging, the copy engine writes them to the
        host) or ``"dma"`` (the copy engine, one copy per contiguous chunk). ``direct`` is the copy engine
        except where measurements say otherwise: chunks under ``self.kernel_below`` bytes (a copy costs the
        copy engine about a microsecond, so 16-24 KiB chunks reach 9-40 % of the ceiling and the kernel
        85-88 %), and whole-pool backups of page-first layouts from ``self.staged_min_bytes`` up when
        ``self.direct_staged`` (copy-engine writes of whole pages: 96-98 % against 87-92 % per chunk). The
        pools validate indices for every route but ``dma`` before planning (``kvtier.pools._prepare``)."""
        if device_type == "cpu":
            return "cpu"
        chunk, token_bytes, page_first = 1 << 62, 0, True
        for side in sides:
            if not side.pinned:
                return "torch"
            chunk = min(chunk, side.page_size * side.row_bytes)
            token_bytes += side.layers * side.row_bytes
            page_first = page_first and side.layout != "layer_first"
        if backend == "kernel":
            return "kernel" if kernels.available() else "dma"
        if not kernels.available():
            return "dma"
        if chunk < self.kernel_below:
            return "kernel"
        if (to_host and not per_layer and self.direct_staged and page_first
                and tokens * token_bytes >= self.staged_min_bytes):
            return "staged"
        return "dma"

    def side_streams(self, device: torch.device, lanes: int | None = None) -> list:
        """The side streams (``lanes`` - 1 of them, default ``self.lanes`` - 1) this engine spreads K and V over
        for the current stream of ``device``: one set per caller stream (the last 8 kept), so a LayerLoader's
        V copies never queue behind a backup's on a shared side stream."""
        want = (self.lanes if lanes is None else lanes) - 1
        if want <= 0:
            return []
        key = (device, torch.cuda.current_stream(device).cuda_stream)
        have = self._side_streams.pop(key, [])
        while len(have) < want:
            have.append(torch.cuda.Stream(device))
        self._side_streams[key] = have  # most recently used last
        while len(self._side_streams) > 8:
            self._side_streams.pop(next(iter(self._side_streams)))
        return have[:want]

    def detour_stream(self, device: torch.device) -> Any:
        """The engine's own stream that direct copies issued from a default stream run on (one per device and
        calling thread: a per-thread default stream is another stream in every thread). The driver's batch
        copy API refuses the legacy default stream, so copies submitted there would go one call per chunk
        (a third of the speed for per-layer loads and backups); on this stream, forked from the caller's
        and joined back into it, they keep their place in the caller's stream order."""
        key = (device, threading.get_ident())
        d = self._detours.get(key)
        if d is None:
            # non-blocking: joined by events only. The fork and join events are re-recorded for every call: a
            # stream wait applies to the record made before it, so reusing them saves creating two per call.
            d = self._detours[key] = (torch.cuda.Stream(device), torch.cuda.Event(), torch.cuda.Event())
        return d[0]

    def _fork(self, device: torch.device, caller: Any) -> Any:
        """None when copy-engine batches may be submitted on ``caller`` itself. Otherwise (``caller`` is a
        default stream, which the batch API refuses) the detour ``(stream, fork, join)``, its stream made to
        wait for everything ``caller`` was given so far; :meth:`_join` then makes ``caller`` wait for what the
        detour was given."""
        if not (self.batch and caller.cuda_stream in DEFAULT_STREAMS):
            return None
        # whether the driver has the batch API: asked once (should the core later turn batching off after a
        # refused batch, copies from a default stream still take the detour: same order, a fork/join more)
        if self._batch_api is None:
            self._batch_api = _native.cuda_batch_supported()
        if not self._batch_api:
            return None
        self.detour_stream(device)
        d = self._detours[(device, threading.get_ident())]
        d[1].record(caller)
        d[0].wait_event(d[1])
        return d

    @staticmethod
    def _join(caller: Any, d: Any) -> None:
        d[2].record(d[0])
        caller.wait_event(d[2])

    def _offsets(self, tensors: Sequence[torch.Tensor], word: int) -> tuple[torch.Tensor, int]:
        """The device-layer offset table (see :func:`kernels.layer_offsets`) of a device-layer list. The pools
        hand out the same list object while the device pool is unchanged (``_check_device_pool`` re-reads the
        tensors' addresses and makes a new list when one changes), so the list's identity is the key; the
        entry keeps the list, so its id cannot be reused while cached."""
        key = (id(tensors), word)
        entry = self._ptr_tables.get(key)
        if entry is None or entry[0] is not tensors:
            entry = (tensors, kernels.layer_offsets(tensors, word))
            self._ptr_tables[key] = entry
            if len(self._ptr_tables) > 16:
                self._ptr_tables.popitem(last=False)
        return entry[1]

    def copy(
        self,
        pairs: Sequence[tuple[Side, Sequence[torch.Tensor]]],
        prepared: Any,
        layer_begin: int,
        layer_end: int,
        *,
        to_host: bool,
        backend: str = "direct",
        per_layer: bool = False,
        events: Sequence[Any] | None = None,
        hold: bool = True,
        background: bool = False,
        after: Any = None,
        previous: Any = None,
        route: str | None = None,
    ) -> Any:
        """Copy layers ``[layer_begin, layer_end)`` of each ``(side, device_layers)`` pair (K, then V: separate
        copies with their own geometry) for validated indices ``prepared`` (``kvtier.pools._Prepared``: host and
        device numpy indices, page rules, cached GPU indices and plans).

        ``per_layer``: enqueue layer by layer (every pair's layer l, then the events ``events[l - layer_begin]``,
        one per lane, when ``events`` is given); otherwise each pair's layers in one go. On CUDA, pair i runs on
        lane i mod ``self.lanes``: the current stream and side streams that fork from it and join back into
        it, so K and V move concurrently; each lane records its own event of a layer.

        ``background`` (with ``per_layer`` and ``events``): the ``direct`` path's copies are submitted by a
        native thread and the returned ``kvtier._native.Submission`` says when each event has been recorded
        (other paths return None: their events are recorded before this returns). ``previous``: the last
        background submission on the same stream, which this one follows in stream order.

        ``after``: a CUDA event the copies must follow (on the current stream; for a background submission,
        the submission thread makes the stream wait for it, after ``previous``).

        ``route``: :meth:`route`'s answer for this transfer, when the caller has it (the pools do)."""
        dev = pairs[0][1][0].device if pairs else None
        cuda = dev is not None and dev.type == "cuda"
        if dev is not None and cuda and dev.index is not None and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev):  # streams, events and launches of the pool's device
                return self.copy(pairs, prepared, layer_begin, layer_end, to_host=to_host, backend=backend,
                                 per_layer=per_layer, events=events, hold=hold, background=background, after=after,
                                 previous=previous, route=route)
        if per_layer and layer_end <= layer_begin and not events:
            return None  # no layer: nothing to enqueue or record
        host, device = prepared.host, prepared.device
        if cuda and len(host) > 0:
            # the pools validated the indices for the route taken (see route() and pools._prepare)
            if route is None:
                host_sides = next(zip(*pairs))
                full = layer_begin == 0 and layer_end == host_sides[0].layers
                route = self.route(backend, host_sides, "cuda", to_host=to_host, tokens=len(host),
                                   per_layer=per_layer or not full)
            if route == "kernel":
                backend = "kernel"
        background_direct = (background and per_layer and events is not None and route == "dma"
                             and backend == "direct")
        if previous is not None and not background_direct:
            previous.join()  # enqueued here, in stream order: after what the earlier background submission enqueues
        if after is not None and not background_direct and cuda:
            torch.cuda.current_stream(dev).wait_event(after)
        if len(host) == 0 or not pairs:
            if events is not None:
                for evs in events:
                    for ev in evs:
                        ev.record()
            return None
        assert dev is not None  # pairs is not empty
        if dev.type != "cpu" and (not cuda or route == "torch"):
            for i, layer in enumerate(range(layer_begin, layer_end) if per_layer else (layer_begin,)):
                last = layer + 1 if per_layer else layer_end
                for side, tensors in pairs:
                    self._copy_torch(side, tensors, host, device, layer, last, to_host)
                if events is not None:
                    for ev in events[i]:
                        ev.record()
            return None
        regions = tuple(map(_REGION, next(zip(*pairs))))  # each side's host mapping
        if route == "staged":
            _staging.staged_backup(self, pairs, prepared, prepared.gpu(dev)[1], regions)
            return None
        if backend == "kernel" and cuda and kernels.available():
            return self._kernel(pairs, prepared, layer_begin, layer_end, to_host, per_layer, events, hold, regions)
        if not cuda:
            self._dma(pairs, prepared, to_host, (layer_begin, layer_end, -1, 0, [], False, False, []))
            return None
        stream = torch.cuda.current_stream(dev)
        handles = [int(ev.cuda_event) for evs in events for ev in evs] if events is not None else []
        if events is not None and not all(handles):
            raise InvalidArgumentError("invalid argument `events`: record each event once before passing it")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        # lanes: the copy engine runs every side on the caller's stream (see lanes_for) unless events say more
        sides = [st.cuda_stream for st in self.side_streams(dev, len(events[0]))] if events is not None else []
        if background_direct:
            assert events is not None
            plans = self._dma(pairs, prepared, to_host)
            sub = _native.submit_layers_background(
                plans, layer_begin, layer_end, index, stream.cuda_stream, sides, self.batch, handles,
                int(after.cuda_event) if after is not None else 0, previous,
            )
            # the submission thread records every event of the load and waits on `after`: keep them all (not
            # only the last layer's, which say when it is done) alive until it has finished
            self._hold((regions, plans, events, after), list(events[-1]), sub)
            return sub
        detour = self._fork(dev, stream)  # from a default stream: the copies wait for what it was given before ...
        target = detour[0] if detour is not None else stream
        plans = self._dma(pairs, prepared, to_host,
                          (layer_begin, layer_end, index, target.cuda_stream, sides, self.batch, per_layer, handles))
        if detour is not None:
            self._join(stream, detour)  # ... and join: what the caller gives it next waits for the copies
        if hold:
            self._hold((regions, plans))  # recorded on the caller's stream, after the join
        return None

    def warm_kernel(self, pairs: Sequence[tuple[Side, Sequence[torch.Tensor]]], prepared: Any) -> Any:
        """The kernel route's launches of a repeated per-layer load (``kvtier.pools._WarmLoad``), as ``copy``
        makes them for one layer (same lanes, same blocks per launch), ready for :meth:`load_layer`; None
        where they do not launch natively."""
        dev = pairs[0][1][0].device
        if dev.type != "cuda" or not kernels.available():
            return None
        hidx, didx = prepared.gpu(dev)
        lanes = min(self.lanes, len(pairs))
        blocks = self._split_blocks([side.row_bytes for side, _ in pairs], lanes)
        launches = [self._rows(side, ts, prepared, hidx, didx, False, b) for (side, ts), b in zip(pairs, blocks)]
        return kernels.WarmLaunches.of(launches, lanes)

    def _load_layer_kernel(self, prepared: Any, layer: int, dev: torch.device, warm: Any, refs: tuple) -> None:
        """:meth:`load_layer` on the kernel route: the launches ``warm`` (:meth:`warm_kernel`) for ``layer``
        in one native call, which on the stream of the previous load of this index set also re-records the
        stream's mark after them (see :meth:`_mark`). Kernels need no detour from a default stream."""
        index = dev.index
        handle = _raw_stream(index) if _raw_stream is not None else torch.cuda.current_stream(dev).cuda_stream
        sides = warm.sides.get(handle)
        mark = self._marks.get((index, handle))
        if sides is not None and mark is not None and mark[1] is refs:
            _native.launch_layers(index, handle, sides[0], warm.natives, layer, layer + 1, [], mark[2])
            return
        stream = torch.cuda.current_stream(dev)
        prepared.gpu(dev)  # a new stream waits for the indices' upload
        if sides is None:
            if len(warm.sides) >= 8:
                warm.sides.clear()
            streams = self.side_streams(dev, warm.lanes)
            sides = warm.sides[handle] = ([st.cuda_stream for st in streams], streams)
        _native.launch_layers(index, handle, sides[0], warm.natives, layer, layer + 1, [])
        self._mark(index, handle, stream, refs)

    def load_layer(self, pairs: Sequence[tuple[Side, Sequence[torch.Tensor]]], prepared: Any, layer: int,
                   backend: str, route: str, plans: Any, refs: tuple) -> None:
        """Host → device for one ``layer``: what ``copy(pairs, prepared, layer, layer + 1, to_host=False,
        backend=backend)`` does, for a repeated per-layer load whose ``route`` and ``plans`` the pool has
        already derived (``kvtier.pools._WarmLoad``): the copy engine's plans, or the kernel route's launches
        (:meth:`warm_kernel`). Only those two routes on the current device are shortened; the host time of a
        16-page per-layer call bounds them (benches/RESULTS.md §4). ``refs``: the host regions and
        ``plans``, one tuple for every call with these plans (see :meth:`_mark`)."""
        dev = pairs[0][1][0].device
        index = dev.index
        if route == "kernel" and plans is not None and index == torch.cuda.current_device():
            self._load_layer_kernel(prepared, layer, dev, plans, refs)
            return
        if route != "dma" or plans is None or index != torch.cuda.current_device():
            self.copy(pairs, prepared, layer, layer + 1, to_host=False, backend=backend, route=route)
            return
        if _raw_stream is not None:
            handle = _raw_stream(index)
            mark = self._marks.get((index, handle))
            if mark is not None and mark[1] is refs and handle not in DEFAULT_STREAMS:
                # the previous load of this index set ran on this stream: one native call submits the copies
                # and re-records the stream's mark event after them (what _mark does from Python)
                self.last_submit = _native.submit_layers(plans, layer, layer + 1, index, handle, [], self.batch,
                                                         True, [mark[2]])
                return
        stream = torch.cuda.current_stream(dev)
        handle = stream.cuda_stream
        # fork and join as in copy (only a default stream can need it: skip the call otherwise)
        detour = self._fork(dev, stream) if handle in DEFAULT_STREAMS else None
        self.last_submit = _native.submit_layers(
            plans, layer, layer + 1, dev.index, detour[0].cuda_stream if detour else handle, [], self.batch, False, [],
        )
        if detour is not None:
            self._join(stream, detour)
        self._mark(dev.index, handle, stream, refs)

    def _mark(self, index: int, handle: int, stream: Any, refs: tuple) -> None:
        """``_hold`` for repeated per-layer loads: one event per (device, caller stream), re-recorded after
        every load on it, marks the last of them (a stream runs in order, so it passes every earlier one
        first); :meth:`synchronize` waits for it. Creating an event per call cost 7.6 µs of a 16-page call's
        ~50 µs (benches/results/h200-probe-host-cost.json). ``refs`` (the pool's host regions and the plans,
        the same objects for every call of a warm load) stay referenced until the mark is dropped. ``index``,
        ``handle``: the device's index and the stream's handle."""
        key = (index, handle)
        entry = self._marks.get(key)
        if entry is not None and entry[1] is not refs:
            self._hold(entry[1])  # another index set: its copies, enqueued before this point, keep their refs
        if entry is None:
            entry = self._marks[key] = [torch.cuda.Event(), refs, 0]
            with self._inflight_lock:
                while len(self._marks) > 8:  # an old mark is waited for like any other hold
                    old = self._marks.pop(next(iter(self._marks)))
                    self._inflight.append((old[0], None, old[1]))
        entry[1] = refs
        entry[0].record(stream)
        entry[2] = entry[0].cuda_event  # recorded once: load_layer may now have the core re-record it

    def _rows(self, side: Side, tensors, prepared: Any, hidx, didx, to_host: bool, blocks: int):
        """The kernel launch description of one side for ``prepared``'s indices (layer range excluded), made
        once and cached there like the DMA plans: a per-layer load or a repeated backup with the same indices
        reuses it instead of re-deriving views, constants and alignment on every call (host time before the
        first launch is what small transfers wait for). Keyed by everything it depends on; the entry keeps the
        device-layer list, so the identity check cannot be fooled by a recycled id."""
        key = ("rows", side.offset, id(side.buffer), to_host, id(tensors), blocks, self.num_warps, self.tile_words,
               self.prefetch, hidx.data_ptr(), didx.data_ptr())
        entry = prepared.plans.get(key)
        if entry is not None and entry[0] is tensors:
            return entry[1]
        launch = kernels.prepare_rows(
            host=side.tensor, layout=side.layout, slots=side.slots, layers=side.layers,
            page_size=side.page_size, row_bytes=side.row_bytes, device_layers=tensors,
            dev_offsets=self._offsets(tensors, kernels.word_of(side.row_bytes)),
            host_idx=hidx, dev_idx=didx, to_host=to_host, blocks=blocks, num_warps=self.num_warps,
            tile_words=self.tile_words, prefetch=self.prefetch,
        )
        prepared.plans[key] = (tensors, launch)
        if len(prepared.plans) > 8:  # as in _dma: the latest 8
            prepared.plans.pop(next(iter(prepared.plans)))
        return launch

    def _split_blocks(self, row_bytes: list[int], lanes: int) -> list[int]:
        """Thread blocks per launch: all of ``self.blocks`` each when launches run one after another; split in
        proportion to the bytes each moves when they run concurrently on separate lanes, so the total stays
        within ``KVTIER_KERNEL_BLOCKS`` (but at least one block each)."""
        if lanes <= 1 or len(row_bytes) <= 1:
            return [self.blocks] * len(row_bytes)
        total = sum(row_bytes)
        out = [max(1, round(self.blocks * r / total)) for r in row_bytes]
        out[-1] = max(1, self.blocks - sum(out[:-1]))
        return out

    def _kernel(self, pairs, prepared, layer_begin, layer_end, to_host, per_layer, events, hold, regions) -> None:
        """The ``kernel`` route of :meth:`copy`: Triton gathers/scatters on the caller's stream and side
        streams, or staged when ``KVTIER_KERNEL_BACKUP=staged`` and this is a large whole-pool backup."""
        dev = pairs[0][1][0].device
        hidx, didx = prepared.gpu(dev)
        total = len(prepared.host) * sum([side.layers * side.row_bytes for side, _ in pairs])
        if (to_host and not per_layer and self.staged_backup and layer_begin == 0
                and total >= self.staged_min_bytes
                and all([side.layout in ("page_first", "page_first_direct") and layer_end == side.layers
                         for side, _ in pairs])):
            _staging.staged_backup(self, pairs, prepared, didx, regions)
            return
        lanes = len(events[0]) if events is not None else min(self.lanes, len(pairs))
        sides = self.side_streams(dev, lanes)
        blocks = self._split_blocks([side.row_bytes for side, _ in pairs], lanes)
        launches = [self._rows(side, tensors, prepared, hidx, didx, to_host, b) for (side, tensors), b in zip(pairs, blocks)]
        kernels.run_rows(launches, layer_begin, layer_end, per_layer=per_layer, events=events, side_streams=sides)
        if hold:
            self._hold((regions, hidx, didx, [x.dev_offsets for x in launches]))

    def _dma(self, pairs, prepared: Any, to_host: bool, run: tuple | None = None) -> list[Any]:
        """The copy-engine (or CPU) plans of every side for ``prepared``'s indices, cached there. With ``run``
        (``_native.plan_sides``' ``run``: layer range, device index or -1 for CPU memcpy, stream, side streams,
        batch, per layer, events) those layers are also copied: by the same native call that validates the
        indices and plans them when the plans are new, so an operation crosses into Rust once, warm or cold.
        Keyed by the ids of the sides and device-layer lists; the entry holds them, so an id in the key cannot
        be reused by another object while the entry lives."""
        sides, lists = zip(*pairs)
        key = ("plans", to_host, *map(id, sides), *map(id, lists))
        entry = prepared.plans.get(key)
        if entry is not None:
            plans: list[Any] = entry[2]
            if run is not None and run[2] < 0:
                _native.copy_cpu(plans, run[0], run[1])
            elif run is not None:
                self.last_submit = _native.submit_layers(plans, *run)
            return plans
        args = []
        for side, ts in pairs:
            args.append((side.buffer._region, side.offset, side.row_bytes, list(ts), side.split))
        first = sides[0]
        plans, counts = _native.plan_sides(to_host, first.layout, first.slots, first.page_size, prepared.host,
                                           prepared.device, 0, len(lists[0]), prepared.paged, prepared.paged, args,
                                           run)
        if run is not None and run[2] >= 0:
            self.last_submit = counts
        prepared.plans[key] = (sides, lists, plans)
        if len(prepared.plans) > 8:  # one index set used with ever new device tensors: keep the latest 8
            prepared.plans.pop(next(iter(prepared.plans)))
        return plans

    @staticmethod
    def _copy_torch(side, device_layers, host, device, layer_begin, layer_end, to_host) -> None:
        dev = device_layers[0].device
        h = torch.from_numpy(host)
        d = torch.from_numpy(device).to(dev, non_blocking=True)
        flat = side.tensor.reshape(-1).view(torch.uint8).view(-1, side.row_bytes)  # one row per (layer, slot)
        for layer in range(layer_begin, layer_end):
            # Move raw bytes (uint8 views of the last dim): exact for every dtype, float8 included.
            rows = side.rows_of(layer, h)
            target = device_layers[layer].view(torch.uint8)
            if to_host:
                flat[rows] = target.index_select(0, d).to("cpu").reshape(len(rows), side.row_bytes)
            else:
                target.index_copy_(0, d, flat[rows].reshape(len(rows), *target.shape[1:]).to(dev, non_blocking=True))
