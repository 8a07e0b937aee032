"""Staged backups: device → host for every layer of a page-first pool through device staging buffers. A kernel
gathers whole pages (all layers) into a staging buffer in the host's byte order and the copy engine writes
them to the host, one copy per page run, so PCIe carries the copy engine's large writes instead of the
kernel's 128-byte ones or one small copy per (page, layer). Used by the ``kernel`` backend
(``KVTIER_KERNEL_BACKUP``) and by ``direct`` backups that ``TransferEngine.route`` stages
(``KVTIER_DIRECT_BACKUP``)."""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np
import torch

from .. import _native
from . import kernels
from .inflight import InFlight
from .layout import Side
from .streams import Streams


class StagingEngine(Protocol):
    """What a staged backup reads from the engine that runs it (:class:`kvtier.transfer.TransferEngine`'s
    public members): the kernel's settings, whether copies are batched, its streams, holds, staging buffers
    and device-layer offset tables."""

    blocks: int
    num_warps: int
    tile_words: int
    prefetch: bool
    batch: bool
    staging_bytes: int
    streams: Streams
    inflight: InFlight
    stager: Stager

    def layer_offsets(self, tensors: Any, word: int) -> tuple[torch.Tensor, int]: ...


class Stager:
    """The staging buffers of one engine, one :class:`Staging` per device, grown on demand; one backup at a
    time uses them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # held for a whole staged backup
        self.buffers: dict[Any, Staging] = {}

    def get(self, device: torch.device, need: int, size: int) -> Staging:
        """The staging of ``device``, made anew (of ``max(size, need)`` bytes per buffer) when it holds less
        than ``need``. Called under :attr:`lock`."""
        st = self.buffers.get(device)
        if st is None or st.half < need:
            st = self.buffers[device] = Staging(device, max(size, need))
        return st

    def clear(self) -> None:
        """Drop every staging buffer (a closing engine calls it)."""
        self.buffers.clear()


def staged_backup(engine: StagingEngine, pairs, prepared, didx: torch.Tensor, regions: tuple) -> None:
    """Device → host for every layer of page-first pools: the kernel gathers a run of pages (all layers)
    into a device staging buffer in the host's byte order (``page_first`` or ``page_first_direct``; a
    page is one contiguous extent in both), then the copy engine moves it
    to the host as chunks contiguous on both sides (whole pages, or runs of pages). Gathers run on a
    helper stream, copies on the current stream, alternating between two buffers, so the gather of run
    k+1 overlaps the copy of run k; the copies wait for their gather and each gather for the copy that last
    read its buffer. Runs are as large as a buffer (whole pages), the first at most half the transfer.
    Every run costs fixed host work and launch latency, so many small runs starve the copy engine
    (measured: runs of 1, 2, 4, 8 pages gave 80 % of the ceiling at 16 pages of A, SM writes 84–87 %)."""
    dev = didx.device
    caller = torch.cuda.current_stream(dev)
    detour = engine.streams.fork(dev, caller, engine.batch)  # as in copy: the batch API refuses the default stream
    stream = detour[0] if detour is not None else caller
    with engine.stager.lock:
        need = max(side.layers * side.row_bytes * side.page_size for side, _ in pairs)
        st = engine.stager.get(dev, need, engine.staging_bytes)
        held: list = [st]
        try:
            _stage_runs(engine, pairs, prepared, didx, stream, st, held)
        except BaseException:
            # Nothing of a failed backup may stay in flight: the staging events would no longer say when
            # a buffer is free, and nothing would hold what the enqueued work reads.
            st.gather.synchronize()
            stream.synchronize()
            raise
        if detour is not None:
            engine.streams.join(caller, detour)
        engine.inflight.hold((regions, held, didx))


def _stage_runs(engine: StagingEngine, pairs, prepared, didx: torch.Tensor, stream, st: Staging, held: list) -> None:
    dev = didx.device
    start = stream.record_event()  # gathers follow the producer of the device KV
    st.gather.wait_event(start)
    held.append(start)
    k = 0
    for side, tensors in pairs:
        token_bytes = side.layers * side.row_bytes
        cap = max(1, st.half // (token_bytes * side.page_size)) * side.page_size
        st.ensure_rows(cap)
        n = len(prepared.host)
        # the first run is at most half the transfer, so a second run's gather overlaps its copy
        half = -(-n // 2)
        size, pos = min(cap, max(side.page_size, -(-half // side.page_size) * side.page_size)), 0
        offsets = engine.layer_offsets(tensors, kernels.word_of(side.row_bytes))
        held.append(offsets)
        while pos < n:
            end = min(n, pos + size)
            buf = k % 2
            stage = st.buffers[buf][: (end - pos) * token_bytes]
            stage_idx = st.arange[: end - pos]
            with torch.cuda.stream(st.gather):
                st.gather.wait_event(st.copied[buf])
                launch = kernels.prepare_rows(
                    host=stage, layout=side.layout, slots=end - pos, layers=side.layers,
                    page_size=side.page_size, row_bytes=side.row_bytes, device_layers=tensors,
                    dev_offsets=offsets, host_idx=stage_idx, dev_idx=didx[pos:end], to_host=True,
                    blocks=engine.blocks, num_warps=engine.num_warps, tile_words=engine.tile_words,
                    prefetch=engine.prefetch,
                )
                kernels.run_rows([launch], 0, side.layers, per_layer=False)
                st.gathered[buf].record(st.gather)
            stream.wait_event(st.gathered[buf])
            plan = _stage_plan(side, prepared, stage, pos, end, st)
            held.append((plan, stage_idx))
            _native.submit_layers([plan], 0, 1, dev.index, stream.cuda_stream, [], engine.batch, False, [])
            st.copied[buf].record(stream)
            k += 1
            pos = end
            size = cap


def _stage_plan(side: Side, prepared: Any, stage: torch.Tensor, pos: int, end: int, st: Staging):
    """DMA plan from a staging buffer (one row = one token's every layer) to the host slots
    ``prepared.host[pos:end]``, validated in Rust like every plan; cached per run for repeated calls."""
    key = ("stage", side.offset, id(side.buffer), pos, end, stage.data_ptr(), id(st))
    entry = prepared.plans.get(key)
    if entry is not None and entry[0] is st:
        return entry[1]
    plan = _native.TransferPlan(
        True, side.region, side.offset, "page_first", side.slots, side.page_size,
        side.layers * side.row_bytes, [stage], prepared.host[pos:end], st.arange_np[: end - pos], 0, 1,
        False, False, side.split,
    )
    prepared.plans[key] = (st, plan)
    return plan


class Staging:
    """Two device staging buffers of ``half`` bytes each, the helper stream that gathers into them, and the
    events that order gathers and copies (see ``staged_backup``)."""

    def __init__(self, device: torch.device, half: int) -> None:
        self.half = half
        self.buffers = [torch.empty(half, dtype=torch.uint8, device=device) for _ in range(2)]
        self.gather = torch.cuda.Stream(device)
        self.gathered = [torch.cuda.Event() for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in range(2)]
        for ev in self.copied:
            ev.record()  # nothing has read the buffers yet
        self.device = device
        self.arange_np = np.arange(0, dtype=np.int64)
        self.arange = torch.empty(0, dtype=torch.int64, device=device)

    def ensure_rows(self, n: int) -> None:
        """Make ``arange`` (staging row numbers, host and device copies) at least ``n`` long. In-flight gathers
        keep the slices they were given alive."""
        if len(self.arange_np) < n:
            self.arange_np = np.arange(n, dtype=np.int64)
            self.arange = torch.from_numpy(self.arange_np).to(self.device)
