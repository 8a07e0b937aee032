"""``MooncakeTier``: KV pages in a Mooncake Store cluster shared by many inference nodes, with kvtier's integrity
on top (``pip install 'kvtier[mooncake]'``; design and fault table: docs/CLUSTER.md).

Data objects are SGLang's: one K and one V object per page (one object for MLA) under SGLang's Mooncake keys
``{prefix}_{page hash}_{rank suffix}_k`` / ``_v``, byte for byte the pool's page, so a page written by a stock
SGLang node (``--hicache-storage-backend mooncake``) and one written by kvtier are the same objects.

Integrity: beside each page kvtier writes a small **integrity record** ``{...}_{rank suffix}_kvtier`` *after* the
data: the geometry fingerprint (model, dtype, layout, page size, layers, heads and dims, object sizes) and a
crc32c of each data object bound to its key. A page is present only when its record and its data objects all
exist, and is served only when the record matches this reader's fingerprint and every object read back has
the recorded size and checksum — otherwise it is a miss. A torn, stale, swapped, re-sized or missing object
is a miss, never wrong bytes. Pages a stock SGLang node wrote have no record: they are misses unless
``accept_unverified=True`` (then served on size alone, and counted).

A Mooncake acknowledgement is not durability (it reports success for a re-put of a key it does not store,
and loses objects when a storage process dies); the durable copy is the local :class:`kvtier.PageStore`
before this tier in a :class:`kvtier.tiers.TieredStore`.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .. import _native
from .._errors import ClosedError, InvalidArgumentError, KvtierError
from ..buffer import HostBuffer
from ..planner import TierEstimate, TierMeter
from ..store import PAGE_LAYOUTS, _heads, _keys, _page_layout, logical_dtype
from ._mooncake_env import connect
from ..tenants import erase_tag, open_keyring, scope_keys, tenant_of
from ._mooncake_seal import SealedCopies
from ._records import (NO_KEY, SEAL, SLOT, TOO_SMALL, Taint, parse_record, record_bytes, record_seals, record_size,
                       validate_options)

class MooncakeTier:
    """See the module docs. Same batch interface as :class:`kvtier.PageStore`.

    Args:
        master_server_address: the Mooncake master, ``host:port``.
        model_name: names the keys as SGLang does (``/`` becomes ``-``); with ``key_tag`` (SGLang's
            ``extra_backend_tag``) it forms the key prefix.
        tp_rank, tp_size, pp_rank, pp_size: the rank suffix of the keys (SGLang's); an MLA pool's pages are
            shared by all TP ranks.
        protocol: ``"tcp"`` or ``"rdma"``; device_name: RDMA devices (``""`` for TCP).
        local_hostname: this node's address as the other nodes reach it.
        metadata_server: ``"P2PHANDSHAKE"`` (no metadata server) or a Mooncake metadata URL.
        global_segment_size: memory this process contributes to the cluster (0: a pure client).
        local_buffer_size: Mooncake's local buffer (the zero-copy path does not need it).
        replica_num: copies of each object in the cluster.
        accept_unverified: serve pages without a kvtier integrity record (written by stock SGLang nodes)
            on their size alone. Default False: they are misses.
        keyring: seal every data object (AES-256-GCM, a key per tenant; docs/SECURITY.md) with this
            :class:`kvtier.Keyring` or keyring directory. Sealed pages live under their own key prefix
            (``kvtier-sealed-<keyring id>_...``), never SGLang's clear objects. ``None``: in clear.
        tenant: a per-deployment tenant salt, as :class:`kvtier.PageStore`'s.
        kv_cache_dtype: as :class:`kvtier.PageStore` (fp8 caches held as ``uint8``).
        setup_timeout_s: how long construction may wait for the master.
    """

    #: the tier's name in plans and measurements
    name = "mooncake"

    def __init__(self, master_server_address: str, *, model_name: str, key_tag: str | None = None,
                 tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1, cp_rank: int = 0,
                 cp_size: int = 1, dcp_size: int = 1, protocol: str = "tcp", device_name: str = "",
                 local_hostname: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE",
                 global_segment_size: int = 0, local_buffer_size: int = 16 << 20, replica_num: int = 1,
                 accept_unverified: bool = False, kv_cache_dtype: str | None = None,
                 setup_timeout_s: float = 30.0, keyring: Any = None, tenant: str | None = None) -> None:
        self.validate_options(master_server_address=master_server_address, model_name=model_name,
                              key_tag=key_tag, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                              cp_rank=cp_rank, cp_size=cp_size, dcp_size=dcp_size, protocol=protocol,
                              device_name=device_name, local_hostname=local_hostname,
                              metadata_server=metadata_server, global_segment_size=global_segment_size,
                              local_buffer_size=local_buffer_size, replica_num=replica_num,
                              accept_unverified=accept_unverified, setup_timeout_s=setup_timeout_s, tenant=tenant)
        self.keyring = open_keyring(keyring)
        if self.keyring is not None and accept_unverified:
            raise InvalidArgumentError("invalid argument `accept_unverified`: a sealed tier (`keyring`) never serves "
                                       "a page without its integrity record: its bytes are ciphertext")
        self.tenant = tenant
        self._seal = SealedCopies(self, self.keyring) if self.keyring is not None else None
        parts = [f"kvtier-sealed-{self.keyring.id}"] if self.keyring is not None else []
        parts += [str(key_tag)] if key_tag is not None else []
        parts.append("-".join(str(model_name).split("/")))
        self.prefix = "_".join(parts)
        self.key_tag = key_tag
        self.model_name = model_name
        self.ranks = {"tp": (tp_rank, tp_size), "pp": (pp_rank, pp_size), "cp": (cp_rank, cp_size)}
        self.accept_unverified = accept_unverified
        self.kv_cache_dtype = None if kv_cache_dtype is None else str(kv_cache_dtype).removeprefix("torch.")
        self.master_server_address = master_server_address
        self.page_bytes = 0
        self._pool: Any = None
        self._layout: tuple[int, ...] | None = None
        self._ranges = _native.HostRanges()
        self._lock = threading.Lock()
        self._stats: dict[str, float] = dict.fromkeys(("hits", "misses", "corrupt", "stale", "unverified_served", "unverified_skipped",
                                     "put_pages", "put_failures", "skipped_present", "errors", "bytes_read",
                                     "bytes_written"), 0)
        self._stats.update(get_s=0.0, put_s=0.0)
        self._closed = False
        #: this tier's moving estimate of itself (see :meth:`measured`); no probe at open (it would put
        #: objects into a shared cluster): until its first batches, planners treat it as unmeasured
        self.meter = TierMeter(self.name)
        self._cv = threading.Condition()
        self._inflight = 0
        self._local = threading.local()
        self._buffers: list[HostBuffer] = []
        #: page keys served without a record (bounded, oldest forgotten first); never adopted, never filled
        self._unverified = Taint()  # keys served without a record: never vouched for nor filled, however many
        self._adopt: HostBuffer | None = None  # read-back space for objects stored without a record
        self._adopt_lock = threading.Lock()
        self._store, self._replicate = connect(master_server_address, protocol, device_name, local_hostname,
                                               metadata_server, global_segment_size, local_buffer_size, replica_num,
                                               setup_timeout_s)

    # ------------------------------------------------------------------ set-up
    validate_options = staticmethod(validate_options)


    def register_mem_pool_host(self, pool: Any) -> None:
        """Attach the host pool (kvtier's or SGLang's, page-first layouts): its memory is registered with
        Mooncake and with kvtier's range checks."""
        with self._busy():
            self._register(pool)

    def _register(self, pool: Any) -> None:
        layout = getattr(pool, "layout", None)
        if layout not in PAGE_LAYOUTS:
            raise InvalidArgumentError(f"invalid argument `pool`: layout {layout!r} is not supported by the "
                                       f"cluster tier; supported: {PAGE_LAYOUTS}")
        page_num = int(getattr(pool, "page_num", None) or pool.size // pool.page_size)
        lay = _page_layout(pool, page_num)
        regions = [b._region for b in getattr(pool, "_buffers", [])]
        spans: list[tuple[int, int]] = []
        if regions:
            for r in regions:
                self._ranges.register_region(r)
            spans = [(b.ptr, b.nbytes) for b in pool._buffers]
        else:
            kv = pool.kv_buffer
            for t in (list(kv) if isinstance(kv, (tuple, list)) else [kv]):
                self._ranges.register_tensor(t)
                spans.append((t.data_ptr(), t.numel() * t.element_size()))
        for ptr, n in spans:
            rc = self._store.register_buffer(ptr, n)
            if rc != 0:
                raise KvtierError(f"MooncakeTier: registering {n} bytes of host pool memory failed (code {rc})")
        mla = lay[5] == 0
        self._pool, self._layout, self._page_num = pool, lay, page_num
        self.page_bytes = lay[2] + lay[5]
        self._mla = mla
        self._sides = ("k",) if mla else ("k", "v")
        self._rec_bytes = record_size(len(self._sides), self._seal is not None)  # one page's record
        self._slot = -(-self._rec_bytes // SLOT) * SLOT
        tp, pp = self.ranks["tp"], self.ranks["pp"]
        # SGLang's suffixes: MHA "{tp}" (or "{tp}_{pp}"), MLA "" (or "{pp}"): one object per page for all ranks
        self._suffix = (f"{pp[0]}" if pp[1] > 1 else "") if mla else (f"{tp[0]}_{pp[0]}" if pp[1] > 1 else f"{tp[0]}")
        # everything that decides which bytes a page holds: with GQA heads replicated over ranks, rank 1 of
        # TP 4 and rank 1 of TP 8 hold different heads under one key, so the TP size is named (an MLA page is
        # the same on every rank); PP ranks may hold different layers in equal numbers (start layer named)
        cp = self.ranks["cp"]
        ranks = (f"pp={pp[0]}/{pp[1]}" if mla else f"tp={tp[0]}/{tp[1]}|pp={pp[0]}/{pp[1]}") + f"|cp={cp[0]}/{cp[1]}"
        # the key tag too: a tagged page "x" and an untagged page "<tag>_x" of one model are the same objects
        # (SGLang joins the names with "_"), and only the record tells them apart
        geometry = (f"kvtier-mooncake-v1|model={self.model_name}|key_tag={self.key_tag!r}|suffix={self._suffix}|{ranks}"
                    f"|start_layer={getattr(pool, 'start_layer', 0)}|dtype={logical_dtype(pool, self.kv_cache_dtype)}"
                    f"|layout={pool.layout}|page={pool.page_size}|layers={pool.layer_num}|{_heads(pool)}"
                    f"|objects={lay[2]},{lay[5]}" + (f"|sealed={self.keyring.id}" if self.keyring is not None else ""))
        self.fingerprint_text = geometry
        self._fp = hashlib.sha256(geometry.encode()).digest()[:8]

    @property
    def pool(self) -> Any:
        return self._pool

    @property
    def ranges(self) -> Any:
        """The host memory registered with this tier (range checks, checksums, sealing)."""
        return self._ranges

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """A call in flight: close() waits for every one to finish before it releases the Mooncake client and
        the buffers a call may be using."""
        with self._cv:
            if self._closed:
                raise ClosedError("MooncakeTier is closed")
            self._inflight += 1
        try:
            yield
        finally:
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()

    # ------------------------------------------------------------------ keys and addresses
    def _base(self, key: str) -> str:
        return f"{self.prefix}_{key}_{self._suffix}"

    def data_keys(self, key: str) -> list[str]:
        """The Mooncake keys of one page's data objects (SGLang's names)."""
        b = self._base(key)
        return [f"{b}_{s}" for s in self._sides]

    def record_key(self, key: str) -> str:
        """The integrity record's key of a page in clear (a sealed page's also names its tenant key's id)."""
        return f"{self._base(key)}_kvtier"

    def _record_keys(self, keys: list[str], create: bool) -> list[str]:
        """The record key of each page. Sealed: ``..._kvtier-<key id>``, the id of the tenant's current key,
        so a page sealed under a key since destroyed has no record (a miss, rewritten by the next put); a
        tenant without a key gets a name ending in ``NO_KEY`` that is never written."""
        if self._seal is None:
            return [self.record_key(x) for x in keys]
        tags = [tenant_of(x) for x in keys]
        ids = dict(zip(set(tags), self._seal.keyring.native.key_ids(list(set(tags)), create)))
        return [f"{self._base(x)}_kvtier-{ids[t]}" if ids[t] is not None else f"{self._base(x)}{NO_KEY}"
                for x, t in zip(keys, tags)]

    def _pages(self, keys: Sequence[str], host_indices: Any) -> tuple[list[str], np.ndarray]:
        """Checked page numbers of ``host_indices`` (whole, aligned, in-range pages), before any IO."""
        if self._pool is None:
            raise KvtierError("MooncakeTier: call register_mem_pool_host(pool) first")
        keys = scope_keys(self.tenant, _keys(keys))
        if not isinstance(host_indices, torch.Tensor) or host_indices.dtype != torch.int64 or host_indices.dim() != 1:
            raise InvalidArgumentError("invalid argument `host_indices`: expected a 1-D torch.int64 tensor")
        ps = self._pool.page_size
        idx = host_indices.detach().to("cpu").numpy().astype(np.int64, copy=True)
        if idx.size != len(keys) * ps:
            raise InvalidArgumentError(f"invalid argument `host_indices`: {idx.size} slots for {len(keys)} pages of {ps}")
        rows = idx.reshape(len(keys), ps)
        starts = rows[:, 0]
        if (starts % ps).any() or (rows - starts[:, None] != np.arange(ps)).any():
            raise InvalidArgumentError("invalid argument `host_indices`: every page must be page_size consecutive "
                                       "slots starting at a multiple of page_size")
        pages = starts // ps
        if pages.size and (pages.min() < 0 or pages.max() >= self._page_num):
            raise InvalidArgumentError(f"invalid argument `host_indices`: pages must lie in [0, {self._page_num})")
        return keys, pages

    def _objects(self, keys: list[str], pages: np.ndarray) -> tuple[list[str], list[int], list[int]]:
        """Per page, its data objects' keys, addresses and sizes (K then V)."""
        assert self._layout is not None
        kb, kst, kn, vb, vst, vn = self._layout
        names: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        for key, p in zip(keys, pages.tolist()):
            dk = self.data_keys(key)
            names.append(dk[0])
            ptrs.append(kb + p * kst)
            sizes.append(kn)
            if not self._mla:
                names.append(dk[1])
                ptrs.append(vb + p * vst)
                sizes.append(vn)
        return names, ptrs, sizes

    def _count(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                self._stats[k] += v

    # ------------------------------------------------------------------ batches
    def _scratch(self, n: int) -> tuple[int, np.ndarray]:
        """This thread's record buffer (registered with Mooncake and the range checks) for ``n`` records: its
        address and a numpy view of it."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < n * self._slot:
            buf = self.registered_buffer(max(n * self._slot, 1 << 16), "record")
            self._local.buf = buf
        return buf.ptr, buf.as_tensor(torch.uint8, (buf.nbytes,)).numpy()

    def registered_buffer(self, nbytes: int, what: str) -> HostBuffer:
        """Scratch memory registered with Mooncake and the range checks, kept (registered) until close: a
        batch may still use an older one."""
        buf = HostBuffer(nbytes, pin=False)
        with self._lock:
            self._buffers.append(buf)
        self._ranges.register_region(buf._region)
        if self._store.register_buffer(buf.ptr, buf.nbytes) != 0:
            raise KvtierError(f"MooncakeTier: registering the {what} buffer with Mooncake failed")
        return buf

    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Put pages and their integrity records. True per page when its data and record were accepted (pages
        already there whole with a record are not re-sent). Not durability: see the module docs."""
        with self._busy():
            return self._set(keys, host_indices)

    def _set(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        keys, pages = self._pages(keys, host_indices)
        if not keys:
            return []
        names, ptrs, sizes = self._objects(keys, pages)
        self._ranges.check(ptrs, sizes, False, "host_indices")
        k = len(self._sides)
        t0 = time.perf_counter()
        recs = self._record_keys(keys, create=True)
        exist = self._store.batch_is_exist(recs + names)
        nk = len(keys)
        ok = [False] * nk
        todo, orphans, first = [], [], {}
        for i in range(nk):
            whole = all(exist[nk + i * k + s] == 1 for s in range(k))
            if keys[i] in first:
                continue  # a key repeated in the batch: stored once, answered like its first occurrence
            first[keys[i]] = i
            if recs[i].endswith(NO_KEY):
                continue  # sealed, and the tenant's key could not be made: this page fails
            if exist[i] == 1 and whole:
                ok[i] = True  # already there whole with a record
            elif exist[i] == 1:
                orphans.append(i)  # a record whose data is gone (evicted, a dead node): it would block the page
            else:
                todo.append(i)
        self._count(skipped_present=sum(ok))
        # (a record whose data is gone is rewritten by upsert after the data: an existence check leases an
        # object, so it could not be removed now, and a plain put of an existing key stores nothing)
        todo += orphans
        upsert = {i for i in orphans}
        # pages this tier served unverified: their host bytes are a stock node's, never to be vouched for
        tainted = self._tainted([keys[i] for i in todo])
        if tainted:
            self._count(unverified_skipped=sum(1 for i in todo if keys[i] in tainted))
            todo = [i for i in todo if keys[i] not in tainted]
        # data objects already there without a record (a stock SGLang node's page, or a write of ours that failed
        # half-way): Mooncake keeps them and acknowledges a re-put without storing, so a record may only vouch
        # for them if their bytes are ours (a sealed tier upserts everything: its objects are its own names)
        held = [j for i in todo for j in range(i * k, (i + 1) * k) if exist[nk + j] == 1 and self._seal is None]
        if held:
            foreign = self._foreign_pages(held, names, ptrs, sizes)
            todo = [i for i in todo if i not in foreign]
            self._count(unverified_skipped=len(foreign))
        objs = [j for i in todo for j in range(i * k, (i + 1) * k)]
        sealed_at: dict[int, int] = {}
        if self._seal is not None and todo:  # sealed copies are sent, and their seals go into the records
            sp, all_seals, sealed = self._seal.seal([names[j] for j in objs], [ptrs[j] for j in objs],
                                                    [sizes[j] for j in objs], [tenant_of(keys[j // k]) for j in objs])
            sealed_at = {j: n for n, j in enumerate(objs)}
            todo = [i for i in todo if all(sealed[sealed_at[j]] for j in range(i * k, (i + 1) * k))]
            objs = [j for i in todo for j in range(i * k, (i + 1) * k)]
        if not todo:
            return self._repeat(keys, first, ok)
        on, op, os_ = [names[j] for j in objs], [ptrs[j] for j in objs], [sizes[j] for j in objs]
        seals = b""
        if sealed_at:
            op = [sp[sealed_at[j]] for j in objs]
            seals = b"".join(all_seals[sealed_at[j] * SEAL:(sealed_at[j] + 1) * SEAL] for j in objs)
        rk = [recs[i] for i in todo]
        rptr, rview = self._scratch(len(todo))
        rp, rs = [rptr + n * self._slot for n in range(len(todo))], [self._rec_bytes] * len(todo)

        def records(crcs: list[int]) -> None:
            for n in range(len(todo)):
                rec = record_bytes(self._fp, [(os_[n * k + s], crcs[n * k + s]) for s in range(k)],
                                   seals[n * k * SEAL:(n + 1) * k * SEAL])
                rview[n * self._slot: n * self._slot + self._rec_bytes] = np.frombuffer(rec, dtype=np.uint8)

        fresh = [n for n, i in enumerate(todo) if i not in upsert]
        redo = [n for n, i in enumerate(todo) if i in upsert]

        def put_records() -> list[int]:
            """Data and records in one batch (orphans' records by upsert, after it); results: the data's,
            then one per page. Sealed: all by upsert (a sealed object already there is another seal's)."""
            if self._seal is not None:
                return list(self._store.batch_upsert_from(on + rk, op + rp, os_ + rs, self._replicate))
            out = [0] * len(todo)
            got = self._store.batch_put_from(on + [rk[n] for n in fresh], op + [rp[n] for n in fresh],
                                             os_ + [rs[n] for n in fresh], self._replicate)
            data_res, rec_res = got[: len(on)], got[len(on):]
            for n, r in zip(fresh, rec_res):
                out[n] = r
            if redo:
                for n, r in zip(redo, self._store.batch_upsert_from([rk[n] for n in redo], [rp[n] for n in redo],
                                                                    [rs[n] for n in redo], self._replicate)):
                    out[n] = r
            return list(data_res) + out

        # data and records in one call: Mooncake's cost is per object and per call, and the checksums cost
        # less up front than overlapped with the send (measured on 2 cores: the send is CPU work too)
        records(self._ranges.crc32c(on, op, os_))
        res = put_records()
        base = len(on)
        for n, i in enumerate(todo):
            data_ok = all(r == 0 for r in res[n * k:(n + 1) * k])
            ok[i] = res[base + n] == 0 and data_ok
            if res[base + n] == 0 and not data_ok:  # a record without its data would block the page: take it back
                self._store.remove(rk[n])
        sent = sum(1 for i in todo if ok[i])
        dt = time.perf_counter() - t0
        failed = sum(1 for i in first.values() if not ok[i])
        self._count(put_pages=sent, put_failures=failed, bytes_written=sent * self.page_bytes, put_s=dt)
        self.meter.observe("write", sent * self.page_bytes, dt)
        return self._repeat(keys, first, ok)

    @staticmethod
    def _repeat(keys: list[str], first: dict[str, int], ok: list[bool]) -> list[bool]:
        """A key repeated in one batch gets its first occurrence's answer."""
        return [ok[first[x]] for x in keys]

    def _tainted(self, keys: list[str]) -> set[str]:
        with self._lock:
            return {x for x in keys if x in self._unverified}

    def served_unverified(self, keys: Sequence[str]) -> set[str]:
        """Which of ``keys`` this tier has served without an integrity record (``accept_unverified``): a tier
        chain does not copy them into its durable tiers, and this tier never adds a record to them."""
        return self._tainted(list(keys))

    def _foreign_pages(self, held: list[int], names: list[str], ptrs: list[int], sizes: list[int]) -> set[int]:
        """Pages (indices) among the objects ``held`` whose stored bytes differ from this writer's (or cannot be
        read back): read back into a scratch buffer and compared by checksum."""
        k = len(self._sides)
        with self._adopt_lock:
            need = sum(sizes[j] for j in held)
            if self._adopt is None or self._adopt.nbytes < need:
                buf = HostBuffer(max(need, 1 << 20), pin=False)
                self._buffers.append(buf)
                self._ranges.register_region(buf._region)
                if self._store.register_buffer(buf.ptr, buf.nbytes) != 0:
                    return {j // k for j in held}
                self._adopt = buf
            dst, off = [], self._adopt.ptr
            for j in held:
                dst.append(off)
                off += sizes[j]
            hn, hs = [names[j] for j in held], [sizes[j] for j in held]
            got = self._store.batch_get_into(hn, dst, hs)
            stored = self._ranges.crc32c(hn, dst, hs)
        ours = self._ranges.crc32c(hn, [ptrs[j] for j in held], hs)
        return {j // k for j, g, a, b in zip(held, got, stored, ours) if g != sizes[j] or a != b}

    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool; True per page only when its record matches and every object read
        back has the recorded size and checksum (a False page's host bytes are unspecified). A key may appear
        once per batch (Mooncake fills only the last destination of a repeated key)."""
        with self._busy():
            return self._get(keys, host_indices)

    def _get(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        keys, pages = self._pages(keys, host_indices)
        if not keys:
            return []
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("invalid argument `keys`: a key appears twice in one batch_get_v1")
        names, ptrs, sizes = self._objects(keys, pages)
        self._ranges.check(ptrs, sizes, True, "host_indices")  # destinations: inside the pool, disjoint
        k, n_pages = len(self._sides), len(keys)
        t0 = time.perf_counter()
        rptr, rview = self._scratch(n_pages)
        rk = self._record_keys(keys, create=False)
        rp, rs = [rptr + n * self._slot for n in range(n_pages)], [self._rec_bytes] * n_pages
        # records and data in one call (measured: splitting a batch to overlap checksums with the transfer
        # costs Mooncake more than it saves)
        objs = [j for i in range(n_pages) for j in range(i * k, (i + 1) * k)]
        res = list(self._store.batch_get_into(rk + [names[j] for j in objs], rp + [ptrs[j] for j in objs],
                                              rs + [sizes[j] for j in objs]))
        ok = [False] * n_pages
        bad = self._verify(range(n_pages), res, rview, keys, names, ptrs, sizes, ok)
        for i in bad:
            # a record that vouches for other bytes (a damaged object, or two writers' objects interleaved)
            # would keep the page a lookup hit that never reads, and keep every writer from rewriting it: it
            # goes (forced: the read just leased it), so lookups miss and the next put writes the page whole
            self._store.remove(rk[i], True)
        hits = sum(ok)
        dt = time.perf_counter() - t0
        self._count(hits=hits, misses=n_pages - hits, bytes_read=hits * self.page_bytes, get_s=dt)
        self.meter.observe("read", hits * self.page_bytes, dt)
        return ok

    def _verify(self, ch: range, res: list[int], rview: np.ndarray, keys: list[str], names: list[str],
                ptrs: list[int], sizes: list[int], ok: list[bool]) -> list[int]:
        """Marks the pages of one fetched chunk that arrived whole and match their records; returns the pages
        whose record vouches for bytes that are not there (corrupt)."""
        k, nrec = len(self._sides), len(ch)
        bad: list[int] = []
        check: list[tuple[int, list[tuple[int, int]]]] = []
        seals: dict[int, bytes] = {}
        for n, i in enumerate(ch):
            arrived = all(res[nrec + n * k + s] == sizes[i * k + s] for s in range(k))
            rec = None
            if res[n] == self._rec_bytes:
                raw = rview[i * self._slot: i * self._slot + self._rec_bytes].tobytes()
                rec = parse_record(raw, self._fp, k, self._seal is not None)
                if rec is not None and self._seal is not None:
                    seals[i] = record_seals(raw, k)
                if rec is None or any(rec[s][0] != sizes[i * k + s] for s in range(k)):
                    self._count(stale=1)  # another geometry, dtype or version under this key, or a torn record
                    continue
            elif res[n] > 0 or res[n] == TOO_SMALL:
                self._count(stale=1)  # a record of another size: not one of ours
                continue
            if not arrived:
                got = [res[nrec + n * k + s] for s in range(k)]
                if rec is not None and any(g == TOO_SMALL or 0 < g != want for g, want in zip(got, sizes[i * k:(i + 1) * k])):
                    self._count(corrupt=1)  # recorded, but an object came back truncated or extended
                    bad.append(i)
                continue
            if rec is None:
                if self.accept_unverified:  # data without a record: a stock SGLang page, served by option
                    ok[i] = True
                    self._count(unverified_served=1)
                    with self._lock:
                        self._unverified.add(keys[i])
                continue
            check.append((i, rec))
        if check:
            objs = [j for i, _ in check for j in range(i * k, (i + 1) * k)]
            crcs = self._ranges.crc32c([names[j] for j in objs], [ptrs[j] for j in objs], [sizes[j] for j in objs])
            good = [(i, n) for n, (i, rec) in enumerate(check) if all(crcs[n * k + s] == rec[s][1] for s in range(k))]
            if self._seal is not None and good:  # sealed: opened in place, served only if every tag verifies
                objs = [j for i, _ in good for j in range(i * k, (i + 1) * k)]
                opened = self._seal.open([names[j] for j in objs], [ptrs[j] for j in objs], [sizes[j] for j in objs],
                                         [tenant_of(keys[j // k]) for j in objs], b"".join(seals[i] for i, _ in good))
                good = [(i, n) for m, (i, n) in enumerate(good) if all(opened[m * k:(m + 1) * k])]
            for i, _ in good:
                ok[i] = True
            self._count(corrupt=len(check) - len(good))
            bad += [i for i, _ in check if not ok[i]]
        return bad

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """Length of the leading run of pages whose record and data objects all exist (data alone counts
        with ``accept_unverified``)."""
        with self._busy():
            return self._exists(keys)

    def _exists(self, keys: Sequence[str]) -> int:
        keys = scope_keys(self.tenant, _keys(keys))
        if self._pool is None:
            raise KvtierError("MooncakeTier: call register_mem_pool_host(pool) first")
        if not keys:
            return 0
        k = len(self._sides)
        names = [n for x in keys for n in self.data_keys(x)]
        exist = self._store.batch_is_exist(self._record_keys(keys, create=False) + names)
        n = 0
        for i in range(len(keys)):
            data = all(e == 1 for e in exist[len(keys) + i * k: len(keys) + (i + 1) * k])
            if not data or not (exist[i] == 1 or self.accept_unverified):
                break
            n += 1
        self.meter.observe_lookup(n, len(keys))
        return n

    def measured(self) -> dict[str, TierEstimate]:
        """What this tier measured about itself (``{"mooncake": TierEstimate}``), from its recent batches."""
        return {self.name: self.meter.estimate()}

    def locate(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        """The leading run of ``keys`` this tier holds, as ``[(tier, pages)]``."""
        n = self.batch_exists(keys)
        return [(self.name, n)] if n else []

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def delete(self, keys: Sequence[str]) -> int:
        """Remove pages (the record first, so a page stops counting before its data goes); returns how many
        pages had a record. Objects read in the last lease period cannot be removed yet (Mooncake's lease)."""
        with self._busy():
            n = 0
            keys = scope_keys(self.tenant, _keys(keys))
            for key, rec in zip(keys, self._record_keys(keys, create=False)):
                if self._store.remove(rec) == 0:
                    n += 1
                for d in self.data_keys(key):
                    self._store.remove(d)
            return n

    def erase_tenant(self, salt: str | None = None, *, tag: str | None = None) -> int:
        """Remove every object of one tenant (named by ``salt`` or ``tag``) from the whole cluster — every
        model's and every node's, leased or not; returns the objects removed (Mooncake's count)."""
        t = erase_tag(salt, tag)
        with self._busy():
            n = int(self._store.remove_by_regex(f"_t{t}\\.", True))
        if n < 0:
            raise KvtierError(f"MooncakeTier: removing tenant {t}'s objects failed (Mooncake code {n})")
        return n

    def clear(self) -> None:
        """Remove every object of the whole cluster (Mooncake has no per-prefix clear that respects leases)."""
        with self._busy():
            self._store.remove_all()

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            st: dict[str, Any] = {k: v if k.endswith("_s") else int(v) for k, v in self._stats.items()}
        st["read_GBps"] = st["bytes_read"] / st["get_s"] / 1e9 if st["get_s"] else 0.0
        st["write_GBps"] = st["bytes_written"] / st["put_s"] / 1e9 if st["put_s"] else 0.0
        return st

    def close(self) -> None:
        """Release the Mooncake client, after the calls in flight finish (new ones raise ClosedError).
        Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.wait_for(lambda: self._inflight == 0)
        try:
            self._store.close()
        except Exception:
            pass
        for buf in self._buffers:
            buf.close()
        self._buffers = []

    def __enter__(self) -> MooncakeTier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
