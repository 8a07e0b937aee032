"""Copy engines between a host pool's K or V buffer and a device pool's per-layer tensors.

The host pools validate every argument (the index checks run in Rust) before calling :meth:`TransferEngine.copy`,
once for K and once for V. Which engine runs depends on where the device tensors live:

- CPU tensors: the Rust core plans byte chunks (contiguous on both sides) and copies them with the GIL
  released, re-checking every chunk against both buffers' extents.
- CUDA tensors: a torch gather/scatter (indexing on the host view, ``index_copy_`` on the device), on the
  caller's current stream. This is the correctness path; the batched-DMA and SM-bounded kernel fast paths
  replace it without touching the pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from . import _native

if TYPE_CHECKING:
    from .buffer import HostBuffer


@dataclass(frozen=True)
class Side:
    """One host buffer (K or V) of a pool: where it lives and its geometry."""

    buffer: "HostBuffer"
    offset: int  # byte offset of this side inside ``buffer``
    layout: str
    slots: int
    page_size: int
    layers: int
    row_bytes: int  # one token of one layer
    tensor: torch.Tensor  # the host view, shaped as the layout says

    @classmethod
    def of(cls, pool: Any, buffer: "HostBuffer", offset: int, row_bytes: int, tensor: torch.Tensor) -> "Side":
        return cls(buffer, offset, pool.layout, pool.size, pool.page_size, pool.layer_num, row_bytes, tensor)

    @property
    def base(self) -> int:
        return self.buffer.ptr + self.offset

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers (contiguous in page-first layouts)."""
        return self.page_size * self.layers * self.row_bytes

    def layer_view(self, layer: int, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``(view, index)`` such that ``view[index]`` are the rows of ``host`` slots in ``layer``."""
        t = self.tensor
        if self.layout == "layer_first":
            return t[layer], host
        if self.layout == "page_first":
            return t[:, layer], host
        return t[:, layer], (host // self.page_size, host % self.page_size)


class TransferEngine:
    """Executes validated K-or-V copies; see the module docs."""

    def copy(
        self,
        side: Side,
        device_layers: Sequence[torch.Tensor],
        host: np.ndarray,
        device: np.ndarray,
        layer_begin: int,
        layer_end: int,
        paged: bool,
        *,
        to_host: bool,
    ) -> None:
        if len(host) == 0:
            return
        if device_layers[0].device.type == "cpu":
            _native.copy_cpu(
                to_host,
                side.buffer._region,
                side.offset,
                side.layout,
                side.slots,
                side.page_size,
                side.row_bytes,
                list(device_layers),
                host,
                device,
                layer_begin,
                layer_end,
                paged,
                paged,
            )
            return
        self._copy_torch(side, device_layers, host, device, layer_begin, layer_end, to_host)

    @staticmethod
    def _copy_torch(side, device_layers, host, device, layer_begin, layer_end, to_host) -> None:
        dev = device_layers[0].device
        h = torch.from_numpy(host)
        d = torch.from_numpy(device).to(dev, non_blocking=True)
        for layer in range(layer_begin, layer_end):
            # Move raw bytes (uint8 views of the last dim): exact for every dtype, float8 included.
            view, index = side.layer_view(layer, h)
            view = view.view(torch.uint8)
            target = device_layers[layer].view(torch.uint8)
            if to_host:
                view[index] = target.index_select(0, d).to("cpu")
            else:
                target.index_copy_(0, d, view[index].to(dev, non_blocking=True))
