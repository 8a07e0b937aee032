"""``PageStore``: the L3 tier — KV pages on a local disk or shared file system, in HiCache's zero-copy v1
shape (``batch_set_v1`` / ``batch_get_v1`` on host-pool indices).

One page is two objects, ``<key>.k`` and ``<key>.v``, of the pool's K and V page sizes (different for
asymmetric models), written from and read into the pinned host pool directly (O_DIRECT when the file
system allows it; otherwise buffered IO with fdatasync, reported once), one call into the Rust core per
batch. Every page lives in a namespace derived from the model name, the parallel ranks and the registered
pool's geometry, so a page written under one geometry is never returned to a pool of another: a miss. The Rust core makes a page durable
before ``batch_set_v1`` reports it, checksums every object, turns IO errors into False results, and keeps
the directory under ``capacity_bytes`` by evicting least-recently-used pages. The design, step by step
with every crash point, is docs/STORE.md.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from typing import Any
from collections.abc import Sequence

import numpy as np
import torch

from . import _native, native_calls
from .metrics import LatencyHistogram, Scrape
from .hashes import page_hashes  # noqa: F401 - kvtier.store.page_hashes stays importable
from .planner import TierEstimate, TierMeter
from ._errors import ClosedError, InvalidArgumentError, KvtierError
from .config import check_ints, check_ranks, parse_size
from .tenants import check_keys as _keys, erase_tag, open_keyring, scope_keys
from .staging import StagingPages
from .namespace import Namespace, Ranks, check_value, fields_of, rank_fields
from .compression import COMPRESSION, codec_for, compression_stats, effective_read_GBps  # noqa: F401 - re-exported
from .page_layout import PAGE_LAYOUTS, heads_of as _heads, host_buffers, logical_dtype, page_layout as _page_layout  # noqa: F401

#: Default hard limit of one namespace's data (bytes).
DEFAULT_CAPACITY = 64 << 30
#: Bytes the probe at open writes (twice) and reads back, in a file of its own beside the namespaces.
DEFAULT_PROBE_BYTES = 16 << 20


class PageStore:
    """Durable page store for one model and rank.

    Args:
        path: the store's root directory (created owner-only); namespaces are subdirectories.
        capacity_bytes: hard limit on the disk blocks of this namespace — data files and journal (default
            64 GiB; an int, or a string such as ``"512G"``); least-recently-used pages are evicted to stay
            under it (docs/STORE.md).
        budget_bytes: the budget of the whole store directory ``path``: every namespace in it, in every
            process, stays within it together (docs/STORE.md, "One budget for a store directory"); an int or
            a string such as ``"512G"``, 0 to remove the directory's budget. ``None`` (default) leaves the
            directory's budget as it is. A writable store honours the directory's budget whether it sets it
            or not: when the namespaces' total would pass it, it evicts its own least-recently-used pages
            (pages of other namespaces, idle ones included, count until ``kvtier remove`` removes them).
        model_name, tp_rank, tp_size, pp_rank, pp_size, cp_rank, cp_size, dp_rank, dcp_rank, dcp_size: identify
            the KV this store holds (``dp_rank``: with DP attention the TP rank is group-local, so ranks of
            different DP groups need their own namespace; ``dcp_*``: a decode-context-parallel shard);
            with the registered pool's geometry they form the namespace. ``ranks``: a
            :class:`kvtier.namespace.Ranks` in place of the rank keywords.
        io_threads: IO requests in flight per batch (default 16).
        read_only: read the namespace another process writes (SGLang's MLA ranks other than the writer):
            no lock is taken, nothing is written, the writer's new pages are seen as it commits them, and
            until the writer has created the namespace every lookup is a miss.
        direct: ``None`` probes O_DIRECT and falls back to buffered IO (with a warning); ``False`` disables
            it; ``True`` requires it.
        kv_cache_dtype: the KV cache's logical dtype when the host pool holds it as raw bytes and cannot say
            (SGLang's pools keep every fp8 variant as ``uint8``): named in the namespace, so pages of an
            ``fp8_e5m2`` cache are never served to an ``fp8_e4m3`` one. kvtier's own pools know it.
        keyring: seal every page at rest (AES-256-GCM, a key per tenant) with this :class:`kvtier.Keyring` or
            keyring directory (docs/SECURITY.md); the namespace then names the keyring's id, so sealed and clear
            pages, or pages of two master keys, never meet. ``None`` (default): pages are stored in clear.
        tenant: a per-deployment tenant salt: every key this store reads or writes that carries no tenant of
            its own (:func:`kvtier.tenants.scope_keys`) becomes that tenant's. ``None``: keys as given.
        compression: ``"auto"`` (default): pages of a bfloat16, float16 or fp8 KV cache are stored compressed
            without loss (the exponents Huffman-coded, the rest as is: about 1.46× on real bf16 KV, 1.19× on
            fp8; docs/STORE.md, "Compressed objects"), each object only when that saves at least a 4 KiB
            block; other dtypes are stored as they are (:attr:`compression_note` says why). ``"lossless"``:
            the same, and a pool of a dtype it cannot compress is refused. ``"off"``: stored as given.
            Pages already stored are read whatever the setting.
        probe_bytes: when a writable store registers its pool, it measures the disk with the store's own IO
            (O_DIRECT objects of the pool's page-object size, ``io_threads`` in flight, durable writes) on
            this many bytes in a temporary file beside the namespaces (removed at once; skipped when the
            file system has less than 4× that free): the figure that seeds :meth:`measured` until the
            store's own batches have been timed. 0 disables it.
    """

    #: the tier's name in plans and measurements
    name = "disk"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity_bytes: int | str = DEFAULT_CAPACITY,
        model_name: str = "default",
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        cp_rank: int = 0,
        cp_size: int = 1,
        dp_rank: int = 0,
        dcp_rank: int = 0,
        dcp_size: int = 1,
        ranks: Ranks | None = None,
        io_threads: int = 16,
        direct: bool | None = None,
        read_only: bool = False,
        kv_cache_dtype: str | None = None,
        probe_bytes: int = DEFAULT_PROBE_BYTES,
        budget_bytes: int | str | None = None,
        keyring: Any = None,
        tenant: str | None = None,
        compression: str = "auto",
    ) -> None:
        if compression not in COMPRESSION:
            raise InvalidArgumentError(f"invalid argument `compression`: one of {', '.join(map(repr, COMPRESSION))}, "
                                       f"got {compression!r}")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise InvalidArgumentError(f"invalid argument `tenant`: a non-empty salt string or None, got {tenant!r}")
        check_ints(probe_bytes=(probe_bytes, 0), io_threads=(io_threads, 1), dp_rank=(dp_rank, 0))
        capacity_bytes = parse_size("capacity_bytes", capacity_bytes, 4096)
        if budget_bytes is not None:
            budget_bytes = parse_size("budget_bytes", budget_bytes, 0)
            if 0 < budget_bytes < 4096:
                raise InvalidArgumentError(f"invalid argument `budget_bytes`: must be 0 (no budget) or >= 4096, "
                                           f"got {budget_bytes}")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise InvalidArgumentError(f"invalid argument `path`: the store's root directory (a non-empty path), got {path!r}")
        tp_rank, tp_size, pp_rank, pp_size, cp_rank, cp_size, dp_rank, dcp_rank, dcp_size = Ranks.pick(
            ranks, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, cp_rank=cp_rank,
            cp_size=cp_size, dp_rank=dp_rank, dcp_rank=dcp_rank, dcp_size=dcp_size)
        check_ranks(tp=(tp_rank, tp_size), pp=(pp_rank, pp_size), cp=(cp_rank, cp_size), dcp=(dcp_rank, dcp_size))
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.budget_bytes: int | None = budget_bytes
        self.model_name = check_value("model_name", str(model_name))
        self.kv_cache_dtype = None if kv_cache_dtype is None else str(kv_cache_dtype).removeprefix("torch.")
        self.ranks = dict(tp=(tp_rank, tp_size), pp=(pp_rank, pp_size), cp=(cp_rank, cp_size),
                          dcp=(dcp_rank, dcp_size), dp=(dp_rank, 0))
        self.io_threads, self.direct = io_threads, direct
        self.keyring, self.tenant = open_keyring(keyring), tenant
        self._native: Any = None
        self._pool: Any = None
        self.page_bytes = 0  # bytes of one page (K + V) once a pool is registered
        self.page_kinds = 2  # objects per page: K and V, or 1 for MLA pools
        self.compression = compression
        #: the page codec new pages are stored with (None: as given) once a pool is registered, and why
        self.codec: str | None = None
        self.compression_note = ""
        self.read_only = bool(read_only)
        self._pending: Any = None  # what opening needs (kept for a reader whose writer is not there yet)
        self._staging: StagingPages | None = None  # bound at every open (:meth:`stage`)
        self._next_try, self._closed = 0.0, False
        self._lock = threading.Lock()
        self._erased_tags: set[str] = set()  # tenants erased through this store: refused again after a reopen
        self.latency = {"write": LatencyHistogram(), "read": LatencyHistogram()}  # per batch (write: until durable, read: verified)
        self.probe_bytes = probe_bytes
        #: this tier's moving estimate of itself (read/write GB/s, batch latency, hit rate): see :meth:`measured`
        self.meter = TierMeter(self.name)
        self._writes_seen = (0, 0)  # the store's bytes written and write time at the last measured()

    # ------------------------------------------------------------------ registration
    def namespace_for(self, pool: Any) -> str:
        """The namespace string for ``pool`` (model, ranks, dtype, layout, page size, layers, heads, dims; for
        an MLA pool its latent and rope dims)."""
        # (the DP rank and a decode context-parallel shard are named only when set: kvtier.namespace.rank_fields)
        return Namespace.build("kvtier-v1", model=str(self.model_name), **rank_fields(self.ranks),
                               dtype=str(self.dtype_of(pool)), layout=str(pool.layout), page=str(pool.page_size),
                               layers=str(pool.layer_num), **fields_of(_heads(pool)),
                               sealed=self.keyring.id if self.keyring is not None else None).format()

    def dtype_of(self, pool: Any) -> str:
        """The KV cache's logical dtype: the explicit ``kv_cache_dtype``, else what the pool (kvtier's:
        ``logical_dtype``) or its device pool says, else the dtype its bytes are stored as."""
        return logical_dtype(pool, self.kv_cache_dtype)

    def register_mem_pool_host(self, pool: Any) -> None:
        """Attach the host pool whose pages this store reads and writes: a kvtier pool, or an engine's own
        (SGLang's ``MHATokenToKVPoolHost`` / ``AsymmetricMHATokenToKVPoolHost``: contiguous CPU tensors and
        ``get_page_buffer_meta``). Its layout must keep each page's K and V contiguous (``page_first`` or
        ``page_first_direct``); the namespace is derived from it."""
        if self._closed:
            raise ClosedError("PageStore is closed")
        layout = getattr(pool, "layout", None)
        if layout not in PAGE_LAYOUTS:
            raise InvalidArgumentError(
                f"invalid argument `pool`: layout {layout!r} cannot be served zero-copy; supported layouts: "
                + ", ".join(repr(x) for x in PAGE_LAYOUTS)
            )
        regions = [b.region for b in host_buffers(pool)]
        tensors: list[torch.Tensor] = []
        if not regions:
            kv = getattr(pool, "kv_buffer", None)
            tensors = list(kv) if isinstance(kv, (tuple, list)) else [kv]  # type: ignore[list-item]
            if not all(isinstance(t, torch.Tensor) for t in tensors) or not hasattr(pool, "get_page_buffer_meta"):
                raise InvalidArgumentError(
                    "invalid argument `pool`: expected a kvtier host pool or an SGLang MHA host pool "
                    "(kv_buffer tensors and get_page_buffer_meta)"
                )
        page_num = int(getattr(pool, "page_num", None) or pool.size // pool.page_size)
        layout = _page_layout(pool, page_num)
        dtype = self.dtype_of(pool)
        codec = codec_for(dtype) if self.compression != "off" else None
        if self.compression == "lossless" and codec is None:
            raise InvalidArgumentError(f"invalid argument `compression`: 'lossless' compresses bfloat16, float16 and fp8 "
                                       f"KV; this pool's KV is {dtype}")
        with self._lock:
            if self._native is not None:
                self._native.close()
            self._native, self._pool, self._staging = None, pool, None  # (staging of the old geometry: gone)
            self.page_bytes = layout[2] + layout[5]  # K and V object bytes of one page
            self.page_kinds = 1 if layout[5] == 0 else 2
            self._pending = (self.namespace_for(pool), regions, tensors, (*layout, pool.page_size, page_num))
            self.codec = codec
            self.compression_note = (f"pages stored compressed ({codec}, lossless)" if codec else
                                     "pages stored as given: compression is off" if self.compression == "off" else
                                     f"pages stored as given: no codec for {dtype} KV")
            native = self._open_native()
        note = native.direct_note if native is not None else None
        if note and self.direct is None and not native.direct:  # a buffered fallback is worth a warning
            warnings.warn(f"kvtier.PageStore at {self.path}: {note}", RuntimeWarning, stacklevel=2)
        if native is not None and not self.read_only:
            self._probe(layout[2])

    def _probe(self, object_bytes: int) -> None:
        """Seeds the meter with the disk's speed for this pool's objects (see ``probe_bytes``); a probe that
        cannot run (a full or read-only file system) leaves the meter unseeded, never fails the open."""
        if self.probe_bytes <= 0 or object_bytes <= 0 or self.meter.estimate().source != "none":
            return  # (a pool registered again: the disk was measured already)
        size = -(-object_bytes // 4096) * 4096
        count = max(1, self.probe_bytes // size)
        try:
            st = os.statvfs(self.path)
            if st.f_bavail * st.f_frsize < 4 * size * count:
                return
            write, read, _ = _native.disk_roofline(self.path, size, count, min(self.io_threads, count))
        except (OSError, KvtierError, ValueError):
            return
        self.meter.seed(read_GBps=read, write_GBps=write)

    def measured(self) -> dict[str, TierEstimate]:
        """What this tier measured about itself (``{"disk": TierEstimate}``): read and write GB/s and the
        fixed cost of a batch over its recent batches (writes: the bytes the store wrote and the time it
        spent writing since the last reading, so pages already stored, acknowledged without IO, do not count),
        the recent hit rate of lookups; the probe at open until batches have been timed, its read rate times
        what the stored pages decode to per stored byte (compressed pages) until reads have been timed."""
        native = self._native
        st: dict[str, Any] | None = None
        if native is not None and not self._closed:
            try:
                st = native.stats()
                # what the engine's pages hold, coded or not: the rate a restore or a backup sees
                written, ns = int(st["raw_bytes_written"]), int(st["put_ns"])
            except Exception:  # noqa: BLE001 - a store closing meanwhile reports what it had
                written, ns, st = -1, -1, None
            last_written, last_ns = self._writes_seen
            if written > last_written and ns > last_ns >= 0:
                self.meter.observe("write", written - last_written, (ns - last_ns) / 1e9)
            if written >= 0:
                self._writes_seen = (written, ns)
        est = self.meter.estimate()
        if st is not None and est.samples == 0 and est.read_GBps > 0:
            # until reads are timed, the read rate stands for the disk's (the probe's, or what an operator
            # seeded): what the stored pages decode to per byte multiplies it, bounded by the decoding
            # measured so far on the threads a batch reads with
            est = dataclasses.replace(est, read_GBps=effective_read_GBps(est.read_GBps, st, self.io_threads))
        return {self.name: est}

    def locate(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        """The leading run of ``keys`` this tier holds, as ``[(tier, pages)]`` (empty on a miss)."""
        n = self.batch_exists(keys)
        return [(self.name, n)] if n else []

    def _open_native(self) -> Any:
        """Opens the namespace of the registered pool (lock held). A reader whose writer has not created the
        namespace yet gets None, and tries again at most once a second."""
        ns, regions, tensors, bind = self._pending
        try:
            native = _native.PageStore(self.path, ns, self.capacity_bytes, self.io_threads, self.direct, self.read_only,
                                       self.budget_bytes, self.keyring.native if self.keyring is not None else None,
                                       None if self.read_only else self.codec)
        except FileNotFoundError:
            if not self.read_only:
                raise
            self._next_try = time.monotonic() + 1.0
            return None
        try:
            for r in regions:
                native.register_region(r)
            for t in tensors:
                native.register_tensor(t)
            native.bind_pages(*bind)
            for t in sorted(self._erased_tags):  # a tenant erased through this store stays refused here
                native.erase_tenant(t)
            if self._staging is not None:
                self._staging.bind(native)
        except BaseException:
            native.close()
            raise
        self._native = native
        return native

    def stage(self, staging_bytes: int) -> StagingPages:
        """Staging pages of the store's own in the pool's page geometry (about ``staging_bytes``; :mod:`kvtier.staging`);
        registering a pool again makes new ones (another ``generation``)."""
        with self._lock:
            if self._pending is None or self._closed:
                raise KvtierError("PageStore: call register_mem_pool_host(pool) first")
            if self._staging is None:
                self._staging = StagingPages(self._pending[3], staging_bytes)
                if self._native is not None:
                    self._staging.bind(self._native)
            return self._staging

    def _staging_gone(self, generation: int | None) -> bool:  # (under self._lock)
        return generation is not None and getattr(self._staging, "generation", None) != generation

    def batch_staged(self, write: bool, keys: Sequence[str], staging_indices: Any,
                     generation: int | None = None) -> list[bool]:
        """:meth:`batch_set_v1` (``write``) or :meth:`batch_get_v1` of the staging pages at ``staging_indices``;
        all False, nothing moved, when ``generation`` is no longer the staging pages' (a pool registered again)."""
        native = self._reader_store()
        with self._lock:  # (the native store of that generation: a pool registered meanwhile closes it)
            gone = native is None or native is not self._native or self._staging_gone(generation)
        return [False] * len(keys) if gone else self._batch(write, keys, staging_indices, staged=True, native=native)

    def copy_staged(self, to_pool: bool, host_indices: np.ndarray, staging_indices: np.ndarray,
                    generation: int | None = None) -> bool:
        """Copies whole pages from staging pages into the pool (``to_pool``) or back; False, nothing copied,
        when ``generation`` is no longer the staging pages' (a pool registered again)."""
        native = self.native_store()
        with self._lock:  # (a pool registered meanwhile waits for the copy)
            if native is not self._native or self._staging_gone(generation):
                return False
            native_calls.copy_pages(native, to_pool, host_indices, staging_indices)
            return True

    @property
    def lookups_may_block(self) -> bool:
        """A writer's lookups read its index in memory; a reader's may read the writer's journal first."""
        return self.read_only

    @property
    def pool(self) -> Any:
        """The host pool this store reads and writes (``None`` before ``register_mem_pool_host``)."""
        return self._pool

    def native_store(self) -> Any:
        """The open native store (``kvtier._native.PageStore``): for what has no method here, such as
        another object's pages beside this namespace's; raises while it cannot be opened."""
        store = self._reader_store()
        if store is None:
            raise KvtierError(f"PageStore at {self.path}: the namespace does not exist yet (its writer has not "
                              "created it)")
        return store

    def _reader_store(self) -> Any:
        """The native store; None only for a reader whose writer has not created the namespace yet."""
        if self._closed:
            raise ClosedError("PageStore is closed")
        if self._native is None:
            if self._pending is None:
                raise KvtierError("PageStore: call register_mem_pool_host(pool) first")
            with self._lock:
                if self._native is None and time.monotonic() >= self._next_try:
                    self._open_native()
        return self._native

    # ------------------------------------------------------------------ zero-copy v1
    def _batch(self, write: bool, keys: Sequence[str], host_indices: torch.Tensor,
               split: tuple[int, int, Any] | None = None, staged: bool = False, native: Any = None) -> list[bool]:
        """One page batch (``batch_set_v1``/``batch_get_v1``): the store's state, the arguments, one native call."""
        native = self._native if native is None else native  # read once: close() clears it
        store = native if native is not None and not self._closed else self._reader_store()
        keys = _keys(keys) if self.tenant is None else scope_keys(self.tenant, _keys(keys))
        if not (staged and isinstance(host_indices, np.ndarray)) and not (  # (staging slots from a tier thread)
                isinstance(host_indices, torch.Tensor) and host_indices.dtype == torch.int64 and host_indices.dim() == 1):
            raise InvalidArgumentError("invalid argument `host_indices`: expected a 1-D torch.int64 tensor")
        if store is None:
            return [False] * len(keys)
        idx = host_indices if isinstance(host_indices, np.ndarray) else native_calls.indices(host_indices)
        if not keys and not idx.size:
            return []
        t0 = time.perf_counter()
        ok = native_calls.page_batch(store, write, keys, idx, split, staged)
        dt = time.perf_counter() - t0
        self.latency["write" if write else "read"].observe(dt)
        if not write:  # (writes are timed from the store's own counters: a page already stored costs no IO)
            self.meter.observe("read", sum(ok) * self.page_bytes, dt)
        return ok

    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Write the pages at ``host_indices`` (``page_size`` slots per key) under ``keys``; returns per key
        whether the page (K and V) is durably stored. Keys already stored are kept and reported True. An IO
        error (a full disk, a failing device) makes the pages concerned False; it is never raised."""
        return self._batch(True, keys, host_indices)

    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool at ``host_indices``; returns per key whether K and V were found with
        the pool's sizes and their checksums verified (a False page's host bytes are unspecified)."""
        return self._batch(False, keys, host_indices)

    def batch_get_layers_first(self, keys: Sequence[str], host_indices: torch.Tensor, layers: int, first_layers: int,
                               gate: Any = None) -> list[bool]:
        """:meth:`batch_get_v1` in two passes: the first ``first_layers`` of the pool's ``layers`` of each page,
        then ``gate`` (a ``kvtier._native.HostGate``; opened on every path) opens, then the rest; each page is
        checked whole. Whatever a caller makes from the first layers meanwhile goes with a page that comes back
        False. A sealed store, or a pool not ``page_first_direct`` of ``layers`` layers, reads in one pass."""
        pool = self._pool
        try:
            if getattr(pool, "layout", None) != "page_first_direct" or getattr(pool, "layer_num", None) != layers:
                if not (isinstance(layers, int) and isinstance(first_layers, int) and 0 < first_layers < layers):
                    raise InvalidArgumentError(f"invalid argument `first_layers`: {first_layers!r} of {layers!r} layers "
                                               "(expected 0 < first_layers < layers)")
                return self._batch(False, keys, host_indices)
            return self._batch(False, keys, host_indices, (layers, first_layers, gate))
        finally:
            if gate is not None:
                gate.open()

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """Length of the leading run of keys whose page (K and V) is stored."""
        keys = _keys(keys) if self.tenant is None else scope_keys(self.tenant, _keys(keys))
        store = self._reader_store()
        n = int(store.pages_exist(keys)) if store is not None else 0
        self.meter.observe_lookup(n, len(keys))
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def delete(self, keys: Sequence[str]) -> int:
        """Delete pages; returns how many pages had anything stored."""
        return int(self.native_store().delete_pages(_keys(keys) if self.tenant is None else scope_keys(self.tenant, _keys(keys))))

    def erase_tenant(self, salt: str | None = None, *, tag: str | None = None) -> int:
        """Erase one tenant (named by ``salt`` or by ``tag``) from this namespace: its pages' bytes are
        overwritten with zeros, their records deleted and compacted out of the journal, and from then on this
        store refuses the tenant's puts (pages the engine still holds are not written back) until
        :meth:`allow_tenant`. Returns the pages erased (0 for a read-only store: its writer erases). With a
        keyring, :meth:`kvtier.Keyring.erase` also destroys the tenant's key and keeps it erased in every
        process sharing the keyring (``kvtier erase`` does both, for every namespace)."""
        store = self._reader_store()  # registration first, then the arguments
        t = erase_tag(salt, tag)
        if self.read_only or store is None:
            return 0  # a reader erases nothing: the namespace's writer does
        objects = int(store.erase_tenant(t))
        with self._lock:
            self._erased_tags.add(t)
        return -(-objects // self.page_kinds)

    def allow_tenant(self, salt: str | None = None, *, tag: str | None = None) -> bool:
        """Let a tenant erased through this store put pages again; whether it was erased here."""
        store = self.native_store()
        t = erase_tag(salt, tag)
        with self._lock:
            self._erased_tags.discard(t)
        return bool(store.allow_tenant(t))

    def clear(self) -> None:
        """Delete every page of this namespace."""
        self.native_store().clear()

    def get_stats(self) -> dict[str, Any]:
        """Counters: pages and bytes stored, hits, misses, evictions, corrupt reads, write failures, read and
        write throughput (GB/s over the time spent in batches), O_DIRECT status."""
        st = dict(self.native_store().stats())
        st["pages"] = st["objects"] // self.page_kinds
        st["write_GBps"] = st["bytes_written"] / st["put_ns"] if st["put_ns"] else 0.0
        st["read_GBps"] = st["bytes_read"] / st["get_ns"] if st["get_ns"] else 0.0
        st.update(compression_stats(st))
        return st

    def report_metrics(self, scrape: Scrape, name: str) -> tuple[()]:
        """Its counters, gauges and batch latencies (:mod:`kvtier.metrics`; none while closed)."""
        scrape.page_store(self.get_stats, self.latency)
        return ()

    def verify(self, repair: bool = False) -> dict[str, Any]:
        """Re-read every object and check its checksum: ``{"checked", "corrupt", "unreadable"}`` (object keys).
        With ``repair=True`` the corrupt and unreadable objects are deleted and the journal compacted."""
        return dict(self.native_store().verify(repair))

    def close(self) -> None:
        """Release the namespace (and its lock). Idempotent."""
        with self._lock:
            if self._native is not None:
                self._native.close()
            self._native, self._pool, self._closed = None, None, True

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
