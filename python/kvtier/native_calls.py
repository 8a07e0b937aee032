"""The native store's page batches and staging copies called so that a thread the interpreter ends while it
waits for one ends in CPython's own code.

An engine's and kvtier's tier threads are daemon threads: while the interpreter finalizes, CPython ends any of
them that takes the GIL back. A thread taking it back inside the native module (a call returning after its IO)
ended with a forced unwind through the module's frames, which aborted the whole process. Off the main thread,
these calls therefore run on a thread of the native module's own (``submit_pages``, ``submit_copy_pages``) and
are waited for here, in ``os.read`` of the call's eventfd. The main thread, which finalization never ends,
calls the native store directly.

What this cannot cover: torch (and some numpy) calls release the GIL inside their C++ code, and a daemon thread
taking it back there while the interpreter exits aborts the process the same way (``std::terminate``). kvtier's
own tier threads hold no torch object, and the batches above turn an engine's index tensor into numpy once
(:func:`indices`); an engine's own torch calls on its daemon threads are the engine's. CPython 3.14 hangs such
threads instead of unwinding them (gh-87135)."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np


def indices(host_indices: Any) -> np.ndarray:
    """An engine's 1-D int64 index tensor as numpy. A contiguous CPU tensor is viewed in place, with no torch
    object made (``Tensor.numpy()`` makes one, and releasing it takes the GIL back inside torch); the view keeps
    the tensor alive."""
    if host_indices.device.type != "cpu" or not host_indices.is_contiguous():
        return host_indices.detach().cpu().numpy()
    n = host_indices.numel()
    if not n:
        return np.zeros(0, dtype=np.int64)
    raw = (ctypes.c_int64 * n).from_address(host_indices.data_ptr())
    raw.tensor = host_indices  # (the memory's owner lives as long as the view)
    return np.frombuffer(raw, dtype=np.int64)


def wait_native(pending: Any) -> Any:
    """The answer of a call started with ``submit_*``, once it has returned. An exception raised into the
    waiting thread (Ctrl-C on the main thread) is raised after the call returns: its pages are the call's
    until then."""
    fd, raised = pending.fileno(), None
    while True:
        try:
            os.read(fd, 8)
            break
        except BaseException as e:  # noqa: BLE001 (raised again once the call has returned)
            raised = e
            if pending.done():  # (raised after the read took the count: reading again would wait for ever)
                break
    if raised is not None:
        raise raised
    return pending.result()


def page_batch(store: Any, write: bool, keys: list[str], idx: Any, split: tuple[int, int, Any] | None,
               staged: bool) -> list[bool]:
    """``put_pages`` (``write``) or ``get_pages`` of the native store ``store``; per key, stored or found."""
    layers, first, gate = split or (0, 0, None)
    if threading.current_thread() is threading.main_thread():
        return store.put_pages(keys, idx, staged=staged) if write else store.get_pages(keys, idx, layers, first, gate,
                                                                                         staged=staged)
    if write:  # (a write is one pass, as put_pages takes it)
        layers, first, gate = 0, 0, None
    return wait_native(store.submit_pages(write, keys, idx, layers, first, gate, staged=staged))


def copy_pages(store: Any, to_pool: bool, host_indices: Any, staging_indices: Any) -> None:
    """``copy_pages`` of the native store ``store`` (staging pages to the pool, or back)."""
    if threading.current_thread() is threading.main_thread():
        store.copy_pages(to_pool, host_indices, staging_indices)
    else:
        wait_native(store.submit_copy_pages(to_pool, host_indices, staging_indices))
