"""The transfer engine: which route a validated K-or-V copy takes, and the copies themselves (see
:mod:`kvtier.transfer`)."""

from __future__ import annotations

import collections
import operator
import threading
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

import torch

from .. import _native, config
from .._errors import InvalidArgumentError
from . import kernels, staging
from .inflight import InFlight
from .layout import Side, copy_torch
from .route import CPU, DMA, KERNEL, STAGED, TORCH, TUNING, Route
from .streams import DEFAULT_STREAMS, Streams, raw_stream


# Words per tile of the kernel backend: with 8 warps, 2,048 (16 KiB) moved as much as 4,096 with 16 warps
# at 256 pages (88-90 % load, 94 % SM-written backup), and overlapped better beside matmuls (1.10x against
# 1.17x, compute at ~60 % of the transfer): half the threads per block leave more of each SM to compute
# (measured on the H200; `python -m kvtier_bench.transfer_probe --only kernel` sweeps tile size and warps).
KERNEL_TILE_WORDS = 2048

#: The host mapping of a side (what a copy's holds keep alive).
_REGION = operator.attrgetter("region")


class _Tuning:
    """A :class:`TransferEngine` setting that routes or kernel launches are made from: setting it counts in
    :data:`~kvtier.transfer.route.TUNING`, so warm per-layer loads made before are made again with it. Only
    the setting goes through this descriptor: it has no ``__get__``, so a read finds the value in the
    engine's ``__dict__`` as for a plain attribute (no Python call on the per-call paths). The engine's
    ``__init__`` writes the values there directly: a new pool invalidates no other pool's warm loads."""

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value
        TUNING[0] += 1


