"""The cluster tier's encryption at rest (docs/SECURITY.md): a page's data objects are copied into registered
scratch memory and sealed there (AES-256-GCM, the tenant's key, the object's full key as associated data)
before Mooncake sends them; their seals travel in the page's integrity record; a read lands in the host pool
and is opened in place once its record and checksums match. The host pool itself stays in clear."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..buffer import HostBuffer
from ._records import SEAL


class SealedCopies:
    """Per-thread scratch a sealed :class:`~kvtier.tiers.mooncake.MooncakeTier` seals its puts into."""

    def __init__(self, tier: Any, keyring: Any) -> None:
        self._tier = tier
        self.keyring = keyring
        self._local = threading.local()

    def _buffer(self, need: int) -> HostBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < need:
            buf = self._tier.registered_buffer(max(need, 1 << 20), "sealing")
            self._local.buf = buf
        return buf

    def seal(self, names: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
             tenants: Sequence[str | None]) -> tuple[list[int], bytes, list[bool]]:
        """Sealed copies of the objects (``tenants``: each one's tenant tag, or None): their addresses in this
        thread's scratch, their seals (``SEAL`` bytes each, concatenated) and per object whether it was sealed."""
        buf = self._buffer(sum(sizes))
        dst, off = [], buf.ptr
        for n in sizes:
            dst.append(off)
            off += n
        seals, ok = self.keyring.native.seal_into(self._tier.ranges, list(zip(names, ptrs, sizes, tenants)), dst)
        return dst, bytes(seals), list(ok)

    def open(self, names: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], tenants: Sequence[str | None],
             seals: bytes) -> list[bool]:
        """Opens objects read into the host pool, in place; per object whether its tag verified."""
        assert len(seals) == SEAL * len(names)
        return list(self.keyring.native.open_in_place(self._tier.ranges, list(zip(names, ptrs, sizes, tenants)),
                                                       seals))
