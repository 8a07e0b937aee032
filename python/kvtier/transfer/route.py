"""The routes a transfer can take, named once (:meth:`kvtier.transfer.TransferEngine.route` picks one)."""

from __future__ import annotations

from enum import StrEnum


class Route(StrEnum):
    """How one transfer moves. A ``str``: members equal, print and serialise as their values (``"dma"``),
    so results, logs and comparisons with the plain names read as before."""

    #: CPU device pool: the Rust core's memcpy of planned chunks, GIL released.
    CPU = "cpu"
    #: CUDA device pool and unpinned host memory: a torch gather/scatter, correct but slow.
    TORCH = "torch"
    #: a Triton gather/scatter reading and writing pinned host memory from the GPU.
    KERNEL = "kernel"
    #: a backup gathered by a kernel into device staging buffers, written to the host by the copy engine.
    STAGED = "staged"
    #: the copy engine, one copy per contiguous chunk.
    DMA = "dma"


#: Routes whose copies run from plans the core validates as it makes them: the pools validate indices up
#: front for every other route.
PLANNED = frozenset({Route.CPU, Route.DMA})

# The members as module constants for the per-call paths: an enum's class attribute costs ~0.2 µs in CPython
# 3.11, a module global a tenth of that.
CPU, TORCH, KERNEL, STAGED, DMA = Route.CPU, Route.TORCH, Route.KERNEL, Route.STAGED, Route.DMA

#: How many times, in this process, a setting that routes and kernel launches are made from has changed (a
#: :class:`~kvtier.transfer.TransferEngine`'s tuning attributes, :func:`kvtier.transfer.kernels.set_native`).
#: A warm per-layer load made before a change is not reused (:class:`~kvtier.transfer.indices.WarmLoad`), so
#: a bench that sweeps a setting measures the setting, not the launches of the first one. A list: one
#: mutable cell the modules read in place.
TUNING = [0]
