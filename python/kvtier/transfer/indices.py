"""Validated index sets of one transfer call (the private copies that reach the copies and the kernels), and
the checked arguments of a pool's last per-layer load (its warm path)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._errors import InvalidArgumentError
from .route import DMA, KERNEL, TUNING

if TYPE_CHECKING:
    from .engine import TransferEngine


class Prepared:
    """Validated indices of one transfer call (host numpy copies, and GPU copies made on demand)."""

    __slots__ = ("host", "device", "paged", "_gpu", "plans", "validated")  # _gpu: (device, (host, device), event)

    def __init__(self, host: np.ndarray, device: np.ndarray, paged: bool) -> None:
        self.host, self.device, self.paged = host, device, paged
        self.validated = False  # by _native.validate_transfer (plans validate what they plan themselves)
        self._gpu: tuple[Any, ...] | None = None
        self.plans: dict[Any, Any] = {}  # DMA plans and kernel launches per (side, direction, device tensors, ...)

    def gpu(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices as int64 tensors on ``device`` (uploaded once, from pinned staging), ordered before
        whatever the current stream does next — also when a later call reuses them from another stream."""
        if self._gpu is None or self._gpu[0] != device:
            h = torch.from_numpy(self.host).pin_memory().to(device, non_blocking=True)
            d = torch.from_numpy(self.device).pin_memory().to(device, non_blocking=True)
            self._gpu = (device, (h, d), torch.cuda.current_stream(device).record_event())
        else:
            torch.cuda.current_stream(device).wait_event(self._gpu[2])
        pair: tuple[torch.Tensor, torch.Tensor] = self._gpu[1]
        return pair


#: What :func:`version_of` returns for a tensor whose in-place writes torch does not count (one made under
#: ``torch.inference_mode()``): a CUDA one is never reused by the caches below, a CPU one by its contents.
UNTRACKED = object()


def version_of(t: Any) -> Any:
    """``t._version``; :data:`UNTRACKED` for an inference tensor (reading its version raises); None for an
    object without one."""
    try:
        return t._version
    except AttributeError:
        return None
    except RuntimeError:  # "Inference tensors do not track version counter"
        return UNTRACKED


def reusable(t: Any) -> bool:
    """Whether a cache may recognise ``t`` again: a plain tensor (not a lazily negated view, whose contents
    cannot be compared in place) whose version counts its writes, or a CPU one (whose contents the caches
    compare)."""
    return not t.is_neg() and (version_of(t) is not UNTRACKED or t.device.type == "cpu")


def unchanged(prepared: Prepared, host_indices: Any, device_indices: Any) -> bool:
    """Whether CPU index tensors still hold what was validated: writes through ``.numpy()`` or DLPack do not
    bump ``_version``, so the cache key alone cannot tell. A length-n comparison, cheap next to the copy it
    guards. CUDA index tensors are not compared (that would cost a device-to-host copy per call): a caller
    that rewrites a CUDA index buffer outside torch (a Triton kernel, CUDA-graph replay, DLPack) must pass a
    new tensor or bump its version (``t.add_(0)``); otherwise the previously validated indices are used —
    never unvalidated ones, since only the private validated copy reaches the copies."""
    for t, validated in ((host_indices, prepared.host), (device_indices, prepared.device)):
        if t.device.type == "cpu" and not np.array_equal(t.detach().numpy(), validated):
            return False
    return True


