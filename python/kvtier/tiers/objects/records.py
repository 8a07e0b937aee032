"""A page's integrity record in an object store (its bytes, written and parsed), the check of a read against
it, and the keys served without one: what makes an object a tier can serve or a miss, never wrong bytes. The
record's format and its names are the cluster tier's (docs/CLUSTER.md, :mod:`kvtier.tiers.mooncake`); any
object tier may keep its pages so."""

from __future__ import annotations

import collections
import hashlib
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ... import _native
from ...tenants import tenant_of

MAGIC, VERSION = b"KVTM", 1
HEAD = struct.Struct("<4sHH8s")  # magic, version, objects, fingerprint (first 8 bytes of sha256)
OBJ = struct.Struct("<QI")  # size, crc32c(bytes + key)
TAIL = struct.Struct("<I")  # crc32c of everything before it (a torn record is refused)
SLOT = 64  # bytes per record in the scratch buffer (a sealed page's record: rounded up to whole slots)
SEAL = _native.SEAL_LEN  # a sealed object's nonce, tag and key id (kvtier.tenants; docs/SECURITY.md)
NO_KEY = "_kvtier-nokey"  # the record name of a sealed page whose tenant has no key: never written
UNVERIFIED_KEPT = 1 << 16  # page keys remembered exactly as served without a record (the rest: in a filter)
FILTER_BITS = 1 << 24  # the filter behind them: 2 MiB, under 0.5 % false positives at a million keys
TOO_SMALL = -600  # a read's result for an object larger than the buffer given for it (Mooncake's code)


def record_bytes(fp: bytes, objs: Sequence[tuple[int, int]], seals: bytes = b"") -> bytes:
    """A page's record: its objects' ``(size, crc)`` and, for sealed objects, their seals."""
    body = HEAD.pack(MAGIC, VERSION, len(objs), fp) + b"".join(OBJ.pack(n, c) for n, c in objs) + seals
    return body + TAIL.pack(_crc(body))


def record_size(nobj: int, sealed: bool) -> int:
    """Bytes of the record of a page of ``nobj`` objects (``sealed``: with their seals)."""
    return HEAD.size + nobj * (OBJ.size + (SEAL if sealed else 0)) + TAIL.size


def record_seals(raw: bytes, nobj: int) -> bytes:
    """The seals of a sealed record that :func:`parse_record` accepted."""
    return raw[HEAD.size + nobj * OBJ.size: HEAD.size + nobj * (OBJ.size + SEAL)]


def _crc(b: bytes) -> int:
    return zlib.crc32(b) & 0xFFFFFFFF


def parse_record(raw: bytes, fp: bytes, nobj: int, sealed: bool = False) -> list[tuple[int, int]] | None:
    """The record's ``(size, crc)`` per object, or None unless it is whole, of this version and of ``fp``."""
    want = record_size(nobj, sealed)
    if len(raw) != want or TAIL.unpack_from(raw, want - TAIL.size)[0] != _crc(raw[: want - TAIL.size]):
        return None
    magic, ver, n, got_fp = HEAD.unpack_from(raw, 0)
    if magic != MAGIC or ver != VERSION or n != nobj or got_fp != fp:
        return None
    return [OBJ.unpack_from(raw, HEAD.size + i * OBJ.size) for i in range(nobj)]


