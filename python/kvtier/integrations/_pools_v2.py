"""The extra host pools of SGLang's v2 storage interface (hybrid models: SWA KV, Mamba/KDA state, draft KV,
DSA indexer, ...), each stored in a page-store namespace of its own.

A pool's pages are stored as the objects its ``get_page_buffer_meta`` names (zero copy from the pool's own
tensors, which are registered with the store, so every address is checked against them before a byte
moves), ``"{key}.{j}"`` for the j-th object of a page; a pool that offers no zero-copy metadata (a Mamba
pool with slot side state, say) is stored as one flat page per key through a scratch buffer
(``get_data_page`` / ``set_from_flat_data_page``). Which of the two, and each object's size, is part of
the namespace, so a page is only ever read back the way it was written. A page counts as stored only when
every object of it is; a read that finds any object missing or damaged is a miss for the whole page.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from collections.abc import Callable, Sequence

import torch

from .. import _native
from .._errors import ClosedError, InvalidArgumentError, KvtierError
from ..tenants import scope_keys
from ..buffer import HostBuffer
from ..metrics import LatencyHistogram, Scrape
from ..namespace import Namespace


def pool_tensors(pool: Any) -> list[torch.Tensor]:
    """The host tensors a pool's pages live in (what SGLang's Mooncake backend registers):
    ``get_hybrid_pool_buffer()`` where the pool has it, else its ``kv_buffer`` (one tensor or several)."""
    get = getattr(pool, "get_hybrid_pool_buffer", None)
    bufs = list(get()) if callable(get) else [getattr(pool, "kv_buffer", None)]
    out: list[torch.Tensor] = []
    for b in bufs:
        if isinstance(b, (list, tuple)):
            out.extend(x for x in b if isinstance(x, torch.Tensor))
        elif isinstance(b, torch.Tensor):
            out.append(b)
    return [t for t in out if t.numel() > 0]


def pool_geometry(pool: Any) -> str:
    """Every buffer's dtype and shape without its slot axis (the one as long as the pool, so resizing the
    pool keeps the name): two pools whose pages have equal byte sizes but different dtypes or shapes (a bf16
    against an fp16 SSM state) get different namespaces, so neither is ever served the other's bytes."""
    size, pages = int(getattr(pool, "size", -1)), int(getattr(pool, "page_num", -1))
    parts = []
    for t in pool_tensors(pool):
        shape = list(t.shape)
        for i, d in enumerate(shape):
            if d in (size, pages):
                del shape[i]
                break
        parts.append(f"{str(t.dtype).removeprefix('torch.')}{shape}".replace(" ", ""))
    return ";".join(parts)


