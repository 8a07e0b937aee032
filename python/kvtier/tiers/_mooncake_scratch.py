"""Scratch memory a :class:`~kvtier.tiers.mooncake.MooncakeTier` registers with its Mooncake client (record
buffers, read-back space for objects stored without a record, a sealed tier's copies), kept registered until
the tier closes."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from .._errors import KvtierError
from ..buffer import HostBuffer


class RegisteredScratch:
    """Scratch memory registered with Mooncake (``client``) and with the tier's range checks (``ranges``), kept
    (registered) until :meth:`close`: a batch may still use an older buffer."""

    def __init__(self, client: Any, ranges: Any) -> None:
        self.client, self.ranges = client, ranges
        self._buffers: list[HostBuffer] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._adopt: HostBuffer | None = None  # read-back space for objects stored without a record
        self._adopt_lock = threading.Lock()

    def buffer(self, nbytes: int, what: str) -> HostBuffer:
        """A new registered buffer of ``nbytes`` (``what``: its use, named in the error)."""
        buf = HostBuffer(nbytes, pin=False)
        with self._lock:
            self._buffers.append(buf)
        self.ranges.register_region(buf.region)
        if self.client.register_buffer(buf.ptr, buf.nbytes) != 0:
            raise KvtierError(f"MooncakeTier: registering the {what} buffer with Mooncake failed")
        return buf

    def records(self, nbytes: int) -> tuple[int, np.ndarray]:
        """This thread's record buffer of at least ``nbytes``: its address and a numpy view of it."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self.buffer(max(nbytes, 1 << 16), "record")
            self._local.buf = buf
        return buf.ptr, buf.as_tensor(torch.uint8, (buf.nbytes,)).numpy()

    def foreign_pages(self, k: int, held: list[int], names: list[str], ptrs: list[int], sizes: list[int]) -> set[int]:
        """Pages (indices; ``k`` objects each) among the objects ``held`` whose stored bytes differ from this
        writer's (or cannot be read back): read back into a scratch buffer and compared by checksum."""
        with self._adopt_lock:
            need = sum(sizes[j] for j in held)
            if self._adopt is None or self._adopt.nbytes < need:
                buf = HostBuffer(max(need, 1 << 20), pin=False)
                self._buffers.append(buf)
                self.ranges.register_region(buf.region)
                if self.client.register_buffer(buf.ptr, buf.nbytes) != 0:
                    return {j // k for j in held}
                self._adopt = buf
            dst, off = [], self._adopt.ptr
            for j in held:
                dst.append(off)
                off += sizes[j]
            hn, hs = [names[j] for j in held], [sizes[j] for j in held]
            got = self.client.batch_get_into(hn, dst, hs)
            stored = self.ranges.crc32c(hn, dst, hs)
        ours = self.ranges.crc32c(hn, [ptrs[j] for j in held], hs)
        return {j // k for j, g, a, b in zip(held, got, stored, ours) if g != sizes[j] or a != b}

    def close(self) -> None:
        """Closes every buffer (after the client that used them is closed)."""
        for buf in self._buffers:
            buf.close()
        self._buffers = []
