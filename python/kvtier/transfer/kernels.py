"""The ``kernel`` IO backend on CUDA: a Triton gather/scatter that reads and writes pinned host memory
directly from the GPU (unified addressing).

- K and V are separate launches, each with its own row size (``heads * dim * itemsize``) and host layout.
- The grid is a small, fixed number of programs (``KVTIER_KERNEL_BLOCKS``, default 16) that loop over the
  work, so a transfer never occupies more than that many SMs beside a concurrent forward pass.
- Rows move as 8/4/2/1-byte words (the widest that divides the row). A row is cut into sub-rows of
  ``BLOCK_W`` words (the largest power of two dividing it, so no column mask is needed and accesses
  vectorise to 16 bytes); one work item is one sub-row of one token in one layer, and a program moves a tile
  of ``BLOCK_T`` items with one load and one store. With ``PREFETCH`` the next tile's load is issued before
  the current tile is stored, so two tiles per program are in flight across PCIe.

After the first launch of a variant (which goes through Triton's launcher and compiles it), launches go
through ``kvtier._native.launch_layers``: one native call enqueues K and V for every layer of a load, with the
per-layer events in between, without Triton's per-launch Python cost. The parameter list of the compiled
code is read from its PTX and checked against what is passed; any mismatch (another Triton version's ABI)
keeps that variant on Triton's launcher.

Every index was validated on the host (``kvtier._native.validate_transfer``) before a launch: the kernel
computes addresses from indices it may trust.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch

from .. import _native
from .._errors import InvalidArgumentError
from .route import TUNING

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - torch's CUDA wheels ship triton
    triton = None
    tl = None

# runtime parameters of _rows_kernel, in order; LAYER_PARAM is the index of ``layer0``. SP, ST, SL: the host
# layout's strides in rows (page, token inside a page, layer), as the core computes them (_native.host_layout)
_PARAMS = ("host_ptr", "dev_ptr", "dev_offs", "host_idx", "dev_idx", "n_tok", "layer0", "n_layers", "SP", "ST", "SL",
           "PS")
_POINTERS = 5
LAYER_PARAM = 6


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _tile(start, host_idx, dev_idx, dev_offs, n_items, n_tok, layer0, SP, ST, SL, PS,
              ROW_WORDS: tl.constexpr, PAGED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
              ALIGN: tl.constexpr):
        """Word offsets (host, device) and the live mask of the tile of items starting at ``start``."""
        SUB: tl.constexpr = ROW_WORDS // BLOCK_W
        items = start + tl.arange(0, BLOCK_T)
        live = items < n_items
        sub = items % SUB
        r = items // SUB
        # layer-major order: consecutive items are consecutive sub-rows of consecutive tokens of one layer, so
        # the rows of a page are read back to back.
        t = r % n_tok
        layer = layer0 + r // n_tok
        h = tl.load(host_idx + t, mask=live, other=0)
        d = tl.load(dev_idx + t, mask=live, other=0)
        # the core's layout (_native.host_layout); where a page is just page_size tokens in a row (SP == PS·ST)
        # the slot maps affinely and the division is skipped: it costs D's 9-sub-row rows 7 points of PCIe
        if PAGED:
            hrow = (h // PS) * SP + (h % PS) * ST + layer.to(tl.int64) * SL
        else:
            hrow = h * ST + layer.to(tl.int64) * SL
        hbase = tl.multiple_of(hrow * ROW_WORDS + sub * BLOCK_W, ALIGN)
        dbase = tl.multiple_of(tl.load(dev_offs + layer, mask=live, other=0) + d * ROW_WORDS + sub * BLOCK_W, ALIGN)
        cols = tl.arange(0, BLOCK_W)
        return hbase[:, None] + cols[None, :], dbase[:, None] + cols[None, :], live[:, None]

    # Sizes and the layer range are runtime values: without do_not_specialize Triton compiles a new variant
    # when one of them happens to be 1 or a multiple of 16 (seen as a 0.7 s stall on the first load of layer 1).
    @triton.jit(do_not_specialize=["n_tok", "layer0", "n_layers", "SP", "ST", "SL", "PS"])
    def _rows_kernel(
        host_ptr,  # host buffer of this side, typed as WORD-byte words (pinned, device-accessible)
        dev_ptr,  # device layer 0, typed the same way
        dev_offs,  # int64 tensor [L]: word offset of each device layer tensor from dev_ptr
        host_idx,  # int64 tensor [n]: host token slots
        dev_idx,  # int64 tensor [n]: device rows
        n_tok,
        layer0,
        n_layers,
        SP,
        ST,
        SL,
        PS,
        ROW_WORDS: tl.constexpr,
        PAGED: tl.constexpr,  # the layout needs the page / token split (SP != PS·ST)
        TO_HOST: tl.constexpr,
        BLOCK_T: tl.constexpr,  # sub-rows per tile
        BLOCK_W: tl.constexpr,  # words per sub-row; divides ROW_WORDS
        ALIGN: tl.constexpr,  # known divisibility (in words) of every sub-row's start offset
        PREFETCH: tl.constexpr,  # issue the next tile's load before storing this one
    ):
        pid = tl.program_id(0)
        step = tl.num_programs(0) * BLOCK_T
        n_items = n_tok * n_layers * (ROW_WORDS // BLOCK_W)
        start = pid * BLOCK_T
        if PREFETCH:
            ho, do, m = _tile(start, host_idx, dev_idx, dev_offs, n_items, n_tok, layer0, SP, ST, SL, PS,
                              ROW_WORDS, PAGED, BLOCK_T, BLOCK_W, ALIGN)
            if TO_HOST:
                x = tl.load(dev_ptr + do, mask=m)
            else:
                x = tl.load(host_ptr + ho, mask=m)
            while start < n_items:
                nho, ndo, nm = _tile(start + step, host_idx, dev_idx, dev_offs, n_items, n_tok, layer0, SP, ST, SL, PS,
                                     ROW_WORDS, PAGED, BLOCK_T, BLOCK_W, ALIGN)
                if TO_HOST:
                    nx = tl.load(dev_ptr + ndo, mask=nm)
                    tl.store(host_ptr + ho, x, mask=m)
                else:
                    nx = tl.load(host_ptr + nho, mask=nm)
                    tl.store(dev_ptr + do, x, mask=m)
                x, ho, do, m = nx, nho, ndo, nm
                start += step
        else:
            for s in range(start, n_items, step):
                ho, do, m = _tile(s, host_idx, dev_idx, dev_offs, n_items, n_tok, layer0, SP, ST, SL, PS,
                                  ROW_WORDS, PAGED, BLOCK_T, BLOCK_W, ALIGN)
                if TO_HOST:
                    tl.store(host_ptr + ho, tl.load(dev_ptr + do, mask=m), mask=m)
                else:
                    tl.store(dev_ptr + do, tl.load(host_ptr + ho, mask=m), mask=m)


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


@functools.cache
def _tile_shape(row_words: int, tile_words: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_W): BLOCK_W the largest power of two ≤ 128 dividing the row, BLOCK_T a power of two
    with BLOCK_T * BLOCK_W ≈ ``tile_words``."""
    bw = _pow2_divisor(row_words, 128)
    bt = max(1, tile_words // bw)
    p = 1
    while p * 2 <= bt:
        p *= 2
    return p, bw


@dataclass
class _Abi:
    """How to launch one compiled variant natively (or why not: ``function == 0``, ``reason`` set)."""

    function: int
    block: int
    shared: int
    widths: tuple[int, ...]
    reason: str = ""
    memory_ops: tuple[str, ...] = ()  # the global load/store instructions in the PTX (are they 16 bytes wide?)
    registers: int = 0


# compiled variant key -> _Abi, filled on each variant's first (Triton-launched) run
_ABIS: dict[tuple, _Abi] = {}
_native_enabled = True


def set_native(enabled: bool) -> None:
    """Launch compiled variants natively (default) or always through Triton's launcher (benches compare)."""
    global _native_enabled
    _native_enabled = bool(enabled)
    TUNING[0] += 1  # warm per-layer loads made before launch as set now


def native_status() -> dict:
    """For diagnostics: each compiled variant and whether it launches natively (else why not)."""
    return {
        str(k): (a.reason or f"native: block {a.block}, shared {a.shared}, {a.registers} registers, {len(a.widths)} params")
        + f"; {' '.join(a.memory_ops)}"
        for k, a in _ABIS.items()
    }


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.([busf])(\d+)\b")


def _abi_of(compiled) -> _Abi:
    """Reads the launch ABI of a Triton ``CompiledKernel`` and checks it against ``_rows_kernel``'s runtime
    parameters (5 pointers, 7 32-bit integers, then only null scratch pointers)."""
    try:
        md = compiled.metadata
        ptx = compiled.asm["ptx"]
        if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False) or getattr(md, "launch_cooperative_grid", False):
            return _Abi(0, 0, 0, (), "needs a launch attribute (clusters, PDL or cooperative grid)")
        for name in ("global_scratch_size", "profile_scratch_size"):
            if getattr(md, name, 0):
                return _Abi(0, 0, 0, (), f"{name} is {getattr(md, name)}")
        entries = [m for m in _ENTRY.finditer(ptx) if m.group(1).startswith("_rows_kernel")]
        if len(entries) != 1:
            return _Abi(0, 0, 0, (), f"{len(entries)} _rows_kernel entries in the PTX")
        params = entries[0].group(2)
        widths = tuple(int(bits) // 8 for _, bits in _PARAM.findall(params))
        if len(widths) != params.count(".param"):
            return _Abi(0, 0, 0, (), f"a parameter of another kind in {params.count('.param')} parameters")
        want = (8,) * _POINTERS + (4,) * (len(_PARAMS) - _POINTERS)
        extra = widths[len(want):]
        if widths[: len(want)] != want or any(w != 8 for w in extra) or len(extra) > 2:
            return _Abi(0, 0, 0, (), f"parameter widths {widths} do not match {want} + scratch pointers")
        if hasattr(compiled, "_init_handles"):
            compiled._init_handles()
        function = int(compiled.function or 0)
        if not function:
            return _Abi(0, 0, 0, (), "no CUfunction handle")
        ops = tuple(sorted(set(re.findall(r"\b(?:ld|st)\.global[\w.]*", ptx))))
        return _Abi(function, 32 * int(md.num_warps), int(md.shared), widths, memory_ops=ops,
                    registers=int(getattr(compiled, "n_regs", 0) or 0))
    except Exception as e:  # noqa: BLE001 - any surprise keeps Triton's own launcher
        return _Abi(0, 0, 0, (), f"{type(e).__name__}: {e}")


@dataclass
class RowsLaunch:
    """One K-or-V launch, fully determined except for the layer range."""

    host: torch.Tensor  # word view of the host side
    dev: torch.Tensor  # word view of device layer 0
    dev_offsets: torch.Tensor  # see layer_offsets
    host_idx: torch.Tensor
    dev_idx: torch.Tensor
    ints: tuple[int, int, int, int, int]  # n_tok, SP, ST, SL, PS
    consts: dict
    blocks: int
    num_warps: int
    key: tuple
    layers: int  # layers of the host layout and of the device offset table

    def grid(self, n_layers: int) -> int:
        bt, bw = self.consts["BLOCK_T"], self.consts["BLOCK_W"]
        n_items = self.ints[0] * n_layers * (self.consts["ROW_WORDS"] // bw)
        return max(1, min(self.blocks, triton.cdiv(n_items, bt)))

    def run_triton(self, layer0: int, n_layers: int):
        n_tok, sp, st, sl, ps = self.ints
        return _rows_kernel[(self.grid(n_layers),)](
            self.host, self.dev, self.dev_offsets, self.host_idx, self.dev_idx, n_tok, layer0, n_layers, sp, st, sl, ps,
            **self.consts, num_warps=self.num_warps,
        )

    def native(self, n_layers: int):
        """``launch_layers`` tuple for ``n_layers`` layers per launch, or None (not compiled / not native)."""
        abi = _ABIS.get(self.key)
        if abi is None or not abi.function or not _native_enabled:
            return None
        n_tok, sp, st, sl, ps = self.ints
        values = [self.host.data_ptr(), self.dev.data_ptr(), self.dev_offsets.data_ptr(), self.host_idx.data_ptr(),
                  self.dev_idx.data_ptr(), n_tok, 0, n_layers, sp, st, sl, ps]
        values += [0] * (len(abi.widths) - len(values))
        return (abi.function, self.grid(n_layers), abi.block, abi.shared, list(abi.widths), values, LAYER_PARAM)


def prepare_rows(
    *, host, layout, slots, layers, page_size, row_bytes, device_layers, dev_offsets: tuple[torch.Tensor, int] | None = None, host_idx, dev_idx,
    to_host, blocks, num_warps, tile_words: int = 4096, prefetch: bool = True,
) -> RowsLaunch:
    """Everything one K-or-V launch needs except its layer range (indices already validated)."""
    # The kernel addresses every layer as dev[0] + dev_offsets[l] and the host as one flat buffer: a
    # non-contiguous tensor would be silently copied by reshape(-1), and the kernel would then write
    # relative to the copy (arbitrary device memory for every layer but the first). Checked once per
    # cached launch description.
    for what, t in (("host", host), *((f"device_layers[{i}]", t) for i, t in enumerate(device_layers))):
        if not t.is_contiguous():
            raise InvalidArgumentError(f"invalid argument `{what}`: the kernel needs contiguous tensors")
    if dev_offsets is not None and dev_offsets[0].numel() != len(device_layers):
        raise InvalidArgumentError(f"invalid argument `dev_offsets`: {dev_offsets[0].numel()} offsets for "
                                   f"{len(device_layers)} device layers")
    need = int(slots) * int(layers) * int(row_bytes)
    if host.numel() * host.element_size() < need:
        raise InvalidArgumentError(f"invalid argument `host`: {host.numel() * host.element_size()} bytes, the "
                                   f"layout needs {slots} slots x {layers} layers x {row_bytes} bytes = {need}")
    if len(device_layers) != int(layers):
        raise InvalidArgumentError(f"invalid argument `device_layers`: {len(device_layers)} tensors for {layers} layers")
    word = word_of(row_bytes)
    wdt = _WORD_DTYPES[word]
    row_words = row_bytes // word
    bt, bw = _tile_shape(row_words, tile_words)
    offsets, dev_align = dev_offsets if dev_offsets is not None else layer_offsets(device_layers, word)
    hw = host.reshape(-1).view(torch.uint8).view(wdt)
    dw = device_layers[0].reshape(-1).view(torch.uint8).view(wdt)
    # every sub-row start is a multiple of this many words (offsets from the buffer starts): host offsets
    # are multiples of the sub-row size, device ones also include the layer tensors' relative offsets
    align = min(bw, dev_align)
    # A page_first staging buffer (see kvtier.transfer.staging) may hold a run of tokens that is not whole pages; that
    # layout's strides do not depend on the slot count, so the core is asked about the whole pages around them.
    # In the other layouts they do (layer_first's layer stride) or a partial page would lie past the buffer.
    ps, n_slots = int(page_size), int(slots)
    if ps > 0 and n_slots % ps and layout != "page_first":
        raise InvalidArgumentError(f"invalid argument `slots`: {n_slots} is not a multiple of page_size {ps} "
                                   f"({layout} addresses whole pages)")
    if ps > 0 and layout == "page_first":
        n_slots = -(-n_slots // ps) * ps
    sp, st, sl, _ = _native.host_layout(layout, int(layers), n_slots, ps, int(row_bytes))
    rp, rt, rl = (x // int(row_bytes) for x in (sp, st, sl))  # every stride is a whole number of rows
    if max(rp, rt, rl) >= 1 << 31:
        raise InvalidArgumentError(f"invalid argument `host`: a layout stride of {max(rp, rt, rl)} rows does not "
                                   "fit the kernel's 32-bit parameters")
    ints = (int(host_idx.numel()), rp, rt, rl, ps)
    consts = dict(ROW_WORDS=row_words, PAGED=rp != ps * rt, TO_HOST=bool(to_host), BLOCK_T=bt, BLOCK_W=bw, ALIGN=align,
                  PREFETCH=bool(prefetch))
    aligned = tuple(t.data_ptr() % 16 == 0 for t in (hw, dw, offsets, host_idx, dev_idx))
    # the word size is part of the variant: rows of m 4-byte and of m 8-byte words share every constant
    key = (hw.device.index, word, tuple(sorted(consts.items())), num_warps, aligned)
    return RowsLaunch(hw, dw, offsets, host_idx, dev_idx, ints, consts, blocks, num_warps, key, int(layers))


def _items(x: RowsLaunch, layers: int) -> int:
    """Work items of one launch over ``layers`` layers, plus one grid stride of slack: the kernel counts
    them in 32 bits."""
    return x.ints[0] * layers * (x.consts["ROW_WORDS"] // x.consts["BLOCK_W"]) + x.blocks * x.consts["BLOCK_T"]


class WarmLaunches:
    """The launches of a repeated per-layer load (``kvtier.transfer.indices.WarmLoad``), fixed but for the layer: the
    tuples ``_native.launch_layers`` takes, made once instead of on every call as :func:`run_rows` does, the
    lanes they run on, and per caller stream its side streams. Holding it keeps every buffer the launches
    address alive (the launch descriptions hold them). ``layers``: the layers every launch's offset table and
    host layout hold; a launch's layer must be below it (the native call cannot tell)."""

    __slots__ = ("natives", "lanes", "launches", "sides", "layers")

    def __init__(self, natives: list, lanes: int, launches: list[RowsLaunch]) -> None:
        self.natives, self.lanes, self.launches = natives, lanes, launches
        self.layers = min([x.layers for x in launches], default=0)
        # caller stream handle -> (side stream handles, the side streams themselves, kept alive here)
        self.sides: dict[int, tuple[list[int], list[Any]]] = {}

    @staticmethod
    def of(launches: list[RowsLaunch], lanes: int) -> WarmLaunches | None:
        """From the launch descriptions of one layer's copies (one per side, made by the first call with
        ``blocks`` split over ``lanes``); None when they do not all launch natively with 32-bit arguments
        (:func:`run_rows` then serves every call)."""
        launches = [x for x in launches if x.ints[0] > 0]
        if (not launches or not all(x.host_idx.is_cuda for x in launches)
                or not all(v < 2**31 for x in launches for v in x.ints)
                or any(_items(x, 1) >= 2**31 for x in launches)):
            return None
        natives = [x.native(1) for x in launches]
        if any(n is None for n in natives):
            return None
        return WarmLaunches(natives, lanes, launches)


def run_rows(launches, layer_begin: int, layer_end: int, *, per_layer: bool, events=None, side_streams=()) -> None:
    """Enqueue ``launches`` on the current stream for layers ``[layer_begin, layer_end)``: one launch each
    covering all of them, or (``per_layer``) one launch each per layer, recording after layer
    ``layer_begin + i`` the torch events ``events[i]`` (one per lane). Launch j runs on lane j mod (1 +
    ``side_streams``): the side streams fork from the current stream and join back into it (natively
    launched variants; Triton-launched ones run everything on the current stream)."""
    launches = [x for x in launches if x.ints[0] > 0]
    if not launches or layer_begin >= layer_end:
        return
    for x in launches:  # layers index the offset table and the host layout: both hold x.layers layers
        if not 0 <= layer_begin < layer_end <= x.layers:
            raise InvalidArgumentError(f"invalid argument `layer_end`: layers [{layer_begin}, {layer_end}) are not "
                                       f"within the {x.layers} layers of the transfer")
    n_layers = 1 if per_layer else layer_end - layer_begin
    if any(_items(x, n_layers) >= 2**31 for x in launches):
        if any(_items(x, 1) >= 2**31 for x in launches):
            raise InvalidArgumentError(f"invalid argument `host_indices`: {launches[0].ints[0]} tokens are too many "
                                       "for one kernel transfer; split the call")
        if not per_layer and events is None:  # one launch per layer keeps each within range
            per_layer, n_layers = True, 1
        else:
            raise InvalidArgumentError("invalid argument `host_indices`: too many tokens for one kernel transfer")
    cuda = launches[0].host_idx.is_cuda
    small = all(v < 2**31 for x in launches for v in x.ints) and layer_end < 2**31
    natives = [x.native(n_layers) for x in launches] if cuda and small else [None]
    if all(n is not None for n in natives):
        handles = []
        if events is not None:
            handles = [int(ev.cuda_event) for evs in events for ev in evs]
        stream = torch.cuda.current_stream(launches[0].host_idx.device)
        last = layer_end if per_layer else layer_begin + 1
        sides = [s.cuda_stream for s in side_streams]
        _native.launch_layers(launches[0].host_idx.device.index, stream.cuda_stream, sides, natives,  # type: ignore[arg-type]
                              layer_begin,
                              last, handles)
        return
    steps = range(layer_begin, layer_end) if per_layer else (layer_begin,)
    for i, layer in enumerate(steps):
        for x in launches:
            compiled = x.run_triton(layer, n_layers)
            if cuda and x.key not in _ABIS:
                _ABIS[x.key] = _abi_of(compiled)
        if events is not None:
            for ev in events[i]:
                ev.record()


def launch_rows(*, layer_begin: int, layer_end: int, **kw) -> None:
    """One K-or-V gather/scatter over layers ``[layer_begin, layer_end)`` on the current stream (indices
    already validated, on the device of the tensors). See :func:`prepare_rows` for the arguments."""
    run_rows([prepare_rows(**kw)], layer_begin, layer_end, per_layer=False)


def layer_offsets(device_layers: Any, word: int) -> tuple[torch.Tensor, int]:
    """``(offsets, align)``: int64 offsets, in ``word``-byte units, of each layer tensor from the first one, on
    their device, and the largest power of two (≤ 1024) dividing all of them."""
    base = device_layers[0].data_ptr()
    offs = []
    for t in device_layers:
        delta = t.data_ptr() - base
        if delta % word:
            raise ValueError(f"device layer tensors are not {word}-byte aligned relative to each other")
        offs.append(delta // word)
    align = 1024
    for o in offs:
        align = min(align, _pow2_divisor(o, 1024) if o else 1024)
    return torch.tensor(offs, dtype=torch.int64).to(device_layers[0].device), align
