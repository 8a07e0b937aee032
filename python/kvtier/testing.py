"""Fault injection into the page store's IO path, for tests and chaos runs of an engine integration.

The fault table is process-wide (every ``PageStore`` in the process sees it) and empty by default; while no
fault is armed an IO point costs one atomic load (while one is, each IO point takes a lock). Points: ``fallocate``, ``data_write``, ``data_sync``,
``data_read``, ``journal_write``, ``journal_sync``. Kinds:

- ``"error"``: the call fails with ``errno`` (``errno.ENOSPC`` for a full disk, ``errno.EIO``, ...);
- ``"delay"``: the call sleeps ``delay_ms`` first (a slow disk);
- ``"stall"``: the call blocks until :func:`clear_faults` (or at most ``delay_ms``; 0: ten minutes), then runs
  normally (a hung disk: a dead NFS server, a dying SSD, a throttle to zero);
- ``"short"`` (``data_write`` only): half the object is written, then the call fails with ``errno``;
- ``"torn"`` (``data_write`` only): half the object is written, followed by zeros, and the call reports
  success — the disk lied; only the checksum verified on every read can catch it.

A store turns each of these into failed writes (``write_failures``), failed or corrupt reads
(``read_failures``, ``corrupt_reads``) — misses an engine recomputes — and never into wrong bytes::

    with kvtier.testing.faults("data_read", "error", errno=errno.EIO, times=None):
        ...  # every read fails; requests fall back to recomputation
"""

from __future__ import annotations

import contextlib
import errno as _errno
from collections.abc import Iterator

from . import _native
from ._errors import InvalidArgumentError

POINTS = tuple(_native.fault_points())
KINDS = ("error", "delay", "stall", "short", "torn")


def inject_fault(point: str, kind: str = "error", *, errno: int = _errno.EIO, skip: int = 0,
                 times: int | None = 1, delay_ms: int = 0) -> None:
    """Hit the next ``times`` calls of ``point`` (every call from then on with ``times=None``) after letting
    ``skip`` through. Replaces what was injected at ``point`` before."""
    for name, v in (("skip", skip), ("times", times), ("delay_ms", delay_ms)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise InvalidArgumentError(f"invalid argument `{name}`: must be a non-negative int, got {v!r}")
    _native.fault_set(point, kind, skip, (1 << 64) - 1 if times is None else times, errno, delay_ms)


def clear_faults() -> None:
    """Remove every injected fault and release every IO call stalled by a ``"stall"``."""
    _native.fault_clear()


def fault_hits(point: str) -> int:
    """How many faults ``point`` has delivered since it was last injected."""
    return _native.fault_hits(point)


@contextlib.contextmanager
def faults(point: str, kind: str = "error", **kw) -> Iterator[None]:
    """``inject_fault`` for the body of a ``with`` block; every fault is cleared on exit."""
    inject_fault(point, kind, **kw)
    try:
        yield
    finally:
        clear_faults()
