"""Where a host pool's pages are: the page-first layouts a tier can serve zero-copy, a pool's K and V page addresses
(affine in the page number, checked), its buffers, its logical dtype and the per-token geometry a namespace names.
Shared by the tiers that read and write a host pool's pages in place (the page store, the cluster tier)."""

from __future__ import annotations

from typing import Any

import torch

from ._errors import InvalidArgumentError
from .buffer import HostBuffer

#: Layouts whose pages keep K and V each contiguous (served zero-copy).
PAGE_LAYOUTS = ("page_first", "page_first_direct")


def logical_dtype(pool: Any, kv_cache_dtype: str | None = None) -> str:
    """A KV cache's logical dtype: ``kv_cache_dtype`` if given, else what the pool (kvtier's:
    ``logical_dtype``) or its device pool says, else the dtype its bytes are stored as."""
    dtype = (kv_cache_dtype or getattr(pool, "logical_dtype", None)
             or getattr(getattr(pool, "device_pool", None), "dtype", None) or pool.dtype)
    return str(dtype).removeprefix("torch.")


def host_buffers(pool: Any) -> tuple[HostBuffer, ...]:
    """The host buffers of a kvtier host pool; ``()`` for an engine's own pool (SGLang's keeps CPU tensors), whose
    attributes, whatever they are named, are never kvtier buffers."""
    buffers = getattr(pool, "buffers", None)
    if not isinstance(buffers, tuple) or not all(isinstance(b, HostBuffer) for b in buffers):
        return ()
    return buffers


def page_layout(pool: Any, page_num: int) -> tuple[int, int, int, int, int, int]:
    """``(k_base, k_stride, k_len, v_base, v_stride, v_len)`` of a page-first host pool, read from its
    ``get_page_buffer_meta`` at the first, second and last page and checked to be affine (as page-first
    layouts are); the Rust core then computes every page's addresses and checks them against the
    registered buffers."""
    ps = pool.page_size
    probe = sorted({0, min(1, page_num - 1), page_num - 1})
    idx = torch.cat([torch.arange(p * ps, (p + 1) * ps, dtype=torch.int64) for p in probe])
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    ptrs, sizes = [int(x) for x in ptrs], [int(x) for x in sizes]
    if len(ptrs) not in (len(probe), 2 * len(probe)):
        raise InvalidArgumentError(
            f"invalid argument `pool`: get_page_buffer_meta returned {len(ptrs)} objects for {len(probe)} pages "
            "(expected one K and one V object per page, or one object per page for MLA)"
        )
    if len(ptrs) == len(probe):  # one object per page (an MLA pool's latent KV)
        k, ks = ptrs, sizes
        k_stride = k[1] - k[0] if len(probe) > 1 else ks[0]
        for p, kp, kn in zip(probe, k, ks):
            if kp != k[0] + p * k_stride or kn != ks[0]:
                raise InvalidArgumentError(
                    "invalid argument `pool`: its pages are not evenly spaced (get_page_buffer_meta is not affine "
                    "in the page number), so the store cannot address them"
                )
        return k[0], k_stride, ks[0], 0, 0, 0
    k, v = ptrs[0::2], ptrs[1::2]
    ks, vs = sizes[0::2], sizes[1::2]
    k_stride = k[1] - k[0] if len(probe) > 1 else ks[0]
    v_stride = v[1] - v[0] if len(probe) > 1 else vs[0]
    for p, kp, vp, kn, vn in zip(probe, k, v, ks, vs):
        if kp != k[0] + p * k_stride or vp != v[0] + p * v_stride or kn != ks[0] or vn != vs[0]:
            raise InvalidArgumentError(
                "invalid argument `pool`: its pages are not evenly spaced (get_page_buffer_meta is not affine "
                "in the page number), so the store cannot address them"
            )
    return k[0], k_stride, ks[0], v[0], v_stride, vs[0]


def heads_of(pool: Any) -> str:
    """The per-token geometry part of a namespace: heads and K/V dims, or an MLA pool's latent + rope dims."""
    if getattr(pool, "kv_lora_rank", None) is not None:
        return f"mla={pool.kv_lora_rank}+{pool.qk_rope_head_dim}"
    return f"heads={pool.head_num}|k={pool.head_dim}|v={getattr(pool, 'v_head_dim', None) or pool.head_dim}"