def index_array(name: str, t: Any) -> np.ndarray:
    """A 1-D int64 numpy view (CPU) of an index tensor; CUDA tensors are copied to the host."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"invalid argument `{name}`: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_nested or t.layout != torch.strided or t.device.type == "meta":
        what = "nested" if t.is_nested else (f"{t.layout}" if t.layout != torch.strided else "on the meta device")
        raise InvalidArgumentError(f"invalid argument `{name}`: must be a dense CPU or CUDA tensor, got one {what}")
    if t.dtype != torch.int64:
        raise InvalidArgumentError(f"invalid argument `{name}`: dtype must be torch.int64, got {t.dtype}")
    if t.is_neg():
        t = t.resolve_neg()  # a lazily negated view (``_neg_view``): its values, materialised
    if t.dim() != 1:
        raise InvalidArgumentError(f"invalid argument `{name}`: must be 1-D, got shape {tuple(t.shape)}")
    # A private copy: the validated indices must be exactly those that reach the copies and the kernel.
    # A view of the caller's CPU tensor could be changed after validation (numpy or DLPack writes do not
    # bump the tensor's version, and validation runs with the GIL released).
    return np.array(t.detach().to("cpu").numpy(), dtype=np.int64, copy=True)


class WarmLoad:
    """The checked arguments of a pool's last per-layer load. A per-layer load is called once per layer with
    the same pools and index tensors; the next call reuses the checks when it passes the same objects, the
    index tensors are unchanged (version, and for CPU tensors their contents), the device tensors of its
    layer are the ones checked (same objects, same addresses) and no setting the route and launches were made
    from has changed since (:data:`~kvtier.transfer.route.TUNING`). Anything else takes the full path."""

    __slots__ = ("pool", "host", "device", "backend", "versions", "reusable", "snapshot", "ptrs", "pairs",
                 "prepared", "route", "plans", "refs", "contents", "tuning")

    def __init__(self, engine: TransferEngine, device_pool: Any, host: Any, device: Any, backend: str,
                 pairs: tuple[Any, ...], prepared: Prepared, route: str) -> None:
        self.pool, self.host, self.device, self.backend = device_pool, host, device, backend
        self.tuning = TUNING[0]  # the settings the caller's copy and the launches below are made with
        try:
            self.versions = (host._version, device._version)
            # (a lazily negated view's contents cannot be compared in place: never reused)
            self.reusable = not (host.is_neg() or device.is_neg())
        except RuntimeError:  # an inference tensor: reused only where its contents are compared (CPU)
            self.versions = (version_of(host), version_of(device))
            self.reusable = reusable(host) and reusable(device)
        self.snapshot: list[list[Any]] = []
        # address, shape, strides, dtype and storage size of every layer tensor, as checked
        self.ptrs: list[list[Any]] = []
        regions = []
        for side, ts in pairs:  # (plain loops: this runs once per per-layer load, on its first layer)
            ptrs = []
            for t in ts:
                ptrs.append((t.data_ptr(), t.shape, t.stride(), t.dtype, t.untyped_storage().nbytes()))
            self.snapshot.append(list(ts))
            self.ptrs.append(ptrs)
            regions.append(side.region)
        self.pairs, self.prepared, self.route = pairs, prepared, route
        # the plans the first call made and cached (the copy engine's route), or the kernel route's launches
        self.plans = None
        if len(prepared.host) and route == DMA:
            self.plans = engine.dma_plans(pairs, prepared, False)
        elif len(prepared.host) and route == KERNEL:
            self.plans = engine.warm_kernel(pairs, prepared)
        # what every load of this index set keeps alive until the GPU has passed it: one object for all of
        # them, so the engine's mark sees the same refs from call to call (InFlight.mark)
        self.refs = (tuple(regions), self.plans)
        # CPU index tensors: (tensor, its address, a numpy view of it, the validated bytes). Comparing the view's
        # bytes costs 0.5 µs against 3.6 µs for unchanged()'s conversions; the address check makes sure the view
        # still shows the tensor's memory.
        self.contents: list[tuple[Any, ...]] = []
        for t, v in ((host, prepared.host), (device, prepared.device)):
            if t.device.type == "cpu" and self.reusable:
                self.contents.append((t, t.data_ptr(), t.detach().numpy(), v.tobytes()))

    def matches(self, pool: Any, device_pool: Any, host: Any, device: Any, backend: str, layer: int) -> bool:
        """Whether a per-layer load of ``layer`` with these arguments may reuse the checks (``pool``: the host
        pool, which has checked that it is open)."""
        if (device_pool is not self.pool or host is not self.host or device is not self.device
                or backend != self.backend or not 0 <= layer < pool.layer_num or TUNING[0] != self.tuning):
            return False
        try:
            versions = (host._version, device._version)
        except RuntimeError:  # inference tensors (CPU ones: their contents are compared below)
            versions = (version_of(host), version_of(device))
        if versions != self.versions:
            return False
        live = (device_pool.kv_buffer,) if len(self.snapshot) == 1 else (device_pool.k_buffer, device_pool.v_buffer)
        for ts, snap, ptrs in zip(live, self.snapshot, self.ptrs):
            if len(ts) != len(snap):
                return False
            t = ts[layer]
            if (t is not snap[layer]
                    or (t.data_ptr(), t.shape, t.stride(), t.dtype, t.untyped_storage().nbytes()) != ptrs[layer]):
                return False
        for t, ptr, view, validated in self.contents:
            if t.data_ptr() != ptr or t.numel() * 8 != len(validated) or view.tobytes() != validated:
                return False
        return True