class PoolStore:
    """One v2 pool's pages in a namespace of their own (see the module docs). ``read_only``: another
    rank writes this namespace (rank-replicated pools of MLA models); it is opened when it exists."""

    def __init__(self, root: str, namespace: str, pool: Any, *, capacity_bytes: int, io_threads: int,
                 direct: Any, read_only: bool, budget_bytes: int | None = None, keyring: Any = None,
                 tenant: str | None = None) -> None:
        self.pool = pool
        self.tenant = tenant  # keys without a tenant of their own become this tenant's (kvtier.tenants)
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.read_only = read_only
        self.size = int(getattr(pool, "size", 0) or 0)
        self._closed = False
        self._lock = threading.Lock()
        self._scratch: HostBuffer | None = None
        self.latency = {"write": LatencyHistogram(), "read": LatencyHistogram()}  # batch durations (kvtier.metrics)
        probe = torch.arange(self.page_size, dtype=torch.int64)
        try:
            ptrs, sizes = pool.get_page_buffer_meta(probe)
            self.sizes = [int(s) for s in sizes]
            self.flat = not self.sizes or any(s <= 0 for s in self.sizes)
        except (NotImplementedError, ValueError, AssertionError, AttributeError):
            self.flat = True
        if self.flat:
            if not hasattr(pool, "get_data_page") or not hasattr(pool, "set_from_flat_data_page"):
                raise InvalidArgumentError(
                    f"invalid argument `host_pool`: {type(pool).__name__} offers neither get_page_buffer_meta nor "
                    "get_data_page/set_from_flat_data_page"
                )
            dummy = pool.get_dummy_flat_data_page()
            self.sizes = [int(dummy.numel() * dummy.element_size())]
        objs = ("flat:" if self.flat else "") + "+".join(map(str, self.sizes))
        self.namespace = Namespace.parse(namespace).with_fields(
            bufs=pool_geometry(pool), objs=objs, sealed=keyring.id if keyring is not None else None).format()
        self._open_args = (root, self.namespace, capacity_bytes, io_threads, direct, read_only, budget_bytes,
                           keyring.native if keyring is not None else None)
        self._native: Any = None
        self._next_try = 0.0
        self._open()
        if self._native is None and not read_only:
            raise KvtierError(f"could not open the page store namespace {self.namespace!r}")

    def _open(self) -> Any:
        try:
            native = _native.PageStore(*self._open_args)
        except FileNotFoundError:
            if not self.read_only:
                raise
            self._next_try = time.monotonic() + 1.0
            return None
        try:
            if self.flat:
                self._scratch = HostBuffer(max(1 << 20, self.sizes[0]), pin=False)
                native.register_region(self._scratch.region)
            else:
                for t in pool_tensors(self.pool):
                    native.register_tensor(t)
        except BaseException:
            native.close()
            raise
        self._native = native
        return native

    def native_store(self) -> Any:
        """The native store; None only for a reader whose writer has not created the namespace yet."""
        with self._lock:
            if self._closed:
                raise ClosedError(f"the v2 pool store {self.namespace!r} is closed")
            if self._native is None and time.monotonic() >= self._next_try:
                self._open()
            return self._native

    # ------------------------------------------------------------------ pages
    def check(self, keys: Sequence[str], host_indices: Any) -> list[int] | None:
        """The first slot of each page, after proving every index is in the pool, page-aligned and consecutive
        within its page (before any byte moves; the flat path hands slots to the pool's own accessors, which
        would wrap a negative index). None when the count does not match the keys (SGLang's backends answer
        that with False for every page)."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dtype != torch.int64 or host_indices.dim() != 1:
            raise InvalidArgumentError("invalid argument `host_indices`: expected a 1-D torch.int64 tensor")
        h = host_indices.detach().to("cpu")
        ps = self.page_size
        if h.numel() != len(keys) * ps:
            return None
        if h.numel() == 0:
            return []
        lo, hi = int(h.min()), int(h.max())
        if lo < 0 or (self.size and hi >= self.size):
            raise InvalidArgumentError(f"invalid argument `host_indices`: slots must be in [0, {self.size}), got "
                                       f"{lo if lo < 0 else hi}")
        pages = h.reshape(-1, ps)
        starts = pages[:, 0]
        if bool((starts % ps != 0).any()) or not torch.equal(pages, starts[:, None] + torch.arange(ps)):
            raise InvalidArgumentError(f"invalid argument `host_indices`: each page's {ps} slots must be "
                                       "consecutive from a multiple of the page size")
        return starts.tolist()

    def _objects(self, keys: Sequence[str], host_indices: torch.Tensor):
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        m = len(self.sizes)
        if len(ptrs) != m * len(keys) or [int(s) for s in sizes] != self.sizes * len(keys):
            raise InvalidArgumentError(
                f"invalid argument `host_pool`: get_page_buffer_meta gave {len(ptrs)} objects of sizes "
                f"{list(sizes)[:m]}..., expected {m} per page of sizes {self.sizes}"
            )
        names = [f"{k}.{j}" for k in keys for j in range(m)]
        return names, [int(p) for p in ptrs], self.sizes * len(keys)

    @staticmethod
    def _per_page(ok: Sequence[bool], m: int) -> list[bool]:
        return [all(ok[i * m:(i + 1) * m]) for i in range(len(ok) // m)]

    def set(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        keys = scope_keys(self.tenant, keys)
        starts = self.check(keys, host_indices)
        if self.read_only:
            return [True] * len(keys)  # the writer rank stores the replicated pages
        store = self.native_store()
        if starts is None or store is None or not keys:
            return [False] * len(keys)
        if self.flat:
            return self._flat(store, keys, starts, self._put_flat)
        names, ptrs, sizes = self._objects(keys, host_indices)
        t0 = time.perf_counter()
        ok = store.put(names, ptrs, sizes)
        self.latency["write"].observe(time.perf_counter() - t0)
        return self._per_page(ok, len(self.sizes))

    def get(self, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        keys = scope_keys(self.tenant, keys)
        starts = self.check(keys, host_indices)
        store = self.native_store()
        if starts is None or store is None or not keys:
            return [False] * len(keys)
        if self.flat:
            return self._flat(store, keys, starts, self._get_flat)
        names, ptrs, sizes = self._objects(keys, host_indices)
        t0 = time.perf_counter()
        ok = store.get(names, ptrs, sizes)
        self.latency["read"].observe(time.perf_counter() - t0)
        return self._per_page(ok, len(self.sizes))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = scope_keys(self.tenant, keys)
        store = self.native_store()
        if store is None or not keys:
            return [False] * len(keys)
        if self.flat:
            return list(store.exists([f"{k}.flat" for k in keys]))
        m = len(self.sizes)
        return self._per_page(store.exists([f"{k}.{j}" for k in keys for j in range(m)]), m)

    # ------------------------------------------------------------------ flat pages (no zero-copy metadata)
    def _flat(self, store: Any, keys: Sequence[str], starts: Sequence[int], op: Callable) -> list[bool]:
        with self._lock:  # one scratch buffer per store
            return [op(store, k, s) for k, s in zip(keys, starts)]

    def _put_flat(self, store: Any, key: str, start: int) -> bool:
        n = self.sizes[0]
        page = self.pool.get_data_page(start, flat=True).contiguous().view(torch.uint8).reshape(-1)
        if page.numel() != n:
            return False
        assert self._scratch is not None
        self._scratch.as_tensor(torch.uint8, (n,)).copy_(page)
        return bool(store.put([f"{key}.flat"], [self._scratch.ptr], [n])[0])

    def _get_flat(self, store: Any, key: str, start: int) -> bool:
        n = self.sizes[0]
        assert self._scratch is not None
        if not store.get([f"{key}.flat"], [self._scratch.ptr], [n])[0]:
            return False
        self.pool.set_from_flat_data_page(start, self._scratch.as_tensor(torch.uint8, (n,)).clone())
        return True

    def clear(self) -> None:
        store = self.native_store()
        if store is not None and not self.read_only:
            store.clear()

    def erase_tenant(self, tag: str) -> int:
        """Erase tenant ``tag`` from a writer's namespace (bytes overwritten, names compacted away, its puts
        refused from then on); returns how many objects it had."""
        store = self.native_store()
        if store is None or self.read_only:
            return 0
        return int(store.erase_tenant(tag))

    def report_metrics(self, scrape: Scrape, name: str) -> tuple[()]:
        """Its namespace's counters and batch latencies (:mod:`kvtier.metrics`); none while closed or while a
        reader's writer has not created the namespace."""
        scrape.page_store(self._native_stats, self.latency)
        return ()

    def _native_stats(self) -> dict[str, Any] | None:
        native = self.native_store()
        return dict(native.stats()) if native is not None else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._native is not None:
                self._native.close()
                self._native = None
            if self._scratch is not None:
                self._scratch.close()
                self._scratch = None
