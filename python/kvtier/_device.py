"""Device pools as kvtier sees them: kvtier's own :class:`DeviceKVPool` (per-layer K and V tensors, SGLang's
attribute names) and the geometry kvtier reads from any device pool with those names, SGLang's included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._errors import InvalidArgumentError


def positive_int(name: str, value: Any) -> int:
    """``value`` when it is a positive int (not a bool), else :class:`InvalidArgumentError` naming ``name``."""
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
        self.size = positive_int("size", size)
        self.page_size = positive_int("page_size", page_size)
        self.layer_num = positive_int("layer_num", layer_num)
        self.head_num = positive_int("head_num", head_num)
        self.head_dim = positive_int("head_dim", head_dim)
        self.v_head_dim = self.head_dim if v_head_dim is None else positive_int("v_head_dim", v_head_dim)
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
class Geometry:
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
    def of(cls, device_pool: Any) -> Geometry:
        try:
            dtype = getattr(device_pool, "store_dtype", None) or device_pool.dtype
            if getattr(device_pool, "kv_lora_rank", None) is not None:
                lora, rope = device_pool.kv_lora_rank, device_pool.qk_rope_head_dim
                for name, v in (("kv_lora_rank", lora), ("qk_rope_head_dim", rope)):
                    positive_int(f"device_pool.{name}", v)
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
            positive_int(f"device_pool.{name}", getattr(g, name))
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

    def check_layers(self, device_pool: Any) -> tuple[list[Any], ...]:
        """The device pool's per-layer tensors of each side (:meth:`device_layers`), checked against this
        geometry (a host pool's): same geometry and dtype, one contiguous ``(rows, head_num, dim)`` tensor per
        layer on one device, each inside its storage."""
        geo = Geometry.of(device_pool)
        mine = self
        for name in ("mla", "kv_lora_rank", "qk_rope_head_dim", "layer_num", "head_num", "head_dim", "v_head_dim", "dtype"):
            if getattr(geo, name) != getattr(mine, name):
                what = "MLA" if name == "mla" else name
                raise InvalidArgumentError(
                    f"invalid argument `device_pool`: {what} is {getattr(geo, name)}, the host pool has {getattr(mine, name)}"
                )
        layers = mine.device_layers(device_pool)
        if any(len(ts) != mine.layer_num for ts in layers):
            raise InvalidArgumentError(
                f"invalid argument `device_pool`: expected {mine.layer_num} layer tensors per side, got "
                + " and ".join(str(len(ts)) for ts in layers)
            )
        device = layers[0][0].device
        rows = layers[0][0].shape[0]
        for (side, dim), tensors in zip(mine.side_dims(), layers):
            for layer, t in enumerate(tensors):
                if (
                    not isinstance(t, torch.Tensor)
                    or t.dim() != 3
                    or tuple(t.shape[1:]) != (mine.head_num, dim)
                    or t.shape[0] != rows
                    or t.dtype != mine.dtype
                    or t.device != device
                    or not t.is_contiguous()
                ):
                    got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise InvalidArgumentError(
                        f"invalid argument `device_pool`: {side}[{layer}] must be a contiguous "
                        f"({rows}, {mine.head_num}, {dim}) {mine.dtype} tensor on {device}, got {got}"
                    )
                # its shape must have memory behind it: a storage shrunk in place (untyped_storage().resize_,
                # as memory savers do) keeps the shape, and a copy would run past the storage's end
                have = t.untyped_storage().nbytes()
                if t.storage_offset() * t.element_size() + t.nbytes > have:
                    raise InvalidArgumentError(
                        f"invalid argument `device_pool`: {side}[{layer}] needs {t.nbytes} bytes at storage offset "
                        f"{t.storage_offset() * t.element_size()}, its storage has {have} (was it resized?)"
                    )
        return layers


def device_of(device_pool: Any) -> torch.device:
    """The torch device of a device pool's tensors (cheap: no geometry check; for per-call paths)."""
    k = getattr(device_pool, "k_buffer", None)
    device: torch.device = (k if k is not None else device_pool.kv_buffer)[0].device
    return device


def device_layers(device_pool: Any) -> tuple[list[Any], ...]:
    """A device pool's per-layer tensors, one list per side (K and V, or an MLA pool's one ``kv_buffer``)."""
    return Geometry.of(device_pool).device_layers(device_pool)