class TransferEngine:
    """Executes validated K-or-V copies; see the module docs. Copies may be issued from several threads (on
    distinct streams); closing the pool must not race with copies still being issued."""

    # Tuning the warm per-layer loads are made from (see _Tuning): setting one makes them again.
    if TYPE_CHECKING:  # to a reader, plain attributes
        blocks: int
        num_warps: int
        tile_words: int
        prefetch: bool
        lanes: int
        kernel_below: int
    else:
        blocks = _Tuning()
        num_warps = _Tuning()
        tile_words = _Tuning()
        prefetch = _Tuning()
        lanes = _Tuning()
        kernel_below = _Tuning()

    def __init__(self) -> None:
        # Tuning, read on every call: config's defaults; benches and tests set them to compare settings.
        vars(self).update(
            blocks=config.kernel_blocks(),  # thread blocks per kernel transfer (split over concurrent lanes)
            num_warps=config.kernel_warps(),  # warps per kernel thread block
            tile_words=KERNEL_TILE_WORDS,  # words per kernel tile (see kvtier.transfer.kernels)
            prefetch=True,  # kernels issue the next tile's load before storing the current one
            lanes=config.transfer_lanes(),  # streams a kernel transfer spreads K and V over
            kernel_below=config.direct_kernel_below(),  # see route()
        )
        self.batch = config.direct_batch()  # copy-engine copies go in cuMemcpyBatchAsync batches (read per call)
        self.staged_backup = config.kernel_backup() == "staged"  # large kernel backups staged (see route)
        self.staging_bytes = config.staging_bytes()  # bytes of each of the two staging buffers (at least)
        # staged only from this many bytes per backup: below, fixed per-run costs outweigh the copy engine's
        # larger PCIe writes (16 pages of A: staged 80-84 %, SM writes 84-87 %; 256 pages: 97 % against 92-94 %)
        self.staged_min_bytes = 4 * self.staging_bytes
        self.direct_staged = config.direct_backup() == "staged"
        self.last_submit: tuple[int, int] | None = None  # (copies, batch calls) of the last direct submission
        # State: what in-flight copies hold, the streams beside the caller's, staging buffers, offset tables.
        self.inflight = InFlight()
        self.streams = Streams()
        self.stager = staging.Stager()
        self._marks = self.inflight.marks  # read by every warm per-layer load
        # (device, default stream, thread) -> the detour its last warm per-layer load forked to (its events
        # recorded): the next load of the same index set there is one native call (load_layer)
        self._detoured: dict[tuple[int, int, int], Any] = {}
        self._ptr_tables: collections.OrderedDict[tuple[Any, ...], tuple[Any, Any]] = collections.OrderedDict()

    def synchronize(self) -> None:
        """Wait for every copy this engine issued (used before a pool releases its memory)."""
        self.inflight.synchronize()

    def close(self) -> None:
        """Waits for every copy, then drops the staging buffers and side streams (a closing pool calls it)."""
        self.synchronize()
        self._marks.clear()
        self._detoured.clear()
        self.stager.clear()
        self.streams.clear()

    def lanes_for(self, backend: str, sides: Sequence[Side] = ()) -> int:
        """Streams a ``backend`` transfer of ``sides`` spreads K and V over: ``self.lanes`` for ``kernel`` (and
        for ``direct`` transfers that :meth:`route` runs as kernels); 1 for the copy engine, which measured
        slower with K and V on two streams (geometry C loads: 41 % of the ceiling on one stream, 7 % on two;
        16 pages of A: 62.5 % against 75.2 %; benches/RESULTS.md)."""
        if backend == "kernel" or (sides and self.route(backend, sides, "cuda") == KERNEL):
            return self.lanes
        return 1

    def route(self, backend: str, sides: Sequence[Side], device_type: str, *, to_host: bool = False,
              tokens: int = 0, per_layer: bool = False) -> Route:
        """How a ``backend`` transfer of ``tokens`` between ``sides`` and a ``device_type`` pool moves (a
        :class:`Route`): ``cpu`` (Rust memcpy), ``torch`` (unpinned host memory), ``kernel`` (Triton
        gather/scatter), ``staged`` (a kernel gathers whole pages into device staging, the copy engine writes
        them to the host) or ``dma`` (the copy engine, one copy per contiguous chunk). ``direct`` is the copy engine
        except where measurements say otherwise: chunks under ``self.kernel_below`` bytes (a copy costs the
        copy engine about a microsecond, so 16-24 KiB chunks reach 9-40 % of the ceiling and the kernel
        85-88 %), and whole-pool backups of page-first layouts from ``self.staged_min_bytes`` up when
        ``self.direct_staged`` (copy-engine writes of whole pages: 96-98 % against 87-92 % per chunk). The
        pools validate indices for every route but ``dma`` before planning (``HostKVPool.prepare``)."""
        if device_type == "cpu":
            return CPU
        chunk, token_bytes, page_first = 1 << 62, 0, True
        for side in sides:
            if not side.pinned:
                return TORCH
            chunk = min(chunk, side.page_size * side.row_bytes)
            token_bytes += side.layers * side.row_bytes
            page_first = page_first and side.layout != "layer_first"
        if backend == "kernel":
            return KERNEL if kernels.available() else DMA
        if not kernels.available():
            return DMA
        if chunk < self.kernel_below:
            return KERNEL
        if (to_host and not per_layer and self.direct_staged and page_first
                and tokens * token_bytes >= self.staged_min_bytes):
            return STAGED
        return DMA

    def side_streams(self, device: torch.device, lanes: int | None = None) -> list[Any]:
        """The side streams (``lanes`` - 1 of them, default ``self.lanes`` - 1) this engine spreads K and V over
        for the current stream of ``device`` (see :meth:`Streams.side_streams`)."""
        return self.streams.side_streams(device, (self.lanes if lanes is None else lanes) - 1)

    def detour_stream(self, device: torch.device) -> Any:
        """The engine's own stream that direct copies issued from a default stream run on (one per device and
        calling thread: a per-thread default stream is another stream in every thread). The driver's batch
        copy API refuses the legacy default stream, so copies submitted there would go one call per chunk
        (a third of the speed for per-layer loads and backups); on this stream, forked from the caller's
        and joined back into it, they keep their place in the caller's stream order."""
        return self.streams.detour(device)[0]

    def layer_offsets(self, tensors: Sequence[torch.Tensor], word: int) -> tuple[torch.Tensor, int]:
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
        offsets: tuple[torch.Tensor, int] = entry[1]
        return offsets

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
        copies with their own geometry) for validated indices ``prepared`` (:class:`~kvtier.transfer.indices.Prepared`:
        host and device numpy indices, page rules, cached GPU indices and plans).

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
            # the pools validated the indices for the route taken (see route() and HostKVPool.prepare)
            if route is None:
                host_sides = next(zip(*pairs))
                full = layer_begin == 0 and layer_end == host_sides[0].layers
                route = self.route(backend, host_sides, "cuda", to_host=to_host, tokens=len(host),
                                   per_layer=per_layer or not full)
            if route == KERNEL:
                backend = "kernel"
        background_direct = (background and per_layer and events is not None and route == DMA
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
        if dev.type != "cpu" and (not cuda or route == TORCH):
            for i, layer in enumerate(range(layer_begin, layer_end) if per_layer else (layer_begin,)):
                last = layer + 1 if per_layer else layer_end
                for side, tensors in pairs:
                    copy_torch(side, tensors, host, device, layer, last, to_host)
                if events is not None:
                    for ev in events[i]:
                        ev.record()
            return None
        regions = tuple(map(_REGION, next(zip(*pairs))))  # each side's host mapping
        if route == STAGED:
            staging.staged_backup(self, pairs, prepared, prepared.gpu(dev)[1], regions)
            return None
        if backend == "kernel" and cuda and kernels.available():
            return self._kernel(pairs, prepared, layer_begin, layer_end, to_host, per_layer, events, hold, regions)
        if not cuda:
            self.dma_plans(pairs, prepared, to_host, (layer_begin, layer_end, -1, 0, [], False, False, []))
            return None
        stream = torch.cuda.current_stream(dev)
        handles = [int(ev.cuda_event) for evs in events for ev in evs] if events is not None else []
        if events is not None and not all(handles):
            raise InvalidArgumentError("invalid argument `events`: record each event once before passing it")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        # lanes: the copy engine runs every side on the caller's stream (see lanes_for) unless events say more
        sides = ([st.cuda_stream for st in self.streams.side_streams(dev, len(events[0]) - 1)]
                 if events is not None else [])
        if background_direct:
            assert events is not None
            plans = self.dma_plans(pairs, prepared, to_host)
            sub = _native.submit_layers_background(
                plans, layer_begin, layer_end, index, stream.cuda_stream, sides, self.batch, handles,
                int(after.cuda_event) if after is not None else 0, previous,
            )
            # the submission thread records every event of the load and waits on `after`: keep them all (not
            # only the last layer's, which say when it is done) alive until it has finished
            self.inflight.hold((regions, plans, events, after), list(events[-1]), sub)
            return sub
        # from a default stream: the copies wait for what it was given before ...
        detour = self.streams.fork(dev, stream, self.batch)
        target = detour[0] if detour is not None else stream
        run = (layer_begin, layer_end, index, target.cuda_stream, sides, self.batch, per_layer, handles)
        plans = self.dma_plans(pairs, prepared, to_host, run)
        if detour is not None:
            self.streams.join(stream, detour)  # ... and join: what the caller gives it next waits for the copies
        if hold:
            self.inflight.hold((regions, plans))  # recorded on the caller's stream, after the join
        return None

    def warm_kernel(self, pairs: Sequence[tuple[Side, Sequence[torch.Tensor]]], prepared: Any) -> Any:
        """The kernel route's launches of a repeated per-layer load (:class:`~kvtier.transfer.indices.WarmLoad`),
        as ``copy`` makes them for one layer (same lanes, same blocks per launch), ready for :meth:`load_layer`; None
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
        stream's mark after them (see :meth:`InFlight.mark`). Kernels need no detour from a default stream."""
        index = dev.index
        handle = raw_stream(index) if raw_stream is not None else torch.cuda.current_stream(dev).cuda_stream
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
            streams = self.streams.side_streams(dev, warm.lanes - 1)
            sides = warm.sides[handle] = ([st.cuda_stream for st in streams], streams)
        _native.launch_layers(index, handle, sides[0], warm.natives, layer, layer + 1, [])
        self.inflight.mark(index, handle, stream, refs)

    def load_layer(self, pairs: Sequence[tuple[Side, Sequence[torch.Tensor]]], prepared: Any, layer: int,
                   backend: str, route: str, plans: Any, refs: tuple) -> None:
        """Host → device for one ``layer``: what ``copy(pairs, prepared, layer, layer + 1, to_host=False,
        backend=backend)`` does, for a repeated per-layer load whose ``route`` and ``plans`` the pool has
        already derived (:class:`~kvtier.transfer.indices.WarmLoad`): the copy engine's plans, or the kernel
        route's launches (:meth:`warm_kernel`). Only those two routes on the current device are shortened; the host
        time of a 16-page per-layer call bounds them (benches/RESULTS.md §4). ``refs``: the host regions and
        ``plans``, one tuple for every call with these plans (see :meth:`InFlight.mark`)."""
        dev = pairs[0][1][0].device
        index = dev.index
        if route == KERNEL and plans is not None:
            # the layer indexes the launches' offset tables and host layouts, which the native launch cannot
            # check (a DMA plan knows its layers: submit_layers checks them); the pool's warm path checked it
            # against the pool's layers, a direct caller of this method may not have
            if not 0 <= layer < plans.layers:
                raise InvalidArgumentError(f"invalid argument `layer`: {layer} is not in [0, {plans.layers})")
            if index == torch.cuda.current_device():
                self._load_layer_kernel(prepared, layer, dev, plans, refs)
                return
        if route != DMA or plans is None or index != torch.cuda.current_device():
            self.copy(pairs, prepared, layer, layer + 1, to_host=False, backend=backend, route=route)
            return
        if raw_stream is not None:
            handle = raw_stream(index)
            mark = self._marks.get((index, handle))
            if mark is not None and mark[1] is refs and handle not in DEFAULT_STREAMS:
                # the previous load of this index set ran on this stream: one native call submits the copies
                # and re-records the stream's mark event after them (what InFlight.mark does from Python)
                self.last_submit = _native.submit_layers(plans, layer, layer + 1, index, handle, [], self.batch,
                                                         True, [mark[2]])
                return
            d = self._detoured.get((index, handle, threading.get_ident())) if mark is not None and mark[1] is refs \
                and self.batch else None
            if d is not None and mark is not None:
                # ... from a default stream: one native call forks to the detour, submits, joins back and
                # re-records the mark (five event operations from Python cost D's 16-page loads half their
                # speed from a default stream on the H200: benches/RESULTS.md §2)
                self.last_submit = _native.submit_layers_detour(
                    plans, layer, layer + 1, index, handle, d[0].cuda_stream, d[1].cuda_event, d[2].cuda_event,
                    self.batch, mark[2])
                return
        stream = torch.cuda.current_stream(dev)
        handle = stream.cuda_stream
        # fork and join as in copy (only a default stream can need it: skip the call otherwise)
        detour = self.streams.fork(dev, stream, self.batch) if handle in DEFAULT_STREAMS else None
        self.last_submit = _native.submit_layers(
            plans, layer, layer + 1, dev.index, detour[0].cuda_stream if detour else handle, [], self.batch, False, [],
        )
        if detour is not None:
            self.streams.join(stream, detour)
            if len(self._detoured) > 64:  # (one per device, default stream and calling thread)
                self._detoured.clear()
            self._detoured[(dev.index, handle, threading.get_ident())] = detour
        self.inflight.mark(dev.index, handle, stream, refs)

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
            dev_offsets=self.layer_offsets(tensors, kernels.word_of(side.row_bytes)),
            host_idx=hidx, dev_idx=didx, to_host=to_host, blocks=blocks, num_warps=self.num_warps,
            tile_words=self.tile_words, prefetch=self.prefetch,
        )
        prepared.plans[key] = (tensors, launch)
        if len(prepared.plans) > 8:  # as in dma_plans: the latest 8
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
            staging.staged_backup(self, pairs, prepared, didx, regions)
            return
        lanes = len(events[0]) if events is not None else min(self.lanes, len(pairs))
        sides = self.streams.side_streams(dev, lanes - 1)
        blocks = self._split_blocks([side.row_bytes for side, _ in pairs], lanes)
        launches = [self._rows(side, tensors, prepared, hidx, didx, to_host, b) for (side, tensors), b in zip(pairs, blocks)]
        kernels.run_rows(launches, layer_begin, layer_end, per_layer=per_layer, events=events, side_streams=sides)
        if hold:
            self.inflight.hold((regions, hidx, didx, [x.dev_offsets for x in launches]))

    def dma_plans(self, pairs: Any, prepared: Any, to_host: bool, run: tuple[Any, ...] | None = None) -> list[Any]:
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
            args.append((side.region, side.offset, side.row_bytes, list(ts), side.split))
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
