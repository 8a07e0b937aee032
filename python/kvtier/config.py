"""The one place kvtier reads environment variables. Each has a documented default (docs/API.md,
*Tuning*); the rest of the package takes these values as arguments."""

from __future__ import annotations

import os
import re

from ._errors import InvalidArgumentError

GiB = 1 << 30


def _int_env(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise InvalidArgumentError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def register_chunk_bytes() -> int:
    """Largest single CUDA host registration: ``KVTIER_REGISTER_CHUNK_GB`` GiB (default and maximum 64).

    Chunk boundaries never split a KV page, but a single copy that spans two registrations fails with
    "invalid argument" (measured on the H200 with torch's ``copy_`` of a 2 GiB range over 1 GiB chunks), so
    the default registers buffers up to 64 GiB in one piece. Smaller chunks pin faster (several threads) and
    are safe for kvtier's own page-granular transfers, not for arbitrary whole-buffer copies."""
    return min(_int_env("KVTIER_REGISTER_CHUNK_GB", 64, 1), 64) * GiB


def register_threads() -> int:
    """Threads that register (pin) a buffer's chunks: ``KVTIER_REGISTER_THREADS`` (default 8)."""
    return _int_env("KVTIER_REGISTER_THREADS", 8, 1)


def pin_default() -> str:
    """``KVTIER_PIN``: ``auto`` (pin when torch sees a CUDA device; default), ``1`` (always), ``0`` (never)."""
    raw = os.environ.get("KVTIER_PIN", "auto").strip().lower()
    if raw not in ("auto", "0", "1"):
        raise InvalidArgumentError(f"environment variable KVTIER_PIN={raw!r} must be 'auto', '0' or '1'")
    return raw


def kernel_blocks() -> int:
    """Thread blocks of the ``kernel`` IO backend: ``KVTIER_KERNEL_BLOCKS`` (default 16 of the H200's 132
    SMs; the block sweep in benches/RESULTS.md measured per-layer loads at 75% of the PCIe ceiling with 8
    blocks and 90% with 16)."""
    return _int_env("KVTIER_KERNEL_BLOCKS", 16, 1)


def kernel_warps() -> int:
    """Warps per block of the ``kernel`` IO backend: ``KVTIER_KERNEL_WARPS`` (default 8: with 2,048-word tiles
    the same throughput as 16 warps with 4,096, and compute kernels beside it fared better — overlap 1.10x
    against 1.17x with compute at ~60 % of the transfer; see kvtier.transfer.KERNEL_TILE_WORDS)."""
    return _int_env("KVTIER_KERNEL_WARPS", 8, 1)


def direct_batch() -> bool:
    """``KVTIER_DIRECT_BATCH`` (default 1): submit ``direct`` copies with ``cuMemcpyBatchAsync``; 0 issues
    one ``cuMemcpyAsync`` per chunk (slower: host-bound)."""
    return _int_env("KVTIER_DIRECT_BATCH", 1, 0) != 0


def direct_kernel_below() -> int:
    """``KVTIER_DIRECT_KERNEL_BELOW_KB`` (default 32): a ``direct`` transfer on CUDA whose (page, layer) chunk
    is smaller than this many KiB runs as ``kernel`` copies (the copy engine costs about a microsecond per
    chunk: 16-24 KiB chunks reached 9-40 % of the ceiling, the kernel 85-88 %); 0 keeps every ``direct``
    transfer on the copy engine. Returns bytes."""
    return _int_env("KVTIER_DIRECT_KERNEL_BELOW_KB", 32, 0) << 10


def direct_backup() -> str:
    """``KVTIER_DIRECT_BACKUP``: how the ``direct`` backend backs up pools of at least 4 ×
    ``KVTIER_STAGING_MB``. ``staged`` (default): a kernel gathers whole pages into device staging buffers
    and the copy engine writes them to the host one page (all layers) per copy; ``dma``: one copy-engine
    copy per (page, layer) chunk."""
    raw = os.environ.get("KVTIER_DIRECT_BACKUP", "staged").strip().lower()
    if raw not in ("staged", "dma"):
        raise InvalidArgumentError(f"environment variable KVTIER_DIRECT_BACKUP={raw!r} must be 'staged' or 'dma'")
    return raw


def kernel_backup() -> str:
    """``KVTIER_KERNEL_BACKUP``: how the ``kernel`` backend backs up ``page_first`` pools. ``staged`` (default):
    backups of at least four staging buffers' worth (256 MiB by default) are gathered page by page into a
    device staging buffer by the kernel and moved to the host as whole pages by the copy engine, overlapped;
    smaller ones, and all of them with ``direct``, are written to host memory by the kernel itself. SM writes
    to host memory travel as 128-byte PCIe writes, which caps them at ~94 % of the copy engine's rate, while
    each staged run costs fixed host and launch time that small backups cannot amortise (benches/RESULTS.md)."""
    raw = os.environ.get("KVTIER_KERNEL_BACKUP", "staged").strip().lower()
    if raw not in ("staged", "direct"):
        raise InvalidArgumentError(f"environment variable KVTIER_KERNEL_BACKUP={raw!r} must be 'staged' or 'direct'")
    return raw


def staging_bytes() -> int:
    """``KVTIER_STAGING_MB`` (default 64): size of each of the two device staging buffers a ``kernel`` backup
    alternates between (allocated on first use, per host pool and device; at least one page)."""
    return _int_env("KVTIER_STAGING_MB", 64, 1) << 20


def transfer_lanes() -> int:
    """``KVTIER_TRANSFER_LANES`` (default 2): CUDA streams a ``kernel`` transfer spreads its K and V launches
    over (the caller's stream plus a side stream that forks from it and joins back), so K and V move
    concurrently, sharing ``KVTIER_KERNEL_BLOCKS``; 1 keeps everything on the caller's stream. ``direct``
    copies always use one stream (two measured slower)."""
    return min(_int_env("KVTIER_TRANSFER_LANES", 2, 1), 2)


def progress(nbytes: int) -> bool:
    """``KVTIER_PROGRESS``: whether a host buffer of ``nbytes`` shows a progress bar on stderr while it is
    pre-faulted and pinned. ``auto`` (default): from 4 GiB when stderr is a terminal (the bar appears only
    after a second); ``1``: always from 4 GiB; ``0``: never."""
    import sys

    raw = os.environ.get("KVTIER_PROGRESS", "auto").strip().lower()
    if raw not in ("auto", "0", "1"):
        raise InvalidArgumentError(f"environment variable KVTIER_PROGRESS={raw!r} must be 'auto', '0' or '1'")
    if raw == "0" or nbytes < (4 << 30):
        return False
    return raw == "1" or sys.stderr.isatty()


#: Largest size kvtier takes (bytes): what the core's 64-bit offsets hold.
MAX_SIZE = (1 << 63) - 1
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def parse_size(name: str, value: object, minimum: int = 0) -> int:
    """A size in bytes from an int or a string with a binary unit (``"64G"``, ``"512GiB"``, ``"1.5T"``,
    ``"4096"``; K, M, G, T, P are powers of 1024, with or without ``i``/``B``). Raises InvalidArgumentError
    naming ``name`` for anything else, below ``minimum`` or past 2**63 - 1."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"invalid argument `{name}`: a size in bytes (an int, or a string like '64G'), "
                                   f"got {value!r}")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmgtp]?)(?:i?b)?\s*", value.replace("_", ""),
                         flags=re.IGNORECASE | re.ASCII)
        if m is None:
            raise InvalidArgumentError(f"invalid argument `{name}`: {value!r} is not a size (bytes, or a number with "
                                       "K, M, G, T or P, e.g. '64G')")
        num, unit = m.group(1), m.group(2).lower()
        if num.isdigit():  # whole numbers exactly (a float would round past 2**53)
            value = int(num) * _UNITS[unit]
        else:
            size = float(num) * _UNITS[unit]
            if size in (float("inf"), float("-inf")) or size != int(size):
                raise InvalidArgumentError(f"invalid argument `{name}`: {value!r} is not a whole number of bytes")
            value = int(size)
    if not isinstance(value, int):
        raise InvalidArgumentError(f"invalid argument `{name}`: a size in bytes (an int, or a string like '64G'), got "
                                   f"{type(value).__name__}")
    if value < minimum or value > MAX_SIZE:
        digits = str(abs(value))
        shown = value if len(digits) <= 24 else f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:4]}e{len(digits) - 1}"
        raise InvalidArgumentError(f"invalid argument `{name}`: {shown} is outside [{minimum}, 2**63 - 1]")
    return value


def check_ints(**values: tuple[object, int]) -> None:
    """Each ``name=(value, minimum)``: an int (not a bool) of at least ``minimum``, or InvalidArgumentError
    naming the argument."""
    for name, (value, minimum) in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InvalidArgumentError(f"invalid argument `{name}`: must be an int >= {minimum}, got {value!r}")


def check_ranks(**ranks: tuple[object, object]) -> None:
    """Each ``name=(rank, size)``: ``size`` an int >= 1 and ``rank`` in ``[0, size)``; InvalidArgumentError
    naming ``<name>_rank`` otherwise."""
    for name, (rank, size) in ranks.items():
        if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
            raise InvalidArgumentError(f"invalid argument `{name}_rank`: {rank!r} is not in [0, {name}_size={size!r})")
