"""An object tier's encryption at rest (docs/SECURITY.md): a page's data objects are copied into the tier's
scratch memory and sealed there (AES-256-GCM, the tenant's key; associated data: the page geometry's
fingerprint and the object's full name) before the store sends them; their seals travel in the page's
integrity record (:mod:`kvtier.tiers.objects.records`); a read lands in the host pool and is opened in place
once its record and checksums match. The host pool itself stays in clear.

Every object is named by the keyring's keyed name of its page key (:meth:`kvtier.Keyring.stored_names`), and
sealed under its tenant's stored tag, so the store's object names show no engine key and no tenant tag to
whoever holds the store but not the keyring."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ...buffer import HostBuffer
from ...tenants import tenant_of
from .records import NO_KEY, SEAL


class SealedCopies:
    """Per-thread scratch a sealed object tier (such as :class:`~kvtier.tiers.mooncake.MooncakeTier`) seals its
    puts into, and the names its objects are stored under. ``tier`` gives ``page_objects`` (its
    :class:`~kvtier.tiers.objects.pages.PageObjects`), ``ranges`` (its registered host memory) and
    ``registered_buffer(nbytes, what)`` (scratch memory inside those ranges)."""

    def __init__(self, tier: Any, keyring: Any) -> None:
        self._tier = tier
        self.keyring = keyring
        self._local = threading.local()

    def stored(self, keys: Sequence[str]) -> list[str]:
        """The keyed name each page key is stored under (a tenant's carries the tenant's stored tag)."""
        names: list[str] = self.keyring.stored_names(keys)
        return names

    def record_names(self, base: Any, skeys: Sequence[str], create: bool) -> list[str]:
        """The record name of each stored page key: ``..._kvtier-<key id>``, the id of the tenant's current key,
        so a page sealed under a key since destroyed has no record (a miss, rewritten by the next put); a
        tenant without a key (never made, or erased) gets a name ending in ``NO_KEY`` that is never written."""
        tags = [tenant_of(x) for x in skeys]
        ids = dict(zip(set(tags), self.keyring.native.key_ids(list(set(tags)), create)))
        return [f"{base(x)}_kvtier-{ids[t]}" if ids[t] is not None else f"{base(x)}{NO_KEY}"
                for x, t in zip(skeys, tags)]

    def _aad(self, names: Sequence[str]) -> list[str]:
        """What each object's seal authenticates: the fingerprint of the page geometry, then its name (an
        object sealed under one geometry never opens under another, whatever record is paired with it)."""
        fp = self._tier.page_objects.aad
        return [f"{fp}\0{n}" for n in names]

    def _buffer(self, need: int) -> HostBuffer:
        buf: HostBuffer | None = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < need:
            buf = self._tier.registered_buffer(max(need, 1 << 20), "sealing")
            self._local.buf = buf
        return buf

    def seal(self, names: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
             tenants: Sequence[str | None]) -> tuple[list[int], bytes, list[bool]]:
        """Sealed copies of the objects (``tenants``: each one's stored tenant tag, or None): their addresses in
        this thread's scratch, their seals (``SEAL`` bytes each, concatenated) and per object whether it was
        sealed."""
        buf = self._buffer(sum(sizes))
        dst, off = [], buf.ptr
        for n in sizes:
            dst.append(off)
            off += n
        seals, ok = self.keyring.native.seal_into(self._tier.ranges, list(zip(self._aad(names), ptrs, sizes, tenants)),
                                                  dst)
        return dst, bytes(seals), list(ok)

    def open(self, names: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], tenants: Sequence[str | None],
             seals: bytes) -> list[bool]:
        """Opens objects read into the host pool, in place; per object whether its tag verified."""
        assert len(seals) == SEAL * len(names)
        return list(self.keyring.native.open_in_place(self._tier.ranges,
                                                       list(zip(self._aad(names), ptrs, sizes, tenants)), seals))
