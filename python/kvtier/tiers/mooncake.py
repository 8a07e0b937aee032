"""``MooncakeTier``: KV pages in a Mooncake Store cluster shared by many inference nodes, with kvtier's integrity
on top (``pip install 'kvtier[mooncake]'``; design and fault table: docs/CLUSTER.md).

Data objects are SGLang's: one K and one V object per page (one object for MLA) under SGLang's Mooncake keys
``{prefix}_{page hash}_{rank suffix}_k`` / ``_v``, byte for byte the pool's page, so a page written by a stock SGLang
node (``--hicache-storage-backend mooncake``) and one written by kvtier are the same objects. A sealed tier
(``keyring``) names them by the keyring's keyed names of the page keys (:mod:`.objects.seal`).

Integrity: beside each page kvtier writes a small **integrity record** ``{...}_{rank suffix}_kvtier`` *after* the
data: the geometry fingerprint (model, dtype, layout, page size, layers, heads and dims, object sizes) and a crc32c of
each data object bound to its key. A page is present only when its record and its data objects all exist, and is
served only when the record matches this reader's fingerprint and every object read back has the recorded size and
checksum — otherwise it is a miss. A torn, stale, swapped, re-sized or missing object is a miss, never wrong bytes.
Pages a stock SGLang node wrote have no record: they are misses unless ``accept_unverified=True`` (then served on size
alone, and counted).

A Mooncake acknowledgement is not durability (it reports success for a re-put of a key it does not store, and loses
objects when a storage process dies); the durable copy is the local :class:`kvtier.PageStore` before this tier in a
:class:`kvtier.tiers.TieredStore`."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .. import _native
from .._errors import ClosedError, InvalidArgumentError, KvtierError
from ..buffer import HostBuffer
from ..metrics import Scrape
from ..planner import TierEstimate, TierMeter
from ..page_layout import PAGE_LAYOUTS, host_buffers, page_layout as _page_layout
from ._mooncake_env import connect
from ._mooncake_options import validate_options
from ._mooncake_scratch import RegisteredScratch
from ..namespace import Ranks
from ..tenants import check_keys as _keys, erase_tag, open_keyring, scope_keys, tenant_of
from .objects.pages import PageObjects
from .objects.records import NO_KEY, SEAL, Taint, check_read
from .objects.seal import SealedCopies

class MooncakeTier:
    """See the module docs. Same batch interface as :class:`kvtier.PageStore`.

    Args:
        master_server_address: the Mooncake master, ``host:port``.
        model_name: names the keys as SGLang does (``/`` becomes ``-``); with ``key_tag`` (SGLang's
            ``extra_backend_tag``) it forms the key prefix.
        tp_rank, tp_size, pp_rank, pp_size: the rank suffix of the keys (SGLang's); an MLA pool's pages are
            shared by all TP ranks. ``ranks``: a :class:`kvtier.namespace.Ranks` in place of the rank keywords.
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
            (``kvtier-sealed-<keyring id>_...``), never SGLang's clear objects, and under the keyring's keyed
            names of their page keys (no engine key, no tenant tag in the cluster). ``None``: in clear.
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
                 setup_timeout_s: float = 30.0, keyring: Any = None, tenant: str | None = None,
                 ranks: Ranks | None = None) -> None:
        tp_rank, tp_size, pp_rank, pp_size, cp_rank, cp_size, dcp_size = Ranks.pick(
            ranks, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, cp_rank=cp_rank,
            cp_size=cp_size, dcp_size=dcp_size)
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
        self.key_tag, self.model_name = key_tag, model_name
        self.ranks = {"tp": (tp_rank, tp_size), "pp": (pp_rank, pp_size), "cp": (cp_rank, cp_size)}
        self.accept_unverified, self.master_server_address = accept_unverified, master_server_address
        self.kv_cache_dtype = None if kv_cache_dtype is None else str(kv_cache_dtype).removeprefix("torch.")
        self.page_bytes = 0
        self._pool: Any = None
        self._objs: PageObjects | None = None  # the registered pool's pages as Mooncake objects
        self._ranges, self._lock = _native.HostRanges(), threading.Lock()
        self._stats: dict[str, float] = dict.fromkeys(("hits", "misses", "corrupt", "stale", "unverified_served", "unverified_skipped",
                                     "put_pages", "put_failures", "skipped_present", "errors", "bytes_read", "bytes_written"), 0)
        self._stats.update(get_s=0.0, put_s=0.0)
        self._closed = False
        #: this tier's moving estimate of itself (see :meth:`measured`); no probe at open (it would put
        #: objects into a shared cluster): until its first batches, planners treat it as unmeasured
        self.meter = TierMeter(self.name)
        self._cv = threading.Condition()
        self._inflight = 0
        self._unverified = Taint()  # keys served without a record: never vouched for nor filled, however many
        self._store, self._replicate = connect(master_server_address, protocol, device_name, local_hostname,
                                               metadata_server, global_segment_size, local_buffer_size, replica_num,
                                               setup_timeout_s)
        self._scratch = RegisteredScratch(self._store, self._ranges)

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
        buffers = host_buffers(pool)
        spans: list[tuple[int, int]] = []
        if buffers:
            for b in buffers:
                self._ranges.register_region(b.region)
            spans = [(b.ptr, b.nbytes) for b in buffers]
        else:
            kv = pool.kv_buffer
            for t in (list(kv) if isinstance(kv, (tuple, list)) else [kv]):
                self._ranges.register_tensor(t)
                spans.append((t.data_ptr(), t.numel() * t.element_size()))
        for ptr, n in spans:
            rc = self._store.register_buffer(ptr, n)
            if rc != 0:
                raise KvtierError(f"MooncakeTier: registering {n} bytes of host pool memory failed (code {rc})")
        objs = PageObjects(pool, lay, page_num, prefix=self.prefix, model_name=self.model_name, key_tag=self.key_tag,
                           ranks=self.ranks, kv_cache_dtype=self.kv_cache_dtype,
                           sealed=self.keyring.id if self.keyring is not None else None,
                           scheme="kvtier-mooncake-v1", seal_scheme="kvtier-mooncake-seal-v1")
        self._pool, self._objs, self.page_bytes = pool, objs, objs.page_bytes
        self.fingerprint_text = objs.fingerprint_text

    @property
    def pool(self) -> Any:
        """The registered host pool (``None`` before ``register_mem_pool_host``)."""
        return self._pool

    @property
    def page_objects(self) -> PageObjects | None:
        """The registered pool's pages as Mooncake objects: keys, addresses, sizes (``None`` before registration)."""
        return self._objs

    @property
    def client(self) -> Any:
        """The Mooncake store client this tier drives (what a bench compares the tier with)."""
        return self._store

    @property
    def ranges(self) -> Any:
        """The host memory registered with this tier (range checks, checksums, sealing)."""
        return self._ranges

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """A call in flight: close() waits for every one before it releases the client and the buffers."""
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
    def _map(self) -> PageObjects:
        if self._objs is None:
            raise KvtierError("MooncakeTier: call register_mem_pool_host(pool) first")
        return self._objs

    def _stored(self, keys: list[str]) -> list[str]:
        """The name each page key is stored under: itself in clear, the keyring's keyed name sealed."""
        return keys if self._seal is None else self._seal.stored(keys)

    def data_keys(self, key: str) -> list[str]:
        """The Mooncake keys of one page's data objects (SGLang's names; sealed: of its keyed name)."""
        return self._map().data_keys(self._stored([key])[0])

    def record_key(self, key: str) -> str:
        """The integrity record's key of a page in clear (a sealed page's also names its tenant key's id)."""
        return f"{self._map().base(self._stored([key])[0])}_kvtier"

    def _records(self, skeys: list[str], create: bool) -> list[str]:
        """The record key of each stored page key (sealed: see ``SealedCopies.record_names``)."""
        if self._seal is None:
            return [f"{self._map().base(x)}_kvtier" for x in skeys]
        return self._seal.record_names(self._map().base, skeys, create)

    def _pages(self, keys: Sequence[str], host_indices: Any) -> tuple[PageObjects, list[str], np.ndarray]:
        """The registered pages, their stored keys, and the checked page numbers of ``host_indices`` (whole,
        aligned, in-range pages), before any IO."""
        objs, keys = self._map(), self._stored(scope_keys(self.tenant, _keys(keys)))
        return objs, keys, objs.pages(keys, host_indices)

    def _count(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                self._stats[k] += v

    # ------------------------------------------------------------------ batches
    def registered_buffer(self, nbytes: int, what: str) -> HostBuffer:
        """Scratch memory registered with Mooncake and the range checks, kept (registered) until close: a
        batch may still use an older one."""
        return self._scratch.buffer(nbytes, what)

    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Put pages and their integrity records. True per page when its data and record were accepted (pages
        already there whole with a record are not re-sent). Not durability: see the module docs."""
        with self._busy():
            return self._set(keys, host_indices)

    def _set(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        m, keys, pages = self._pages(keys, host_indices)
        if not keys:
            return []
        names, ptrs, sizes = m.objects(keys, pages)
        self._ranges.check(ptrs, sizes, False, "host_indices")
        k = len(m.sides)
        t0 = time.perf_counter()
        recs = self._records(keys, create=True)
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
            foreign = self._scratch.foreign_pages(k, held, names, ptrs, sizes)
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
        rptr, rview = self._scratch.records(len(todo) * m.slot)
        rp, rs = [rptr + n * m.slot for n in range(len(todo))], [m.rec_bytes] * len(todo)

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
        m.write_records(rview, os_, self._ranges.crc32c(on, op, os_), seals)
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

    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool; True per page only when its record matches and every object read
        back has the recorded size and checksum (a False page's host bytes are unspecified). A key may appear
        once per batch (Mooncake fills only the last destination of a repeated key)."""
        with self._busy():
            return self._get(keys, host_indices)

    def _get(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        m, keys, pages = self._pages(keys, host_indices)
        if not keys:
            return []
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("invalid argument `keys`: a key appears twice in one batch_get_v1")
        names, ptrs, sizes = m.objects(keys, pages)
        self._ranges.check(ptrs, sizes, True, "host_indices")  # destinations: inside the pool, disjoint
        k, n_pages = len(m.sides), len(keys)
        t0 = time.perf_counter()
        rptr, rview = self._scratch.records(n_pages * m.slot)
        rk = self._records(keys, create=False)
        rp, rs = [rptr + n * m.slot for n in range(n_pages)], [m.rec_bytes] * n_pages
        # records and data in one call (measured: splitting a batch to overlap checksums with the transfer
        # costs Mooncake more than it saves)
        objs = [j for i in range(n_pages) for j in range(i * k, (i + 1) * k)]
        res = list(self._store.batch_get_into(rk + [names[j] for j in objs], rp + [ptrs[j] for j in objs],
                                              rs + [sizes[j] for j in objs]))
        ok = [False] * n_pages
        served, unverified, bad, stale = check_read(m, n_pages, res, rview, keys, names, ptrs, sizes, self._ranges,
                                                    self._seal, self.accept_unverified)
        for i in served + unverified:
            ok[i] = True
        self._count(stale=stale, corrupt=len(bad), unverified_served=len(unverified))
        if unverified:  # data without a record: a stock SGLang page, served by option, never vouched for
            with self._lock:
                for i in unverified:
                    self._unverified.add(keys[i])
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

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """Length of the leading run of pages whose record and data objects all exist (data alone counts
        with ``accept_unverified``)."""
        with self._busy():
            return self._exists(keys)

    def _exists(self, keys: Sequence[str]) -> int:
        m = self._map()
        keys = self._stored(scope_keys(self.tenant, _keys(keys)))
        if not keys:
            return 0
        k = len(m.sides)
        names = [n for x in keys for n in m.data_keys(x)]
        exist = self._store.batch_is_exist(self._records(keys, create=False) + names)
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
            n, m = 0, self._map()
            keys = self._stored(scope_keys(self.tenant, _keys(keys)))
            for key, rec in zip(keys, self._records(keys, create=False)):
                if self._store.remove(rec) == 0:
                    n += 1
                for d in m.data_keys(key):
                    self._store.remove(d)
            return n

    def erase_tenant(self, salt: str | None = None, *, tag: str | None = None) -> int:
        """Remove every object of one tenant (named by ``salt`` or ``tag``) from the whole cluster — every
        model's and every node's, leased or not: its clear objects (named by its tag) and, with a keyring,
        the objects sealed with that keyring (named by its stored tag); returns the objects removed
        (Mooncake's count)."""
        t, n = erase_tag(salt, tag), 0
        with self._busy():
            for name in [t] + ([self.keyring.stored_tag(tag=t)] if self.keyring is not None else []):
                got = int(self._store.remove_by_regex(f"_t{name}\\.", True))
                if got < 0:
                    raise KvtierError(f"MooncakeTier: removing tenant {t}'s objects failed (Mooncake code {got})")
                n += got
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

    def report_metrics(self, scrape: Scrape, name: str) -> tuple[()]:  # (the chain it is in reports its view of it)
        scrape.cluster_pages(self.get_stats())
        return ()

    def close(self) -> None:
        """Release the Mooncake client, after the calls in flight finish (new ones raise ClosedError).
        Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.wait_for(lambda: self._inflight == 0)
        with contextlib.suppress(Exception):
            self._store.close()
        self._scratch.close()

    def __enter__(self) -> MooncakeTier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
