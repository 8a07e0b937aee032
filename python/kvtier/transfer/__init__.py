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
  - ``kernel``: a Triton gather/scatter (:mod:`kvtier.transfer.kernels`) that reads/writes pinned host memory from
    the GPU with a bounded number of thread blocks, launched natively once compiled; K and V run
    concurrently on the caller's stream and a side stream joined back into it (``KVTIER_TRANSFER_LANES``).
    Large backups of ``page_first`` pools are staged: gathered into device buffers, moved by the copy engine.
  Host buffers, plans, events and index tensors are kept alive until the work that uses them has completed
  (an event recorded after it, and for a background submission, the end of the submission).
- CUDA tensors with an unpinned host buffer (pinning failed): a torch gather/scatter, correct but slow.

The package, one module per concept (imports run one way, engine → the rest):

- ``route``: :class:`Route`, the names of the routes; ``engine``: :class:`TransferEngine` (which route, and
  the copies); ``layout``: :class:`Side`, a K or V host buffer's geometry (and the torch route's copy);
- ``kernels``: the Triton kernels; ``staging``: staged backups; ``streams``: side streams and the
  default-stream detour; ``inflight``: what keeps in-flight copies' objects alive;
- ``indices``: the pools' validated index sets and the warm path of repeated per-layer loads;
- ``gate``: holding a stream's later copies until host work (a disk read) has finished.
"""

from __future__ import annotations

from .engine import KERNEL_TILE_WORDS, TransferEngine
from .layout import Side
from .route import Route
from .streams import DEFAULT_STREAMS

__all__ = ["DEFAULT_STREAMS", "KERNEL_TILE_WORDS", "Route", "Side", "TransferEngine"]
