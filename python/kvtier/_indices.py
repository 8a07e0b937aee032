"""Validated index sets of one transfer call: the private copies that reach the copies and the kernels."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._errors import InvalidArgumentError


class _Prepared:
    """Validated indices of one transfer call (host numpy copies, and GPU copies made on demand)."""

    __slots__ = ("host", "device", "paged", "_gpu", "plans")  # _gpu: (device, (host, device) tensors, upload event)

    def __init__(self, host: np.ndarray, device: np.ndarray, paged: bool) -> None:
        self.host, self.device, self.paged = host, device, paged
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


def _unchanged(prepared: _Prepared, host_indices: Any, device_indices: Any) -> bool:
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


def _index_array(name: str, t: Any) -> np.ndarray:
    """A 1-D int64 numpy view (CPU) of an index tensor; CUDA tensors are copied to the host."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"invalid argument `{name}`: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int64:
        raise InvalidArgumentError(f"invalid argument `{name}`: dtype must be torch.int64, got {t.dtype}")
    if t.dim() != 1:
        raise InvalidArgumentError(f"invalid argument `{name}`: must be 1-D, got shape {tuple(t.shape)}")
    # A private copy: the validated indices must be exactly those that reach the copies and the kernel.
    # A view of the caller's CPU tensor could be changed after validation (numpy or DLPack writes do not
    # bump the tensor's version, and validation runs with the GIL released).
    return np.array(t.detach().to("cpu").numpy(), dtype=np.int64, copy=True)
