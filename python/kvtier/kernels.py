"""The ``kernel`` IO backend on CUDA: a Triton gather/scatter that reads and writes pinned host memory
directly from the GPU (unified addressing), one work item per (token, layer) row.

- K and V are separate launches, each with its own row size (``heads * dim * itemsize``) and host layout.
- The grid is a small, fixed number of programs (``KVTIER_KERNEL_BLOCKS``, default 8) that loop over the
  rows, so a transfer never occupies more than that many SMs beside a concurrent forward pass.
- Rows move as 8/4/2/1-byte words (the widest that divides the row), in tiles of ``BLOCK_T`` rows.

Every index was validated on the host (``kvtier._native.validate_transfer``) before a launch: the kernel
computes addresses from indices it may trust.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch's CUDA wheels ship triton
    triton = None
    tl = None

LAYOUT_CODES = {"layer_first": 0, "page_first": 1, "page_first_direct": 2}


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _rows_kernel(
        host_base,  # int64 address of this side's host buffer (pinned, device-accessible)
        dev_ptrs,  # int64 tensor [L]: address of each device layer tensor
        host_idx,  # int64 tensor [n]: host token slots
        dev_idx,  # int64 tensor [n]: device rows
        n_tok,
        layer0,
        n_layers,
        S,
        L,
        PS,
        ROW_WORDS: tl.constexpr,
        WORD: tl.constexpr,  # 8, 4, 2 or 1 bytes
        LAYOUT: tl.constexpr,
        TO_HOST: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        if WORD == 8:
            ptr_ty = tl.pointer_type(tl.int64)
        elif WORD == 4:
            ptr_ty = tl.pointer_type(tl.int32)
        elif WORD == 2:
            ptr_ty = tl.pointer_type(tl.int16)
        else:
            ptr_ty = tl.pointer_type(tl.int8)
        row_bytes = ROW_WORDS * WORD
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        n_items = n_tok * n_layers
        cols = tl.arange(0, BLOCK_W)
        for start in range(pid * BLOCK_T, n_items, nprog * BLOCK_T):
            items = start + tl.arange(0, BLOCK_T)
            live = items < n_items
            # layer-major order: consecutive items of one program are consecutive tokens of one layer,
            # so page-contiguous rows are read back to back.
            t = items % n_tok
            layer = layer0 + items // n_tok
            h = tl.load(host_idx + t, mask=live, other=0)
            d = tl.load(dev_idx + t, mask=live, other=0)
            if LAYOUT == 0:
                hrow = layer.to(tl.int64) * S + h
            elif LAYOUT == 1:
                hrow = h * L + layer
            else:
                hrow = ((h // PS) * L + layer) * PS + h % PS
            dbase = tl.load(dev_ptrs + layer, mask=live, other=0)
            haddr = host_base + hrow * row_bytes
            daddr = dbase + d * row_bytes
            for w0 in range(0, ROW_WORDS, BLOCK_W):
                c = w0 + cols
                m = live[:, None] & (c[None, :] < ROW_WORDS)
                hp = (haddr[:, None] + c[None, :] * WORD).to(ptr_ty)
                dp = (daddr[:, None] + c[None, :] * WORD).to(ptr_ty)
                if TO_HOST:
                    tl.store(hp, tl.load(dp, mask=m), mask=m)
                else:
                    tl.store(dp, tl.load(hp, mask=m), mask=m)


def _word(row_bytes: int) -> int:
    for w in (8, 4, 2, 1):
        if row_bytes % w == 0:
            return w
    return 1


@functools.lru_cache(maxsize=None)
def _tile(row_words: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_W): about 4096 words per tile, BLOCK_W the row rounded up to a power of two (≤ 512)."""
    bw = 1
    while bw < row_words and bw < 512:
        bw *= 2
    bt = max(1, 4096 // bw)
    return bt, bw


def launch_rows(
    *,
    host_base: int,
    layout: str,
    slots: int,
    layers: int,
    page_size: int,
    row_bytes: int,
    dev_ptrs: torch.Tensor,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    layer_begin: int,
    layer_end: int,
    to_host: bool,
    blocks: int,
    num_warps: int,
) -> None:
    """Launch one K-or-V gather/scatter on the current stream (indices already validated, on the GPU)."""
    n = host_idx.numel()
    if n == 0:
        return
    word = _word(row_bytes)
    row_words = row_bytes // word
    bt, bw = _tile(row_words)
    n_items = n * (layer_end - layer_begin)
    grid = (max(1, min(blocks, triton.cdiv(n_items, bt))),)
    _rows_kernel[grid](
        host_base,
        dev_ptrs,
        host_idx,
        dev_idx,
        n,
        layer_begin,
        layer_end - layer_begin,
        slots,
        layers,
        page_size,
        ROW_WORDS=row_words,
        WORD=word,
        LAYOUT=LAYOUT_CODES[layout],
        TO_HOST=to_host,
        BLOCK_T=bt,
        BLOCK_W=bw,
        num_warps=num_warps,
    )
