"""What every kvtier host pool shares (:class:`HostKVPool`): sizing, page allocation, zero-copy page access,
the checks of a transfer's arguments and the transfers themselves, through a :class:`TransferEngine`. The
pools themselves, and the layouts and shapes they keep, are in :mod:`kvtier.pools` and
:mod:`kvtier.pools_mla`."""

from __future__ import annotations

import collections
import os
import threading
from typing import Any

import torch

from . import _native
from ._errors import ClosedError, InvalidArgumentError
from .buffer import HostBuffer
from ._device import Geometry
from .transfer.engine import TransferEngine
from .transfer.indices import Prepared, WarmLoad, index_array, reusable, unchanged, version_of
from .transfer.layout import Side
from .transfer.route import PLANNED, Route

__all__ = ["HostKVPool", "LAYOUTS", "IO_BACKENDS", "BACKEND_LAYOUTS"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
IO_BACKENDS = ("kernel", "direct")
# Layouts each backend can move (HiCache: direct needs whole contiguous chunks, kernel gathers tokens).
BACKEND_LAYOUTS = {"direct": ("layer_first", "page_first_direct"), "kernel": ("layer_first", "page_first")}
GB = 10**9


def host_memory_available() -> int:
    """Host memory a new allocation can take now: the kernel's MemAvailable (else the free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class HostKVPool:
    """Shared machinery of the MHA, asymmetric and MLA host pools (see :mod:`kvtier.pools`); a subclass
    allocates the buffers and their sides."""

    supported_layouts: tuple[str, ...] = LAYOUTS
    # set by _allocate_buffers, dropped by close()
    kv_buffer: Any
    k_buffer: Any
    v_buffer: Any
    _k_side: Any
    _v_side: Any
    _buffers: list[HostBuffer]
    _model_kind = ""
    #: Host memory kept free when sizing a pool (HiCache keeps 10 GiB): at most this or a quarter of what is available.
    memory_reserve_bytes = 10 << 30

    def __init__(
        self,
        device_pool: Any,
        host_to_device_ratio: float = 2.0,
        host_size_gb: float = 0,
        layout: str = "page_first_direct",
        pin_memory: bool = True,
    ) -> None:
        geo = Geometry.of(device_pool)
        if layout not in self.supported_layouts:
            raise InvalidArgumentError(self._layout_error(layout))
        if not isinstance(host_to_device_ratio, (int, float)) or host_to_device_ratio <= 0:
            raise InvalidArgumentError(f"invalid argument `host_to_device_ratio`: must be > 0, got {host_to_device_ratio!r}")
        if not isinstance(host_size_gb, (int, float)) or host_size_gb < 0:
            raise InvalidArgumentError(f"invalid argument `host_size_gb`: must be >= 0, got {host_size_gb!r}")
        self.layout = layout
        self.page_size = ps = geo.page_size
        self.layer_num = geo.layer_num
        self.head_num = geo.head_num
        self.head_dim = geo.head_dim
        self.v_head_dim = geo.v_head_dim
        self.dtype = geo.dtype
        # the device pool's own dtype: an fp8 cache stored as uint8 still names its format (store namespaces)
        self.logical_dtype = getattr(device_pool, "dtype", geo.dtype)
        self._geo = geo
        if geo.mla:
            self.kv_lora_rank, self.qk_rope_head_dim, self.kv_cache_dim = geo.kv_lora_rank, geo.qk_rope_head_dim, geo.head_dim
        it = geo.itemsize
        self.k_token_stride = geo.head_num * geo.head_dim * it  # bytes of one token of one layer
        self.v_token_stride = geo.head_num * geo.v_head_dim * it
        size_per_token = self.get_size_per_token()
        if host_size_gb > 0:
            size = int(host_size_gb * GB // size_per_token)
        else:
            size = int(device_pool.size * host_to_device_ratio)
        # HiCache's sizing: whole pages, always one spare page.
        self.page_num = size // ps + 1
        self.size = self.page_num * ps
        requested = self.size * size_per_token
        available = host_memory_available()
        if requested > available - min(self.memory_reserve_bytes, available // 4):
            raise InvalidArgumentError(
                f"invalid argument `host_size_gb`: not enough host memory for {self.size} tokens "
                f"({requested / GB:.2f} GB requested, {available / GB:.2f} GB available)"
            )
        self._alloc = _native.PageAllocator(self.page_num, ps)
        self._lock = threading.RLock()
        self._closed = False
        self._engine = TransferEngine()
        # validated index sets of the last few operations (a per-layer load and a backup of the same pages
        # alternate): key -> (the index tensors, kept referenced so their ids stay unique; Prepared)
        self._prepared: collections.OrderedDict[tuple[Any, ...], tuple[Any, Prepared]] = collections.OrderedDict()
        self._checked_device: tuple[Any, ...] | None = None
        self._prepared_lock = threading.Lock()  # transfers may come from several threads
        self._warm: WarmLoad | None = None  # the last per-layer load's checked arguments (see load_to_device_per_layer)
        self._allocate_buffers(pin_memory)

    # ---------------------------------------------------------------- shapes and buffers
    def _shape(self, dim: int) -> tuple[int, ...]:
        L, S, H, P, ps = self.layer_num, self.size, self.head_num, self.page_num, self.page_size
        return {
            "layer_first": (L, S, H, dim),
            "page_first": (S, L, H, dim),
            "page_first_direct": (P, L, ps, H, dim),
        }[self.layout]

    def _granularity(self, token_stride: int) -> int:
        """Bytes of the unit a page transfer or page store moves in one piece (never split by pinning)."""
        if self.layout == "layer_first":
            return self.page_size * token_stride
        return self.page_size * self.layer_num * token_stride

    def _allocate_buffers(self, pin_memory: bool) -> None:
        raise NotImplementedError

    @property
    def engine(self) -> TransferEngine:
        """The transfer engine this pool's copies go through (its lanes, routes and warm state)."""
        return self._engine

    @property
    def buffers(self) -> tuple[HostBuffer, ...]:
        """The host buffers this pool owns: one for MHA and MLA pools, K then V for asymmetric ones."""
        return tuple(self._buffers)

    def sides(self) -> tuple[Side, ...]:
        """The host buffers a transfer moves, each with its own geometry: K then V (one for MLA)."""
        return self._k_side, self._v_side

    # ---------------------------------------------------------------- sizes
    def get_size_per_token(self) -> int:
        """Bytes of one token across all layers, K and V: ``(D + Dv)·H·L·itemsize``."""
        return (self.head_dim + self.v_head_dim) * self.head_num * self.layer_num * self._geo.itemsize

    def get_ksize_per_token(self) -> int:
        """Bytes of one token's K across all layers: ``D·H·L·itemsize``."""
        return self.head_dim * self.head_num * self.layer_num * self._geo.itemsize

    # ---------------------------------------------------------------- allocation
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{type(self).__name__} is closed")

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` token slots as whole pages (int64 CPU tensor), or ``None`` when the pool is full."""
        self._check_open()
        if isinstance(need_size, bool) or not isinstance(need_size, int):
            raise InvalidArgumentError(f"invalid argument `need_size`: must be an int, got {need_size!r}")
        got = self._alloc.alloc(need_size)
        return None if got is None else torch.tensor(got, dtype=torch.int64)

    def free(self, indices: torch.Tensor) -> int:
        """Frees whole pages; returns the slot count. Double frees and foreign indices raise ValueError and
        free nothing."""
        self._check_open()
        return self._alloc.free(index_array("indices", indices))

    def available_size(self) -> int:
        return self._alloc.available()

    def clear(self) -> None:
        """Marks every slot free (data is left in place)."""
        self._alloc.clear()

    def wipe(self, indices: torch.Tensor) -> None:
        """Overwrites the KV of whole pages (every layer, K and V) with zeros: what erasure frees keeps none
        of its tenant's KV. The pages must be whole (as :meth:`free` takes them)."""
        self._check_open()
        pages = _native.page_numbers(index_array("indices", indices), self.page_size, self.page_num)
        if not len(pages):
            return
        ps = self.page_size
        pg = torch.as_tensor(list(pages), dtype=torch.int64)
        slots = (pg[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)
        data = self.kv_buffer
        if isinstance(data, tuple):
            tensors = list(data)  # asymmetric: K and V of their own shapes
        elif data.dim() == len(self._shape(1)) + 1:
            tensors = [data[0], data[1]]  # MHA: K and V stacked
        else:
            tensors = [data]  # MLA: one latent buffer
        with self._lock:
            for t in tensors:
                if self.layout == "layer_first":
                    t[:, slots] = 0
                elif self.layout == "page_first":
                    t[slots] = 0
                else:  # page_first_direct: pages are the outer dimension
                    t[pg] = 0

    # ---------------------------------------------------------------- zero-copy page access
    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Addresses and sizes of whole pages for zero-copy storage backends: ``[k0, v0, k1, v1, …]`` with
        sizes ``[L·ps·H·D·it, L·ps·H·Dv·it, …]`` for page-first layouts; for ``layer_first`` one pair per
        page per layer of ``ps·H·D·it`` / ``ps·H·Dv·it`` bytes."""
        self._check_open()
        pages = _native.page_numbers(index_array("indices", indices), self.page_size, self.page_num)
        sides = self.sides()
        # the extents come from the core's layout (one per page, or per page and layer for layer_first)
        per_side = [_native.page_extents(s.layout, s.layers, s.slots, s.page_size, s.row_bytes, pages) for s in sides]
        ptrs: list[int] = []
        sizes: list[int] = []
        for extents in zip(*per_side):  # K then V of one extent, as HiCache orders them
            for side, (offset, size) in zip(sides, extents):
                ptrs.append(side.base + offset)
                sizes.append(size)
        return ptrs, sizes

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        """True when both base addresses and both page strides are multiples of ``page_size_bytes`` (what
        O_DIRECT zero-copy IO needs). Page-first layouts only; ``layer_first`` pages are not contiguous."""
        self._check_open()
        if self.layout == "layer_first":
            return False
        return all(s.base % page_size_bytes == 0 and s.page_bytes % page_size_bytes == 0 for s in self.sides())

    # ---------------------------------------------------------------- transfers
    def _check_backend(self, io_backend: str) -> None:
        if io_backend not in IO_BACKENDS:
            raise InvalidArgumentError(self._backend_error(io_backend))
        if self.layout not in BACKEND_LAYOUTS[io_backend]:
            allowed = [x for x in BACKEND_LAYOUTS[io_backend] if x in self.supported_layouts]
            raise InvalidArgumentError(
                f"Unsupported layout for {self._model_kind}io_backend={io_backend!r}: {self.layout}; expected "
                + " or ".join(repr(x) for x in allowed)
                + "."
            )

    def _backend_error(self, io_backend: Any) -> str:
        return f"Unsupported IO backend: {io_backend!r}; expected 'kernel' or 'direct'."

    def _layout_error(self, layout: Any) -> str:
        return f"Unsupported layout: {layout!r}; expected " + ", ".join(repr(x) for x in self.supported_layouts) + "."

    def _check_layer(self, layer_id: Any) -> None:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < self.layer_num:
            raise InvalidArgumentError(f"invalid argument `layer_id`: must be an int in [0, {self.layer_num}), got {layer_id!r}")

    def _check_device_pool(self, device_pool: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """``(layers, pairs)``: the device pool's per-layer tensors of each side (see
        :meth:`Geometry.device_layers`), checked against this pool's geometry, and each side paired with
        its layers. The check is cached while the pool and its tensors are unchanged.

        A device pool that defines an int ``layers_version`` promises that while it keeps its value, its layer
        lists hold the same tensors, unchanged in place (kvtier's own layer windows do: they bump it when they
        reallocate); the cache is then keyed by the pool and that number instead of every tensor's address,
        shape, strides and storage (about 2 µs per tensor, for every per-layer call)."""
        version = getattr(device_pool, "layers_version", None)
        if type(version) is int:
            last = self._checked_device
            if last is not None and last[0] == (id(device_pool), version):
                cached_fast: tuple[tuple[Any, ...], tuple[Any, ...]] = last[2]
                return cached_fast
            checked_fast = tuple(self._geo.check_layers(device_pool))
            result_fast = (checked_fast, tuple(zip(self.sides(), checked_fast)))
            self._checked_device = ((id(device_pool), version), (device_pool,), result_fast)  # holds it: ids unique
            return result_fast
        try:
            layers = (list(device_pool.kv_buffer),) if self._geo.kv_lora_rank is not None else (
                list(device_pool.k_buffer), list(device_pool.v_buffer))
            # every layer's tensor object, address, shape, strides, dtype and storage size (what the check
            # read; a tensor changed in place by set_/resize_/.data= keeps its object and often its address,
            # and a storage resized in place keeps the tensor's shape)
            parts: list[Any] = [id(device_pool)]
            for ts in layers:
                parts.append(None)
                for t in ts:
                    parts += (id(t), t.data_ptr(), t.shape, t.stride(), t.dtype, t.untyped_storage().nbytes())
            key: list[Any] | None = parts
        except (AttributeError, TypeError):
            key = None
        last = self._checked_device  # read once: another thread may replace it
        if key is not None and last is not None and last[0] == key:
            cached: tuple[tuple[Any, ...], tuple[Any, ...]] = last[2]
            return cached
        checked = tuple(self._geo.check_layers(device_pool))
        result = (checked, tuple(zip(self.sides(), checked)))
        if key is not None:
            self._checked_device = (key, (device_pool, layers), result)  # holds refs: ids stay unique
        return result

    def prepare(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str,
                to_host: bool, per_layer: bool = False) -> tuple[tuple[Any, ...], Prepared, Route]:
        """Checks one transfer's arguments and returns ``(pairs, prepared, route)``: ``(side, device layers)``
        of K then V, the validated indices, and how the engine moves them (:meth:`TransferEngine.route`;
        ``per_layer``: not every layer in one go). Every transfer method starts here; benches pass its answer
        to :meth:`TransferEngine.copy` to time the engine alone."""
        if self._closed:
            self._check_open()
        if type(io_backend) is not str or io_backend not in BACKEND_LAYOUTS or self.layout not in BACKEND_LAYOUTS[io_backend]:
            self._check_backend(io_backend)
        layers, pairs = self._check_device_pool(device_pool)
        sides = next(zip(*pairs))
        first = layers[0][0]
        rows = first.shape[0]
        # A per-layer load calls this once per layer with the same index tensors: validate once, and reuse
        # while neither tensor has been modified (torch bumps ``_version`` on every in-place write).
        try:
            key = (id(host_indices), host_indices._version, id(device_indices), device_indices._version, io_backend,
                   to_host, rows)
            cacheable = not (host_indices.is_neg() or device_indices.is_neg())
        except (AttributeError, RuntimeError):  # not tensors, or inference tensors (torch counts no version):
            key = (id(host_indices), version_of(host_indices), id(device_indices), version_of(device_indices),
                   io_backend, to_host, rows)  # a CPU one is recognised by its contents, a CUDA one never
            cacheable = (isinstance(host_indices, torch.Tensor) and isinstance(device_indices, torch.Tensor)
                         and reusable(host_indices) and reusable(device_indices))
        cached = self._prepared.get(key) if cacheable else None
        if cached is not None and unchanged(cached[1], host_indices, device_indices):
            p = cached[1]
            with self._prepared_lock:
                if key in self._prepared:  # another thread may have evicted it since
                    self._prepared.move_to_end(key)
            route = self._engine.route(io_backend, sides, first.device.type, to_host=to_host, tokens=len(p.host),
                                       per_layer=per_layer)
            # Validated when made, unless the planner was to validate it: a route that needs validated indices
            # (kernel, staged, torch) validates them once here, whatever route the first use took.
            if not p.validated and route not in PLANNED:
                _native.validate_transfer(p.host, p.device, self.size, rows, self.page_size, p.paged, p.paged, to_host)
                p.validated = True
            return pairs, p, route
        h = index_array("host_indices", host_indices)
        d = index_array("device_indices", device_indices)
        paged = self.layout == "page_first_direct"
        if io_backend == "direct" and self.layout == "layer_first" and len(h) % self.page_size:
            raise InvalidArgumentError(
                f"invalid argument `host_indices`: length {len(h)} is not a multiple of page_size {self.page_size}"
            )
        # Validated once: where the copies run from plans (CPU device pools; CUDA ones with pinned memory and
        # the direct backend), the core validates the indices when it plans them, in the call that makes the
        # first copies; the other paths (kernels, torch copies of unpinned memory) are validated here.
        route = self._engine.route(io_backend, sides, first.device.type, to_host=to_host, tokens=len(h),
                                   per_layer=per_layer)
        prepared = Prepared(h, d, paged)
        if route not in PLANNED or len(h) == 0 or len(h) != len(d):
            _native.validate_transfer(h, d, self.size, rows, self.page_size, paged, paged, to_host)
            prepared.validated = True
        if cacheable:
            with self._prepared_lock:
                self._prepared[key] = ((host_indices, device_indices), prepared)
                while len(self._prepared) > 4:
                    self._prepared.popitem(last=False)
        return pairs, prepared, route

    def load_to_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                                 layer_id: int, io_backend: str) -> None:
        """Host → device for one layer: ``device.k_buffer[layer_id][device_indices[i]] =
        host K[layer_id][host_indices[i]]``, then V with its own geometry (a separate call). Enqueued on the
        current CUDA stream for CUDA device pools; synchronous for CPU ones."""
        w = self._warm
        if (w is not None and not self._closed and type(layer_id) is int
                and w.matches(self, device_pool, host_indices, device_indices, io_backend, layer_id)):
            self._engine.load_layer(w.pairs, w.prepared, layer_id, io_backend, w.route, w.plans, w.refs)
            return
        self._check_layer(layer_id)
        pairs, p, route = self.prepare(device_pool, host_indices, device_indices, io_backend, False, True)
        self._engine.copy(pairs, p, layer_id, layer_id + 1, to_host=False, backend=io_backend, route=route)
        w = WarmLoad(self._engine, device_pool, host_indices, device_indices, io_backend, pairs, p, route)
        self._warm = w if w.reusable else None

    def load_all_layers(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                        io_backend: str, events: Any, background: bool = True, after: Any = None,
                        previous: Any = None) -> Any:
        """Every layer host → device, recording ``events[layer]`` (torch CUDA events, recorded at least once
        before) on the current stream after each layer is enqueued. Validation and planning happen once for
        all layers and one native call enqueues them all; the same copies as ``load_to_device_per_layer``
        for each layer. With ``background``, ``direct`` copies are submitted by a native thread and the
        returned ``Submission`` must be waited on before an event is used (see LayerLoader); else None.
        ``after``: an event the copies follow; ``previous``: the last background submission on this stream."""
        pairs, p, route = self.prepare(device_pool, host_indices, device_indices, io_backend, False, True)
        return self._engine.copy(pairs, p, 0, self.layer_num, to_host=False, backend=io_backend, per_layer=True,
                                 events=events, background=background, after=after, previous=previous, route=route)

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                                     io_backend: str) -> None:
        """Device → host for every layer, K then V (separate calls, separate geometries). Enqueued on the
        current CUDA stream for CUDA device pools: order it after the producer of the device KV (see
        :func:`kvtier.backup_async`)."""
        pairs, p, route = self.prepare(device_pool, host_indices, device_indices, io_backend, True)
        self._engine.copy(pairs, p, 0, self.layer_num, to_host=True, backend=io_backend, route=route)

    def backup_from_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
                                     layer_id: int, io_backend: str) -> None:
        """Device → host for one layer (the copies :meth:`backup_from_device_all_layer` makes for that layer):
        for an engine whose device pool holds a window of the layers at a time. Enqueued on the current CUDA
        stream for CUDA device pools."""
        self._check_layer(layer_id)
        pairs, p, route = self.prepare(device_pool, host_indices, device_indices, io_backend, True, True)
        self._engine.copy(pairs, p, layer_id, layer_id + 1, to_host=True, backend=io_backend, route=route)

    def copy_layer(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, layer_id: int,
                    io_backend: str, *, to_host: bool, events: Any, after: Any = None, previous: Any = None) -> Any:
        """One layer either way (the copies of ``backup_from_device_per_layer`` / ``load_to_device_per_layer``),
        recording ``events`` (one per lane) after it; ``direct`` copies are submitted by a native thread (the
        returned ``Submission`` says when the events are recorded: wait for it before using them), after
        ``after`` and after ``previous`` (the last background submission on the current stream); other routes
        enqueue before returning (None)."""
        self._check_layer(layer_id)
        pairs, p, route = self.prepare(device_pool, host_indices, device_indices, io_backend, to_host, True)
        return self._engine.copy(pairs, p, layer_id, layer_id + 1, to_host=to_host, backend=io_backend, per_layer=True,
                                 events=[events], background=True, after=after, previous=previous, route=route)

    def copy_layers(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str, *,
                    to_host: bool, events: Any, after: Any = None, previous: Any = None) -> Any:
        """Every layer either way in one native call (the copies of :meth:`copy_layer` for each layer, layer by
        layer), recording ``events[layer]`` (one per lane) after each layer; the submission and ordering rules of
        :meth:`copy_layer`."""
        pairs, p, route = self.prepare(device_pool, host_indices, device_indices, io_backend, to_host, True)
        return self._engine.copy(pairs, p, 0, self.layer_num, to_host=to_host, backend=io_backend, per_layer=True,
                                 events=events, background=True, after=after, previous=previous, route=route)

    def synchronize(self) -> None:
        """Wait until every transfer this pool issued has completed."""
        self._engine.synchronize()

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Releases the host memory (tensors handed out keep it alive until they are dropped)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._engine.close()  # never unmap memory a copy still reads or writes; drops staging buffers
            self._prepared.clear()
            self._checked_device = None
            self._warm = None
            # Drop the pool's own views so the memory goes as soon as the caller holds none.
            self.k_buffer = self.v_buffer = self.kv_buffer = None
            self._k_side = self._v_side = None
            for b in self._buffers:
                b.close()
            self._buffers = []

    def __enter__(self) -> HostKVPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layout={self.layout!r}, size={self.size}, page_size={self.page_size}, "
            f"layers={self.layer_num}, heads={self.head_num}, head_dim={self.head_dim}, "
            f"v_head_dim={self.v_head_dim}, dtype={self.dtype})"
        )
