"""The ``kernel`` IO backend on CUDA: a Triton gather/scatter that reads and writes pinned host memory
directly from the GPU (unified addressing), one work item per (token, layer) row.

- K and V are separate launches, each with its own row size (``heads * dim * itemsize``) and host layout.
- The grid is a small, fixed number of programs (``KVTIER_KERNEL_BLOCKS``, default 8) that loop over the
  rows, so a transfer never occupies more than that many SMs beside a concurrent forward pass.
- Rows move as 8/4/2/1-byte words (the widest that divides the row), in tiles of ``BLOCK_T`` rows and
  ``BLOCK_W`` words, ``BLOCK_W`` dividing the row so accesses need no column mask and vectorise.

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

    # Sizes and the layer range are runtime values: without do_not_specialize Triton compiles a new variant
    # when one of them happens to be 1 or a multiple of 16 (seen as a 0.7 s stall on the first load of layer 1).
    @triton.jit(do_not_specialize=["n_tok", "layer0", "n_layers", "S", "L", "PS"])
    def _rows_kernel(
        host_ptr,  # host buffer of this side, typed as WORD-byte words (pinned, device-accessible)
        dev_ptr,  # device layer 0, typed the same way
        dev_offs,  # int64 tensor [L]: word offset of each device layer tensor from dev_ptr
        host_idx,  # int64 tensor [n]: host token slots
        dev_idx,  # int64 tensor [n]: device rows
        n_tok,
        layer0,
        n_layers,
        S,
        L,
        PS,
        ROW_WORDS: tl.constexpr,
        LAYOUT: tl.constexpr,
        TO_HOST: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_W: tl.constexpr,  # divides ROW_WORDS, so columns need no mask and accesses vectorise
        ALIGN: tl.constexpr,  # known divisibility (in words) of every row's start offset
    ):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        n_items = n_tok * n_layers
        cols = tl.arange(0, BLOCK_W)
        for start in range(pid * BLOCK_T, n_items, nprog * BLOCK_T):
            items = start + tl.arange(0, BLOCK_T)
            live = items < n_items
            # layer-major order: consecutive items are consecutive tokens of one layer, so the rows of a
            # page are read back to back.
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
            hbase = tl.multiple_of(hrow * ROW_WORDS, ALIGN)
            dbase = tl.multiple_of(tl.load(dev_offs + layer, mask=live, other=0) + d * ROW_WORDS, ALIGN)
            m = live[:, None]
            for w0 in tl.static_range(0, ROW_WORDS, BLOCK_W):
                c = w0 + cols
                hp = host_ptr + (hbase[:, None] + c[None, :])
                dp = dev_ptr + (dbase[:, None] + c[None, :])
                if TO_HOST:
                    tl.store(hp, tl.load(dp, mask=m), mask=m)
                else:
                    tl.store(dp, tl.load(hp, mask=m), mask=m)


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_of(row_bytes: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides a row."""
    for w in (8, 4, 2, 1):
        if row_bytes % w == 0:
            return w
    return 1


def _pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while n % (p * 2) == 0 and p * 2 <= cap:
        p *= 2
    return p


@functools.lru_cache(maxsize=None)
def _tile(row_words: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_W): BLOCK_W the largest power of two ≤ 256 dividing the row, ~4096 words a tile."""
    bw = _pow2_divisor(row_words, 256)
    bt = max(1, 4096 // max(bw, row_words))
    p = 1
    while p * 2 <= bt:
        p *= 2
    return p, bw


def launch_rows(
    *,
    host: torch.Tensor,
    layout: str,
    slots: int,
    layers: int,
    page_size: int,
    row_bytes: int,
    device_layers,
    dev_offsets: torch.Tensor | None = None,
    host_idx: torch.Tensor,
    dev_idx: torch.Tensor,
    layer_begin: int,
    layer_end: int,
    to_host: bool,
    blocks: int,
    num_warps: int,
) -> None:
    """Launch one K-or-V gather/scatter on the current stream (indices already validated, on the GPU).

    ``host`` is a tensor over this side's whole host buffer (any dtype; pinned for a GPU launch),
    ``device_layers`` the per-layer device tensors, ``dev_offsets`` (optional, cached by the caller) the
    int64 word offsets of each layer from layer 0 (see :func:`layer_offsets`)."""
    n = host_idx.numel()
    if n == 0:
        return
    word = word_of(row_bytes)
    wdt = _WORD_DTYPES[word]
    row_words = row_bytes // word
    bt, bw = _tile(row_words)
    if dev_offsets is None:
        dev_offsets = layer_offsets(device_layers, word)
    hw = host.reshape(-1).view(torch.uint8).view(wdt)
    dw = device_layers[0].reshape(-1).view(torch.uint8).view(wdt)
    # every row start is a multiple of this many words: the row size's power-of-two part, capped by the
    # 256-byte alignment torch guarantees for device tensors and kvtier for host buffers
    align = _pow2_divisor(row_words, 256 // word)
    n_items = n * (layer_end - layer_begin)
    grid = (max(1, min(blocks, triton.cdiv(n_items, bt))),)
    _rows_kernel[grid](
        hw, dw, dev_offsets, host_idx, dev_idx, n, layer_begin, layer_end - layer_begin, slots, layers, page_size,
        ROW_WORDS=row_words, LAYOUT=LAYOUT_CODES[layout], TO_HOST=to_host, BLOCK_T=bt, BLOCK_W=bw, ALIGN=align,
        num_warps=num_warps,
    )


def layer_offsets(device_layers, word: int) -> torch.Tensor:
    """int64 offsets, in ``word``-byte units, of each layer tensor from the first one, on their device."""
    base = device_layers[0].data_ptr()
    offs = []
    for t in device_layers:
        delta = t.data_ptr() - base
        if delta % word:
            raise ValueError(f"device layer tensors are not {word}-byte aligned relative to each other")
        offs.append(delta // word)
    return torch.tensor(offs, dtype=torch.int64).to(device_layers[0].device)

