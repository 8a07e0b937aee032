"""KV pools with SGLang HiCache's semantics: a device pool (per-layer K and V tensors) and host pools whose K
and V data live in Rust-owned, aligned, pinned :class:`~kvtier.HostBuffer` memory.

Host shapes (outer to inner), exactly as HiCache:

=====================  ======================  =======================
layout                 K                       V
=====================  ======================  =======================
``layer_first``        ``(L, S, H, D)``        ``(L, S, H, Dv)``
``page_first``         ``(S, L, H, D)``        ``(S, L, H, Dv)``
``page_first_direct``  ``(P, L, ps, H, D)``    ``(P, L, ps, H, Dv)``
=====================  ======================  =======================

Everything is addressed by token-slot indices (int64) on both sides. K and V are separate geometries
everywhere: every transfer moves K and V with separate calls, each with its own row size and strides, so V
is never copied with K's geometry (SGLang issue #28396). What the pools share (the checks, the
transfers) is :class:`kvtier.pools_base.HostKVPool`.
"""

from __future__ import annotations

from typing import Any

from ._device import DeviceKVPool, Geometry, device_layers, device_of
from .buffer import HostBuffer
from .pools_base import BACKEND_LAYOUTS, IO_BACKENDS, LAYOUTS, HostKVPool
from .pools_mla import MLAHostPool
from .transfer.layout import Side

__all__ = ["DeviceKVPool", "MHAHostPool", "AsymmetricMHAHostPool", "host_pool_for", "device_of", "device_layers",
           "LAYOUTS", "IO_BACKENDS", "BACKEND_LAYOUTS"]


class MHAHostPool(HostKVPool):
    """Host pool for models with ``head_dim == v_head_dim``. K and V share one Rust-owned buffer,
    ``kv_buffer`` of shape ``(2, …)`` (K block then V block, as HiCache's), so ``v_ptr = k_ptr + L·S·H·D·it``
    in :meth:`get_page_buffer_meta`."""

    supported_layouts = LAYOUTS

    def _allocate_buffers(self, pin_memory: bool) -> None:
        k_shape = self._shape(self.head_dim)
        half = self.size * self.layer_num * self.k_token_stride
        buf = HostBuffer(2 * half, pin="auto" if pin_memory else False, pin_granularity=self._granularity(self.k_token_stride))
        self._buffers = [buf]
        self.kv_buffer = buf.as_tensor(self.dtype, (2, *k_shape))
        self.k_buffer, self.v_buffer = self.kv_buffer[0], self.kv_buffer[1]
        self._k_side = Side.of(self, buf, 0, self.k_token_stride, self.k_buffer)
        self._v_side = Side.of(self, buf, half, self.v_token_stride, self.v_buffer)


class AsymmetricMHAHostPool(HostKVPool):
    """Host pool for models whose K and V head dims differ (MiMo-V2: K 192, V 128). K and V are two
    independent Rust-owned buffers; only ``page_first`` and ``page_first_direct`` are supported (as in
    HiCache), and every transfer moves K and V with separate calls."""

    supported_layouts = ("page_first", "page_first_direct")
    _model_kind = "models with head_dim != v_head_dim and "

    def _layout_error(self, layout: Any) -> str:
        return (
            f"Unsupported layout for models with head_dim != v_head_dim: {layout!r}; "
            "expected 'page_first' or 'page_first_direct'."
        )

    def _backend_error(self, io_backend: Any) -> str:
        return (
            f"Unsupported IO backend for models with head_dim != v_head_dim: {io_backend!r}; "
            "expected 'kernel' or 'direct'."
        )

    def _allocate_buffers(self, pin_memory: bool) -> None:
        pin = "auto" if pin_memory else False
        kb = HostBuffer(self.size * self.layer_num * self.k_token_stride, pin=pin, pin_granularity=self._granularity(self.k_token_stride))
        vb = HostBuffer(self.size * self.layer_num * self.v_token_stride, pin=pin, pin_granularity=self._granularity(self.v_token_stride))
        self._buffers = [kb, vb]
        self.k_buffer = kb.as_tensor(self.dtype, self._shape(self.head_dim))
        self.v_buffer = vb.as_tensor(self.dtype, self._shape(self.v_head_dim))
        self.kv_buffer = (self.k_buffer, self.v_buffer)
        self._k_side = Side.of(self, kb, 0, self.k_token_stride, self.k_buffer)
        self._v_side = Side.of(self, vb, 0, self.v_token_stride, self.v_buffer)


def host_pool_for(
    device_pool: Any,
    *,
    host_to_device_ratio: float = 2.0,
    host_size_gb: float = 0,
    layout: str = "page_first_direct",
    pin_memory: bool = True,
) -> HostKVPool:
    """The host pool class HiCache would pick for ``device_pool``: :class:`~kvtier.MLAHostPool` for an MLA
    pool (one with ``kv_lora_rank``), :class:`AsymmetricMHAHostPool` when ``head_dim != v_head_dim``, else
    :class:`MHAHostPool`."""
    geo = Geometry.of(device_pool)
    if geo.mla:
        cls: type[HostKVPool] = MLAHostPool
    else:
        cls = AsymmetricMHAHostPool if geo.head_dim != geo.v_head_dim else MHAHostPool
    return cls(device_pool, host_to_device_ratio=host_to_device_ratio, host_size_gb=host_size_gb, layout=layout, pin_memory=pin_memory)
