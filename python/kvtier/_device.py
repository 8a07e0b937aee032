"""Device pools as kvtier sees them: kvtier's own :class:`DeviceKVPool` (per-layer K and V tensors, SGLang's
attribute names) and the geometry kvtier reads from any device pool with those names, SGLang's included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._errors import InvalidArgumentError


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"invalid argument `{name}`: must be a positive int, got {value!r}")
    return value


class DeviceKVPool:
    """Per-layer K and V tensors ``k_buffer[l]`` ``(size + page_size, H, D)`` and ``v_buffer[l]``
    ``(size + page_size, H, Dv)`` on any torch device (rows ``[0, page_size)`` are the padding page, as in
    SGLang). Host pools accept any object with these attributes, SGLang's own device pool included."""

    def __init__(
        self,
        size: int,
        page_size: int,
        layer_num: int,
        head_num: int,
        head_dim: int,
        v_head_dim: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cuda",
    ) -> None:
        self.size = _positive_int("size", size)
        self.page_size = _positive_int("page_size", page_size)
        self.layer_num = _positive_int("layer_num", layer_num)
        self.head_num = _positive_int("head_num", head_num)
        self.head_dim = _positive_int("head_dim", head_dim)
        self.v_head_dim = self.head_dim if v_head_dim is None else _positive_int("v_head_dim", v_head_dim)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"invalid argument `dtype`: expected a torch.dtype, got {dtype!r}")
        self.dtype = self.store_dtype = dtype
        self.device = torch.device(device)
        rows = self.size + self.page_size
        self.k_buffer = [torch.zeros(rows, self.head_num, self.head_dim, dtype=dtype, device=self.device) for _ in range(self.layer_num)]
        self.v_buffer = [torch.zeros(rows, self.head_num, self.v_head_dim, dtype=dtype, device=self.device) for _ in range(self.layer_num)]
        self.row_dim = self.head_num * self.head_dim
        self.v_row_dim = self.head_num * self.v_head_dim


@dataclass(frozen=True)
class _Geometry:
    """Per-token geometry of a device pool. An MLA pool (one latent+rope row per token and layer) is one
    side: ``head_num`` 1, ``head_dim`` the row's width, ``v_head_dim`` 0."""

    layer_num: int
    head_num: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    page_size: int
    kv_lora_rank: int | None = None  # MLA only
    qk_rope_head_dim: int | None = None

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank is not None

    @classmethod
    def of(cls, device_pool: Any) -> _Geometry:
        try:
            dtype = getattr(device_pool, "store_dtype", None) or device_pool.dtype
            if getattr(device_pool, "kv_lora_rank", None) is not None:
                lora, rope = device_pool.kv_lora_rank, device_pool.qk_rope_head_dim
                for name, v in (("kv_lora_rank", lora), ("qk_rope_head_dim", rope)):
                    _positive_int(f"device_pool.{name}", v)
                width = getattr(device_pool, "kv_cache_dim", None) or lora + rope
                g = cls(device_pool.layer_num, 1, width, 0, dtype, device_pool.page_size, lora, rope)
                device_pool.kv_buffer  # noqa: B018 - presence check
            else:
                head_dim = device_pool.head_dim
                g = cls(
                    layer_num=device_pool.layer_num,
                    head_num=device_pool.head_num,
                    head_dim=head_dim,
                    v_head_dim=getattr(device_pool, "v_head_dim", None) or head_dim,
                    dtype=dtype,
                    page_size=device_pool.page_size,
                )
                device_pool.k_buffer, device_pool.v_buffer  # noqa: B018 - presence check
        except AttributeError as exc:
            raise InvalidArgumentError(
                f"invalid argument `device_pool`: {type(device_pool).__name__} lacks {exc.name!r}; expected "
                "layer_num, head_num, head_dim, v_head_dim, dtype, page_size, k_buffer and v_buffer (or for MLA "
                "layer_num, kv_lora_rank, qk_rope_head_dim, dtype, page_size and kv_buffer)"
            ) from None
        for name in ("layer_num", "head_num", "head_dim", "page_size") + (() if g.mla else ("v_head_dim",)):
            _positive_int(f"device_pool.{name}", getattr(g, name))
        return g

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def device_layers(self, device_pool: Any) -> tuple[list[Any], ...]:
        """The device pool's per-layer tensors of each side: ``(k_buffer, v_buffer)``, or ``(kv_buffer,)``
        for MLA."""
        if self.mla:
            return (list(device_pool.kv_buffer),)
        return list(device_pool.k_buffer), list(device_pool.v_buffer)

    def side_dims(self) -> tuple[tuple[str, int], ...]:
        """``(name, last dim)`` of each side's device tensors (``(rows, head_num, dim)`` each)."""
        if self.mla:
            return (("kv_buffer", self.head_dim),)
        return ("k_buffer", self.head_dim), ("v_buffer", self.v_head_dim)


def device_of(device_pool: Any) -> torch.device:
    """The torch device of a device pool's tensors (cheap: no geometry check; for per-call paths)."""
    k = getattr(device_pool, "k_buffer", None)
    device: torch.device = (k if k is not None else device_pool.kv_buffer)[0].device
    return device


def device_layers(device_pool: Any) -> tuple[list[Any], ...]:
    """A device pool's per-layer tensors, one list per side (K and V, or an MLA pool's one ``kv_buffer``)."""
    return _Geometry.of(device_pool).device_layers(device_pool)
