"""KV pools for MLA models (DeepSeek-V2/V3/R1, Kimi K2, GLM): one latent + rope row per token and layer,
in SGLang HiCache's shapes.

=====================  =============================
layout                 ``kv_buffer``
=====================  =============================
``layer_first``        ``(L, S, 1, kv_lora_rank + qk_rope_head_dim)``
``page_first``         ``(S, L, 1, D)``
``page_first_direct``  ``(P, L, ps, 1, D)``
=====================  =============================

The device pool holds ``kv_buffer[l]`` of shape ``(size + page_size, 1, D)`` per layer (SGLang's
``MLATokenToKVPool``). Transfers, validation and both IO backends are those of the MHA pools, with one side
instead of K and V; :meth:`MLAHostPool.get_page_buffer_meta` gives one object per page, and
:class:`kvtier.PageStore` stores it as one object.
"""

from __future__ import annotations

from typing import Any

import torch

from ._errors import InvalidArgumentError
from .buffer import HostBuffer
from ._device import positive_int
from .pools_base import LAYOUTS, HostKVPool
from .transfer.layout import Side


class MLADeviceKVPool:
    """Per-layer latent KV tensors ``kv_buffer[l]`` ``(size + page_size, 1, kv_lora_rank + qk_rope_head_dim)``
    on any torch device (rows ``[0, page_size)`` are the padding page, as in SGLang). The MLA host pool
    accepts any object with these attributes, SGLang's own ``MLATokenToKVPool`` included."""

    def __init__(
        self,
        size: int,
        page_size: int,
        layer_num: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cuda",
    ) -> None:
        self.size = positive_int("size", size)
        self.page_size = positive_int("page_size", page_size)
        self.layer_num = positive_int("layer_num", layer_num)
        self.kv_lora_rank = positive_int("kv_lora_rank", kv_lora_rank)
        self.qk_rope_head_dim = positive_int("qk_rope_head_dim", qk_rope_head_dim)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"invalid argument `dtype`: expected a torch.dtype, got {dtype!r}")
        self.dtype = self.store_dtype = dtype
        self.device = torch.device(device)
        self.kv_cache_dim = self.kv_lora_rank + self.qk_rope_head_dim
        rows = self.size + self.page_size
        self.kv_buffer = [torch.zeros(rows, 1, self.kv_cache_dim, dtype=dtype, device=self.device) for _ in range(self.layer_num)]


class MLAHostPool(HostKVPool):
    """Host pool for MLA device pools: one Rust-owned buffer ``kv_buffer`` shaped as the module docs say
    (``head_num`` 1, ``head_dim`` = ``kv_cache_dim``, ``v_head_dim`` 0), every layout and both backends.
    ``get_page_buffer_meta`` gives one object per page (``L·ps·D·it`` bytes; for ``layer_first`` one per page
    and layer)."""

    supported_layouts = LAYOUTS
    _model_kind = "MLA models and "

    def __init__(self, device_pool: Any, **kwargs: Any) -> None:
        if getattr(device_pool, "kv_lora_rank", None) is None:
            raise InvalidArgumentError(
                f"invalid argument `device_pool`: {type(device_pool).__name__} is not an MLA pool (no kv_lora_rank); "
                "use kvtier.host_pool_for"
            )
        super().__init__(device_pool, **kwargs)

    def _allocate_buffers(self, pin_memory: bool) -> None:
        pin = "auto" if pin_memory else False
        buf = HostBuffer(self.size * self.layer_num * self.k_token_stride, pin=pin,
                         pin_granularity=self._granularity(self.k_token_stride))
        self._buffers = [buf]
        self.kv_buffer = buf.as_tensor(self.dtype, self._shape(self.kv_cache_dim))
        self._k_side = Side.of(self, buf, 0, self.k_token_stride, self.kv_buffer)
        self._v_side = None

    def sides(self) -> tuple[Side, ...]:
        """The one host buffer a transfer moves (latent and rope together)."""
        return (self._k_side,)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layout={self.layout!r}, size={self.size}, page_size={self.page_size}, "
            f"layers={self.layer_num}, kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}, "
            f"dtype={self.dtype})"
        )
