"""kvtier's exception hierarchy. Every exception kvtier raises on purpose derives from :class:`KvtierError`;
the ones that refine a builtin also derive from it, so ``except ValueError`` and ``except OSError`` work."""

from __future__ import annotations

import errno as _errno


class KvtierError(Exception):
    """Base of every kvtier error."""


class InvalidArgumentError(KvtierError, ValueError):
    """An argument is out of its domain; the message names the argument."""


class ClosedError(KvtierError):
    """A handle (buffer, pool, store) was used after ``close()``."""


class HugePagesUnavailableError(KvtierError, OSError):
    """Huge pages were required (``huge_pages="required"``) but the system has none free."""


class CudaUnavailableError(KvtierError):
    """The CUDA driver is not present or failed to initialise."""


class CudaError(KvtierError, RuntimeError):
    """A CUDA driver call failed; the message has the call and its CUresult."""


_os_classes: dict[type, type] = {}


def _os_error(code: int, message: str) -> OSError:
    """An OSError of the builtin subclass for ``code`` (FileNotFoundError for ENOENT, …) that is also a
    KvtierError. ``e.errno`` is ``code``."""
    base = type(OSError(code, "")) if code else OSError
    cls = _os_classes.get(base)
    if cls is None:
        cls = type(f"Kvtier{base.__name__}", (KvtierError, base), {"__module__": __name__})
        _os_classes[base] = cls
    err: OSError = cls(code, message or _errno.errorcode.get(code, "OS error"))
    return err
