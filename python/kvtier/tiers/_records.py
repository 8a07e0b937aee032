"""The cluster tier's integrity record (its bytes, written and parsed) and the checks of its options; see
docs/CLUSTER.md and :mod:`kvtier.tiers.mooncake`."""

from __future__ import annotations

import collections
import hashlib
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _native
from .._errors import InvalidArgumentError
from ..tenants import tenant_of

PROTOCOLS = ("tcp", "rdma")
MAGIC, VERSION = b"KVTM", 1
HEAD = struct.Struct("<4sHH8s")  # magic, version, objects, fingerprint (first 8 bytes of sha256)
OBJ = struct.Struct("<QI")  # size, crc32c(bytes + key)
TAIL = struct.Struct("<I")  # crc32c of everything before it (a torn record is refused)
SLOT = 64  # bytes per record in the scratch buffer (a sealed page's record: rounded up to whole slots)
SEAL = _native.SEAL_LEN  # a sealed object's nonce, tag and key id (kvtier.tenants; docs/SECURITY.md)
NO_KEY = "_kvtier-nokey"  # the record name of a sealed page whose tenant has no key: never written
UNVERIFIED_KEPT = 1 << 16  # page keys remembered exactly as served without a record (the rest: in a filter)
FILTER_BITS = 1 << 24  # the filter behind them: 2 MiB, under 0.5 % false positives at a million keys
TOO_SMALL = -600  # Mooncake: the object is larger than the buffer given for it


def record_bytes(fp: bytes, objs: Sequence[tuple[int, int]], seals: bytes = b"") -> bytes:
    """A page's record: its objects' ``(size, crc)`` and, for sealed objects, their seals."""
    body = HEAD.pack(MAGIC, VERSION, len(objs), fp) + b"".join(OBJ.pack(n, c) for n, c in objs) + seals
    return body + TAIL.pack(_crc(body))


def record_size(nobj: int, sealed: bool) -> int:
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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(name: str, v: Any, lo: int) -> int:
    if not _is_int(v) or v < lo:
        raise InvalidArgumentError(f"invalid argument `{name}`: must be an int >= {lo}, got {v!r}")
    return int(v)



def validate_options(*, master_server_address: Any, model_name: Any = "default", key_tag: Any = None,
                     tp_rank: Any = 0, tp_size: Any = 1, pp_rank: Any = 0, pp_size: Any = 1, cp_rank: Any = 0,
                     cp_size: Any = 1, dcp_size: Any = 1, protocol: Any = "tcp", device_name: Any = "",
                     local_hostname: Any = "127.0.0.1", metadata_server: Any = "P2PHANDSHAKE",
                     global_segment_size: Any = 0, local_buffer_size: Any = 16 << 20, replica_num: Any = 1,
                     accept_unverified: Any = False, setup_timeout_s: Any = 30.0, tenant: Any = None) -> None:
    """Every option checked without connecting (what construction checks first; SGLang's extra config is
    checked with it before anything opens). Raises InvalidArgumentError naming the option."""
    if not isinstance(master_server_address, str) or ":" not in master_server_address:
        raise InvalidArgumentError(f"invalid argument `master_server_address`: expected 'host:port', got "
                                   f"{master_server_address!r}")
    host, _, port = master_server_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"invalid argument `master_server_address`: bad host or port in "
                                   f"{master_server_address!r}")
    if not isinstance(model_name, str) or not model_name:
        raise InvalidArgumentError(f"invalid argument `model_name`: a non-empty str names the keys (pages of "
                                   f"different models must never share them), got {model_name!r}")
    if key_tag is not None and (not isinstance(key_tag, str) or not key_tag):
        raise InvalidArgumentError(f"invalid argument `key_tag`: a non-empty str or None, got {key_tag!r}")
    if protocol not in PROTOCOLS:
        raise InvalidArgumentError(f"invalid argument `protocol`: {protocol!r}; expected one of {PROTOCOLS}")
    for name, v in (("device_name", device_name), ("local_hostname", local_hostname),
                    ("metadata_server", metadata_server)):
        if not isinstance(v, str):
            raise InvalidArgumentError(f"invalid argument `{name}`: expected a str, got {v!r}")
    if protocol == "rdma" and not device_name:
        raise InvalidArgumentError("invalid argument `device_name`: protocol 'rdma' needs the RDMA devices "
                                   "(e.g. 'mlx5_0')")
    for name, rank, size in (("tp", tp_rank, tp_size), ("pp", pp_rank, pp_size), ("cp", cp_rank, cp_size)):
        if not (_is_int(size) and size >= 1 and _is_int(rank) and 0 <= rank < size):
            raise InvalidArgumentError(f"invalid argument `{name}_rank`: {rank!r} is not in [0, {name}_size={size!r})")
    if dcp_size != 1:
        raise InvalidArgumentError(f"invalid argument `dcp_size`: {dcp_size!r}; decode context parallelism is not "
                                   "supported by the cluster tier (SGLang 0.5.23 sends it to its file and "
                                   "mooncake backends only)")
    _int("global_segment_size", global_segment_size, 0)
    _int("local_buffer_size", local_buffer_size, 0)
    _int("replica_num", replica_num, 1)
    if isinstance(setup_timeout_s, bool) or not isinstance(setup_timeout_s, (int, float)) or not setup_timeout_s > 0:
        raise InvalidArgumentError(
            f"invalid argument `setup_timeout_s`: must be a number of seconds > 0, got {setup_timeout_s!r}")
    if not isinstance(accept_unverified, bool):
        raise InvalidArgumentError(f"invalid argument `accept_unverified`: expected true or false, got "
                                   f"{accept_unverified!r}")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise InvalidArgumentError(f"invalid argument `tenant`: a non-empty salt string or None, got {tenant!r}")


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
    """Which pages of one read (``m``: the tier's :class:`~kvtier.tiers._mooncake_pages.PageObjects`; ``res``:
    Mooncake's results, the records' first, then each page's data objects; ``rview``: the record buffer) arrived
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
