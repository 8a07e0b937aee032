"""One host buffer of a pool (its K or its V) and its geometry, as the transfer engine moves it; and the torch
copy of a side, the route of unpinned host memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import _native

if TYPE_CHECKING:
    from ..buffer import HostBuffer


@dataclass(frozen=True)
class Side:
    """One host buffer (K or V) of a pool: where it lives and its geometry."""

    buffer: HostBuffer
    offset: int  # byte offset of this side inside ``buffer``
    layout: str
    slots: int
    page_size: int
    layers: int
    row_bytes: int  # one token of one layer
    tensor: torch.Tensor  # the host view, shaped as the layout says
    split: int = 1 << 62  # a DMA chunk never crosses a multiple of this many bytes from the buffer start
    # the layout as the core spells it (``_native.host_layout``): byte strides from page to page, token to
    # token inside a page, layer to layer; and the bytes of one page (all layers)
    strides: tuple[int, int, int] = (0, 0, 0)
    page_bytes: int = 0
    pinned: bool = False  # registered with CUDA when the pool was made (read once: route() runs per call)
    region: Any = None  # ``buffer.region``, the native mapping plans take and copies keep alive (read per call)

    @classmethod
    def of(cls, pool: Any, buffer: HostBuffer, offset: int, row_bytes: int, tensor: torch.Tensor) -> Side:
        chunks = buffer.registered_chunks
        # Registrations start at multiples of the first chunk's size; a copy must not straddle two.
        split = chunks[0][1] if len(chunks) > 1 else 1 << 62
        page, token, layer, page_bytes = _native.host_layout(pool.layout, pool.layer_num, pool.size, pool.page_size,
                                                             row_bytes)
        return cls(buffer, offset, pool.layout, pool.size, pool.page_size, pool.layer_num, row_bytes, tensor, split,
                   (page, token, layer), page_bytes, buffer.pinned, buffer.region)

    @property
    def base(self) -> int:
        """Address of this side's first byte."""
        return self.buffer.ptr + self.offset

    def rows_of(self, layer: int, host: torch.Tensor) -> torch.Tensor:
        """Row numbers (in ``row_bytes`` units from the side's start) of ``host`` slots in ``layer``."""
        page, token, lay = (x // self.row_bytes for x in self.strides)
        return (host // self.page_size) * page + (host % self.page_size) * token + layer * lay


def copy_torch(side: Side, device_layers: Any, host: Any, device: Any, layer_begin: int, layer_end: int,
               to_host: bool) -> None:
    """Layers ``[layer_begin, layer_end)`` of ``side`` to or from ``device_layers`` for host slots ``host`` and
    device rows ``device`` (numpy indices, validated) with torch indexing: the route of unpinned host memory."""
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