class Taint:
    """Keys served without an integrity record, remembered for the tier's life: the last ``exact`` exactly,
    every older one in a Bloom filter (never cleared). A key in neither was never added; a key added is always
    found, however many came after it — a false positive only keeps a verified page from being vouched for
    or filled into a durable tier (a later miss), never the other way round."""

    def __init__(self, exact: int = UNVERIFIED_KEPT, bits: int = FILTER_BITS) -> None:
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._exact, self._bits = exact, bits
        self._filter = bytearray(bits // 8)
        self.spilled = 0  # keys moved from the exact set into the filter

    def _positions(self, key: str) -> list[int]:
        d = hashlib.blake2b(key.encode(), digest_size=12).digest()
        return [int.from_bytes(d[i:i + 4], "little") % self._bits for i in (0, 4, 8)]

    def add(self, key: str) -> None:
        self._recent[key] = None
        self._recent.move_to_end(key)
        while len(self._recent) > self._exact:
            old, _ = self._recent.popitem(last=False)
            for p in self._positions(old):
                self._filter[p >> 3] |= 1 << (p & 7)
            self.spilled += 1

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str):
            return False
        if key in self._recent:
            return True
        return self.spilled > 0 and all(self._filter[p >> 3] >> (p & 7) & 1 for p in self._positions(key))


def check_read(m: Any, n_pages: int, res: Sequence[int], rview: np.ndarray, keys: Sequence[str], names: Sequence[str],
               ptrs: Sequence[int], sizes: Sequence[int], ranges: Any, seal: Any,
               accept_unverified: bool) -> tuple[list[int], list[int], list[int], int]:
    """Which pages of one read (``m``: the tier's :class:`~kvtier.tiers.objects.pages.PageObjects`; ``res``: the
    store's result per object — the bytes read, or a negative code (``TOO_SMALL``: larger than its buffer) —
    the records' first, then each page's data objects; ``rview``: the record buffer) arrived
    whole and match their records: ``(served, unverified, corrupt, stale)`` — the pages served, the pages served
    without a record (``accept_unverified``), the pages whose record vouches for bytes that are not there, and
    how many records were another geometry's, version's or torn. A sealed tier's (``seal``) pages are opened in
    place, and served only if every tag verifies."""
    k = len(m.sides)
    served: list[int] = []
    unverified: list[int] = []
    bad: list[int] = []
    stale = 0
    check: list[tuple[int, list[tuple[int, int]]]] = []
    seals: dict[int, bytes] = {}
    for i in range(n_pages):
        arrived = all(res[n_pages + i * k + s] == sizes[i * k + s] for s in range(k))
        rec = None
        if res[i] == m.rec_bytes:
            raw = rview[i * m.slot: i * m.slot + m.rec_bytes].tobytes()
            rec = parse_record(raw, m.fp, k, seal is not None)
            if rec is not None and seal is not None:
                seals[i] = record_seals(raw, k)
            if rec is None or any(rec[s][0] != sizes[i * k + s] for s in range(k)):
                stale += 1  # another geometry, dtype or version under this key, or a torn record
                continue
        elif res[i] > 0 or res[i] == TOO_SMALL:
            stale += 1  # a record of another size: not one of ours
            continue
        if not arrived:
            got = [res[n_pages + i * k + s] for s in range(k)]
            if rec is not None and any(g == TOO_SMALL or 0 < g != want for g, want in zip(got, sizes[i * k:(i + 1) * k])):
                bad.append(i)  # recorded, but an object came back truncated or extended
            continue
        if rec is None:
            if accept_unverified:  # data without a record: a stock SGLang page, served by option
                unverified.append(i)
            continue
        check.append((i, rec))
    if check:
        objs = [j for i, _ in check for j in range(i * k, (i + 1) * k)]
        crcs = ranges.crc32c([names[j] for j in objs], [ptrs[j] for j in objs], [sizes[j] for j in objs])
        good = [i for n, (i, rec) in enumerate(check) if all(crcs[n * k + s] == rec[s][1] for s in range(k))]
        if seal is not None and good:
            objs = [j for i in good for j in range(i * k, (i + 1) * k)]
            opened = seal.open([names[j] for j in objs], [ptrs[j] for j in objs], [sizes[j] for j in objs],
                               [tenant_of(keys[j // k]) for j in objs], b"".join(seals[i] for i in good))
            good = [i for n, i in enumerate(good) if all(opened[n * k:(n + 1) * k])]
        served = good
        kept = set(good)
        bad += [i for i, _ in check if i not in kept]
    return served, unverified, bad, stale
