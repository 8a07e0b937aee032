"""kvtier's stand-in for ``sgl_kernel.kvcacheio`` (see the package docstring): the direct ops, as sgl_kernel does
them, and a RuntimeError for every other op SGLang's host pools import.

The direct ops move whole pages. ``src_indices``/``dst_indices`` hold one index per token, page by page (a page's
``page_size`` indices are consecutive, as SGLang's paged allocator and host pool hand them out); only each page's
first index is read. A device buffer is one tensor per layer (and per K and V), rows = token slots: a page is rows
``[d0, d0 + page_size)`` with d0 the page's first device index. A ``page_first_direct`` host buffer is one tensor
shaped ``(page_num, layer_num, page_size, ...)`` for K, one for V (MLA, or one side of an asymmetric K/V pool: one
tensor alone); a token's host page is ``host_index // page_size``. Like sgl_kernel's C++, the indices are read on
the CPU (``.cpu()``) and each copy is queued with ``non_blocking=True`` on the current stream.
"""

from __future__ import annotations

import torch


def _first_indices(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> tuple[list, list]:
    """The first source and destination index of every page (sgl_kernel's TORCH_CHECKs, then ``[i * page_size]``)."""
    if src_indices.numel() != dst_indices.numel():
        raise RuntimeError("Source and destination indices must have the same length")
    if page_size <= 0:
        raise RuntimeError("Page size must be positive")
    if src_indices.numel() % page_size != 0:
        raise RuntimeError("Source indices size must be divisible by page size")
    src = src_indices.cpu().reshape(-1)[::page_size].tolist()
    dst = dst_indices.cpu().reshape(-1)[::page_size].tolist()
    return src, dst


def _copy_rows(dst: torch.Tensor, dst_row: int, src: torch.Tensor, src_row: int, rows: int) -> None:
    """sgl_kernel's ``transfer_page_direct``: rows ``[dst_row, dst_row + rows)`` of ``dst`` from ``src``'s."""
    dst.narrow(0, dst_row, rows).copy_(src.narrow(0, src_row, rows), non_blocking=True)


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Row-indexed buffers on both sides (SGLang's ``layer_first`` host layout): every run of indices consecutive
    on both sides is one copy per layer, as sgl_kernel merges them."""
    if len(src_layers) != len(dst_layers):
        raise RuntimeError("Source and destination layers must have the same number of layers")
    _first_indices(src_indices, dst_indices, page_size)  # (the same checks)
    src = src_indices.cpu().reshape(-1).tolist()
    dst = dst_indices.cpu().reshape(-1).tolist()
    start = 0
    for i in range(len(src)):
        if i + 1 < len(src) and src[i + 1] - src[i] == 1 and dst[i + 1] - dst[i] == 1:
            continue
        for s_layer, d_layer in zip(src_layers, dst_layers, strict=True):
            _copy_rows(d_layer, dst[start], s_layer, src[start], i + 1 - start)
        start = i + 1


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host (page_first_direct) -> device, for the layers from ``layer_id`` on: ``src_ptrs`` is the host's K and V
    tensors (one tensor: MLA, or one side of an asymmetric pool), ``dst_ptrs`` those layers' device K buffers, then
    their V buffers (SGLang passes one layer: ``[device_k, device_v]``, or ``[device_buffer]``)."""
    is_mla = len(src_ptrs) == 1
    num_layers = len(dst_ptrs) if is_mla else len(dst_ptrs) // 2
    src_first, dst_first = _first_indices(src_indices, dst_indices, page_size)
    for s_index, d_index in zip(src_first, dst_first, strict=True):
        page = s_index // page_size
        for j in range(num_layers):
            _copy_rows(dst_ptrs[j], d_index, src_ptrs[0].select(0, page).select(0, layer_id + j), 0, page_size)
            if not is_mla:
                _copy_rows(
                    dst_ptrs[j + num_layers], d_index, src_ptrs[1].select(0, page).select(0, layer_id + j), 0, page_size
                )


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device -> host (page_first_direct), every layer: ``src_ptrs`` is every layer's device K buffer, then every
    layer's V buffer (or every layer's one buffer: MLA, one side of an asymmetric pool), ``dst_ptrs`` the host's K
    and V tensors (or the one tensor)."""
    is_mla = len(dst_ptrs) == 1
    num_layers = len(src_ptrs) if is_mla else len(src_ptrs) // 2
    src_first, dst_first = _first_indices(src_indices, dst_indices, page_size)
    for s_index, d_index in zip(src_first, dst_first, strict=True):
        page = d_index // page_size
        for j in range(num_layers):
            _copy_rows(dst_ptrs[0].select(0, page).select(0, j), 0, src_ptrs[j], s_index, page_size)
            if not is_mla:
                _copy_rows(dst_ptrs[1].select(0, page).select(0, j), 0, src_ptrs[j + num_layers], s_index, page_size)


def _not_in_standin(name: str):
    def op(*args, **kwargs):
        raise RuntimeError(
            f"sgl_kernel.kvcacheio.{name} is not part of kvtier's stand-in for sgl_kernel "
            "(benches/python/sgl_kernel_standin): it provides only the direct ops (--hicache-io-backend direct). "
            "SGLang called this kernel op because its own JIT HiCache kernel does not apply to this shape or layout; "
            "install the real sgl_kernel built for this torch to run it."
        )

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Not part of kvtier's stand-in: raises RuntimeError (sgl_kernel's {name} is a CUDA kernel)."
    return op


# Every other name pool_host/mha.py, pool_host/mla.py and memory_pool_host.py import on CUDA.
transfer_kv_per_layer = _not_in_standin("transfer_kv_per_layer")
transfer_kv_per_layer_pf_lf = _not_in_standin("transfer_kv_per_layer_pf_lf")
transfer_kv_per_layer_ph_lf = _not_in_standin("transfer_kv_per_layer_ph_lf")
transfer_kv_all_layer = _not_in_standin("transfer_kv_all_layer")
transfer_kv_all_layer_lf_pf = _not_in_standin("transfer_kv_all_layer_lf_pf")
transfer_kv_all_layer_lf_ph = _not_in_standin("transfer_kv_all_layer_lf_ph")
transfer_kv_per_layer_mla = _not_in_standin("transfer_kv_per_layer_mla")
transfer_kv_per_layer_mla_pf_lf = _not_in_standin("transfer_kv_per_layer_mla_pf_lf")
transfer_kv_all_layer_mla = _not_in_standin("transfer_kv_all_layer_mla")
transfer_kv_all_layer_mla_lf_pf = _not_in_standin("transfer_kv_all_layer_mla_lf_pf")
