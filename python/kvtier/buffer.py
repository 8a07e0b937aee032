"""``HostBuffer``: aligned, pre-faulted, optionally pinned host memory owned by the Rust core.

The memory is one anonymous mapping (``kvtier._native.HostRegion``). Torch tensors made with
:meth:`HostBuffer.as_tensor` view it without a copy and keep it alive: ``close()`` drops the handle's
reference, and the memory is unregistered from CUDA and unmapped when the last view is gone. A closed handle
raises :class:`kvtier.ClosedError` on any use.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

from . import _native, config
from ._errors import CudaUnavailableError, InvalidArgumentError

#: whether a buffer that could not be pinned was logged (once a process)
_said_unpinned = False

if TYPE_CHECKING:
    import torch


def cuda_device_available() -> bool:
    """True when torch is importable and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class HostBuffer:
    """Aligned host memory for KV pages.

    Args:
        nbytes: size in bytes (rounded up to whole pages).
        alignment: base alignment, a power of two >= 4096 (the O_DIRECT alignment).
        huge_pages: ``"auto"`` (explicit huge pages if the system has them, else transparent huge pages,
            else base pages; the fallback is reported in :attr:`huge_page_fallback`), ``"transparent"``,
            ``"off"``, or ``"required"`` (explicit huge pages or :class:`HugePagesUnavailableError`).
        prefault_threads: threads that touch every page up front (GIL released); ``None`` picks one per
            256 MiB up to the core count, ``0`` skips pre-faulting.
        pin: ``"auto"`` registers the memory with the CUDA driver when torch sees a CUDA device (so tensors
            report ``is_pinned()`` and ``non_blocking`` copies are real DMA); ``True`` requires it; ``False``
            never pins. Default from ``KVTIER_PIN``.
        pin_granularity: bytes of one KV page; registration chunks never split one (default 4096).
        register_chunk_bytes: largest single registration (default ``KVTIER_REGISTER_CHUNK_GB``, 64 GiB).
        device: CUDA device ordinal to register with (default: torch's current device).
    """

    def __init__(
        self,
        nbytes: int,
        *,
        alignment: int = 4096,
        huge_pages: str = "auto",
        prefault_threads: int | None = None,
        pin: bool | str | None = None,
        pin_granularity: int | None = None,
        register_chunk_bytes: int | None = None,
        device: int | None = None,
    ) -> None:
        for name, value in (("nbytes", nbytes), ("alignment", alignment)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"invalid argument `{name}`: must be an int, got {type(value).__name__}")
            if not 0 <= value < 1 << 63:
                raise InvalidArgumentError(f"invalid argument `{name}`: {value} is outside [0, 2**63)")
        if pin is None:
            default = config.pin_default()
            pin = "auto" if default == "auto" else default == "1"
        if pin not in ("auto", True, False):
            raise InvalidArgumentError(f"invalid argument `pin`: must be 'auto', True or False, got {pin!r}")
        # large buffers take seconds to pre-fault and pin: a progress bar on a terminal (KVTIER_PROGRESS)
        self._progress = _native.Progress() if config.progress(nbytes) else None
        self._region: _native.HostRegion = self._with_progress(
            lambda: _native.HostRegion(nbytes, alignment, huge_pages, prefault_threads, self._progress),
            "allocating (MiB)")
        self._requested = nbytes
        self._pin_error: str | None = None
        want = pin is True or (pin == "auto" and cuda_device_available())
        if want:
            try:
                self._pin(pin_granularity, register_chunk_bytes, device)
            except Exception as exc:
                if pin is True:
                    self._region.close()
                    raise
                self._pin_error = str(exc)
                # (torch sees a GPU: the copies this memory was made for now take torch's slow path); said once
                # a process: every later buffer that cannot be pinned has its reason in pin_error
                global _said_unpinned
                if not _said_unpinned:
                    _said_unpinned = True
                    logging.getLogger(__name__).warning(
                        "kvtier: %d bytes of host memory could not be pinned (%s); CUDA copies of it take the slow "
                        "path (HostBuffer(pin=True) raises instead; later buffers are not logged, their pin_error "
                        "says why; docs/OPERATIONS.md, Pinned memory in containers)", nbytes, self._pin_error)

    def _pin(self, granularity: int | None, chunk: int | None, device: int | None) -> None:
        if not _native.cuda_driver_available():
            raise CudaUnavailableError("the CUDA driver (libcuda.so.1) is not available")
        granularity = 4096 if granularity is None else granularity
        if granularity <= 0:
            raise InvalidArgumentError(f"invalid argument `pin_granularity`: must be positive, got {granularity}")
        chunk = config.register_chunk_bytes() if chunk is None else chunk
        if chunk < granularity:
            # One page larger than the chunk limit: register whole pages one at a time.
            chunk = granularity
        if device is None:
            import torch

            device = torch.cuda.current_device()
        region, threads, progress = self._region, config.register_threads(), self._progress
        self._with_progress(lambda: region.register_cuda(device, granularity, chunk, threads, progress),
                            "pinning (MiB)")

    def _with_progress(self, work: Any, label: str) -> Any:
        """``work()``, with a progress bar in MiB when this buffer shows progress."""
        if self._progress is None:
            return work()
        from ._progress import run_with_progress

        progress = self._progress

        def mib() -> tuple[int, int]:
            done, total = progress.get()
            return done >> 20, total >> 20

        return run_with_progress(work, mib, label, force=True)  # KVTIER_PROGRESS decided already

    # -- properties -------------------------------------------------------------------------------------
    @property
    def region(self) -> _native.HostRegion:
        """The native region this buffer owns: what the core's store, cluster and sealing calls take."""
        return self._region

    @property
    def ptr(self) -> int:
        """Base address (aligned to :attr:`alignment`)."""
        return self._region.ptr

    @property
    def nbytes(self) -> int:
        """Usable size: the request rounded up to whole (huge) pages."""
        return self._region.nbytes

    @property
    def alignment(self) -> int:
        return self._region.alignment

    @property
    def page_kind(self) -> str:
        """``"explicit"``, ``"transparent"`` or ``"base"``: the pages actually obtained."""
        return self._region.page_kind

    @property
    def huge_page_fallback(self) -> str | None:
        """Why fewer huge pages than requested were used (``None`` when nothing fell back)."""
        return self._region.fallback

    @property
    def pinned(self) -> bool:
        """True when the memory is registered with the CUDA driver."""
        return bool(self._region.registered_chunks())

    @property
    def pin_error(self) -> str | None:
        """Why ``pin="auto"`` could not pin (``None`` when pinned or not attempted)."""
        return self._pin_error

    @property
    def registered_chunks(self) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` of each CUDA registration."""
        return self._region.registered_chunks()

    @property
    def closed(self) -> bool:
        return self._region.closed

    # -- views ------------------------------------------------------------------------------------------
    def as_tensor(self, dtype: torch.dtype | None = None, shape: Sequence[int] | None = None, offset: int = 0) -> torch.Tensor:
        """A CPU tensor of ``dtype`` and ``shape`` over the bytes starting at ``offset`` (no copy). The
        tensor keeps the memory alive after this handle is closed. ``shape=None`` covers the rest of the
        buffer as 1-D."""
        import torch
        from torch.utils.dlpack import from_dlpack

        dtype = torch.uint8 if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"invalid argument `dtype`: expected a torch.dtype, got {dtype!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset % itemsize:
            raise InvalidArgumentError(
                f"invalid argument `offset`: must be a non-negative multiple of {itemsize}, got {offset!r}"
            )
        total = self.nbytes
        if shape is None:
            shape = ((total - offset) // itemsize,)
        shape = tuple(shape)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape):
            raise InvalidArgumentError(f"invalid argument `shape`: dimensions must be non-negative ints, got {shape}")
        nbytes = math.prod(shape) * itemsize
        if offset + nbytes > total:
            raise InvalidArgumentError(
                f"invalid argument `shape`: {shape} of {dtype} needs {nbytes} bytes at offset {offset}, "
                f"buffer has {total}"
            )
        flat = from_dlpack(self._region.dlpack(offset, nbytes))
        return flat.view(dtype).view(shape)

    # -- lifetime ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release this handle. Idempotent. Memory is freed (and unpinned) once no tensor views it."""
        self._region.close()

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "HostBuffer(closed)"
        return (
            f"HostBuffer(nbytes={self.nbytes}, ptr={self.ptr:#x}, alignment={self.alignment}, "
            f"pages={self.page_kind!r}, pinned={self.pinned})"
        )
