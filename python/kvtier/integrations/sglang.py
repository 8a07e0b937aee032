"""kvtier as an SGLang HiCache L3 storage backend (``--hicache-storage-backend dynamic``).

    --enable-hierarchical-cache --hicache-mem-layout page_first_direct --hicache-io-backend direct
    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.integrations.sglang", "class_name": "KvtierStorage", "interface_v1": 1,
        "path": "/nvme/kvtier", "capacity_bytes": 549755813888}'

Importable only where ``sglang`` is installed; kvtier itself does not depend on it. Pages move zero-copy
between SGLang's host pool (``get_page_buffer_meta``) and the disk, one object for K and one for V, so
models whose K and V head dims differ (MiMo-V2) work — SGLang's own file backend refuses them.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from .._errors import InvalidArgumentError
from .._paths import default_store_dir, volatile_warning
from ..buffer import HostBuffer
from ..config import parse_size
from ..deadlines import check_deadline
from ..metrics import MetricsSource, Scrape
from ..namespace import Namespace, Ranks, rank_fields
from ..metrics_server import DEFAULT_HOST, MetricsEndpoint
from ..staging import DEFAULT_STAGING_BYTES, StagedDisk, StagedIO, auto_read_deadline_s
from ..store import DEFAULT_CAPACITY, PageStore
from ..tenants import erase_tag, open_keyring
from ..tier import TIERS, TierContext, build_tiers, check_tier_chain, check_tier_spec
from ._engine_planner import EnginePlanner
from ._pools_v2 import PoolStore

#: v2 pools whose pages every TP rank holds its own shard of, even in a model whose KV is rank-replicated
#: (SGLang writes them from every rank; the other extra pools of an MLA model only from the writer rank).
RANK_SHARDED_POOLS = {"mamba"}

#: Options read from ``--hicache-storage-backend-extra-config`` (with defaults).
OPTIONS: dict[str, Any] = {
    # the store's root directory (one namespace per model/rank/pool geometry); None: default_store_dir("hicache"),
    # $XDG_CACHE_HOME/kvtier/hicache or ~/.cache/kvtier/hicache (a disk, kept across reboots)
    "path": None,
    # the disk budget of the whole `path` directory — every rank, extra pool and model in it together —
    # LRU-evicted; bytes or "512G"
    "capacity_bytes": DEFAULT_CAPACITY,
    "io_threads": 16,  # IO requests in flight per batch
    "direct": None,  # None: O_DIRECT if the file system allows it (warns otherwise); False: buffered
    "kv_cache_dtype": None,  # the --kv-cache-dtype of an fp8 cache (SGLang's host pools hold fp8 as uint8)
    # the tiers in order: "disk", then any tiers of kvtier.tier.TIERS behind it, each a name or {name: {options}}:
    # ["disk"], ["disk", "mooncake"] (the cluster tier, kvtier.tiers) or ["disk", {"mooncake": {...}}]
    "tiers": ["disk"],
    "mooncake": None,  # the cluster tier's options (MOONCAKE_OPTIONS), with "tiers": ["disk", "mooncake"]
    # batch_exists answers with the leading pages worth loading (kvtier.integrations._engine_planner):
    # SGLang recomputes the rest instead of waiting on a tier measured slower than its prefill
    "restore_planner": True,
    "prefill_tokens_per_s": None,  # the engine's prefill throughput for this model (default: a fast engine)
    # a per-deployment tenant salt: every page key of this server becomes that tenant's in every tier (SGLang
    # already scopes a request's storage keys by its cache_salt, but never tells the backend the salt)
    "tenant": None,
    # a keyring directory (`kvtier keys init DIR`): seal every page at rest on the disk and in the cluster
    "keyring": None,
    # deadlines (docs/OPERATIONS.md, "When a tier stalls"): a read batch answers by then with the pages that
    # arrived ("auto": SGLang's own prefetch timeout rule for the batch's tokens; null: none, zero copy), a
    # written piece that makes no progress for write_deadline_s is False; pages move through staging_bytes of
    # kvtier's memory, so IO past its deadline never lands in a page SGLang has given to someone else
    "read_deadline_s": "auto",
    "write_deadline_s": 2.0,
    "staging_bytes": DEFAULT_STAGING_BYTES,
    # kvtier's Prometheus families on http://metrics_host:port/metrics (kvtier.metrics_server); null: off, 0: a
    # free port (logged), N: N + the rank's index; "0.0.0.0" exposes it to every network
    "metrics_port": None,
    "metrics_host": DEFAULT_HOST,
}
#: Options of the ``"mooncake"`` object (see :class:`kvtier.tiers.mooncake.MooncakeTier`): its registered spec's.
MOONCAKE_OPTIONS = TIERS["mooncake"].options
#: Keys SGLang itself reads from the extra config; accepted and ignored here.
SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "interface_v2", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
               "tp_lcm_size"}


class KvtierStorage(HiCacheStorage):
    """HiCache storage backend over :class:`kvtier.PageStore`. Constructed by SGLang as
    ``KvtierStorage(storage_config, kwargs)``."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - set(OPTIONS) - SGLANG_KEYS)
        if unknown:
            raise InvalidArgumentError(
                f"invalid argument `extra_config`: unknown key(s) {unknown}; kvtier accepts "
                f"{sorted(OPTIONS)} and SGLang's own {sorted(SGLANG_KEYS)}"
            )
        opts = {k: extra.get(k, v) for k, v in OPTIONS.items()}
        self._remote = _tier_specs(opts["tiers"], opts["mooncake"])
        if self._remote and (getattr(storage_config, "dcp_size", 1) or 1) > 1:
            names = [n for n, _ in self._remote]
            raise InvalidArgumentError(f"invalid argument `tiers`: the tiers behind the disk ({names}) do not support "
                                       "decode context parallelism (dcp_size > 1) yet; use \"tiers\": [\"disk\"]")
        self.storage_config = storage_config
        self.is_mla = bool(storage_config.is_mla_model)
        # Rank-replicated KV (MLA): every rank reads the same pages, one rank writes them.
        writer = getattr(storage_config, "is_storage_writer", None)
        self.is_writer = bool(writer) if writer is not None else (not self.is_mla or storage_config.tp_rank == 0)
        tp_rank, tp_size = (0, 1) if self.is_mla else (storage_config.tp_rank, storage_config.tp_size)
        self._opts = opts
        self.planner = EnginePlanner(opts["restore_planner"], opts["prefill_tokens_per_s"])
        self._pools: dict[str, PoolStore] = {}  # the v2 interface's extra pools, by name
        path = default_store_dir("hicache") if opts["path"] is None else os.path.expanduser(str(opts["path"]))
        note = volatile_warning(path, "path")
        if note is not None:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        budget = parse_size("capacity_bytes", opts["capacity_bytes"], 4096)
        read_deadline = check_deadline("read_deadline_s", opts["read_deadline_s"], auto=True)
        write_deadline = check_deadline("write_deadline_s", opts["write_deadline_s"])
        staging = parse_size("staging_bytes", opts["staging_bytes"], 4096)
        # the metrics endpoint (one process per rank: port + tp + tp_size * (pp + pp_size * (cp + cp_size * dp)))
        # takes its port before anything is opened: a busy one is an error that costs nothing
        c, cps = storage_config, getattr(storage_config, "attn_cp_size", 1) or 1
        rank = c.tp_rank + c.tp_size * (c.pp_rank + c.pp_size * ((getattr(c, "attn_cp_rank", 0) or 0)
                                                                 + cps * (getattr(c, "dp_rank", 0) or 0)))
        self.metrics_endpoint = MetricsEndpoint.claim(opts["metrics_port"], opts["metrics_host"], offset=rank)
        try:
            self._open(opts, path, budget, tp_rank, tp_size, read_deadline, write_deadline, staging)
        except BaseException:
            self.metrics_endpoint.close()
            raise
        self.metrics_endpoint.attach(self)

    def _open(self, opts: dict[str, Any], path: str, budget: int, tp_rank: int, tp_size: int, read_deadline: Any,
              write_deadline: Any, staging: int) -> None:
        storage_config = self.storage_config
        self.keyring = open_keyring(opts["keyring"])
        self.store = PageStore(
            path,
            capacity_bytes=budget,
            budget_bytes=budget,  # every namespace of the directory, in every rank's process, shares it
            model_name=(storage_config.model_name or "default") + ("|mla" if self.is_mla else ""),
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            cp_rank=getattr(storage_config, "attn_cp_rank", 0),
            cp_size=getattr(storage_config, "attn_cp_size", 1),
            dp_rank=getattr(storage_config, "dp_rank", 0) or 0,
            dcp_rank=getattr(storage_config, "dcp_rank", 0) or 0,
            dcp_size=getattr(storage_config, "dcp_size", 1) or 1,
            io_threads=int(opts["io_threads"]),
            direct=opts["direct"],
            # the ranks that do not write replicated (MLA) pages read the writer's namespace, following it
            read_only=not self.is_writer,
            kv_cache_dtype=opts["kv_cache_dtype"],
            keyring=self.keyring,
            tenant=opts["tenant"],
        )
        # the v1 batches with deadlines, through staging pages (kvtier.staging)
        self.staged = StagedIO(self.store, read_deadline_s=read_deadline, write_deadline_s=write_deadline,
                               staging_bytes=staging, name="sglang")
        self.tiers: Any = None  # the disk store and the tiers behind it in order, once the KV pool is registered
        self._v1: Any = self.store  # what the v1 batches go to: the page store, or that chain
        # One scratch buffer per calling thread (a shared one let a concurrent set store another page's
        # bytes under its key); all of them are registered with the store and closed with it.
        self._local = threading.local()
        self._scratches: list[HostBuffer] = []
        self._scratch_lock = threading.Lock()  # guards the list and close()
        # --enable-metrics: per-batch pages and GB/s, drained by get_stats() (SGLang calls it every step)
        self.enable_storage_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []}
        self._metrics_lock = threading.Lock()

    # -- registration ---------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The KV pool (the anchor). SGLang's ``HostPoolGroup`` of a hybrid model is accepted too: its anchor
        is the KV pool and its other entries are registered as v2 pools."""
        anchor = getattr(mem_pool_host, "anchor_entry", None)
        if anchor is not None and hasattr(mem_pool_host, "entries"):
            self.register_mem_pool_host(anchor.host_pool)
            for entry in mem_pool_host.entries:
                if entry is not anchor:
                    self.register_mem_host_pool_v2(entry.host_pool, entry.name)
            return
        super().register_mem_pool_host(mem_pool_host)
        self.store.register_mem_pool_host(mem_pool_host)
        self.staged.prepare()
        if self._remote:
            self._attach_tiers(mem_pool_host)

    def _attach_tiers(self, pool: Any) -> None:
        """host -> local disk (durable) -> the tiers behind it (Mooncake, ...): the chain the v1 batches go
        through, each tier built by name (:func:`kvtier.tier.build_tier`) against this rank's context."""
        from ..tiers import TieredStore

        self._close_tiers()
        cfg = self.storage_config
        tp = (0, 1) if self.is_mla else (cfg.tp_rank, cfg.tp_size)
        context = TierContext(model_name=cfg.model_name or "default", ranks=Ranks(
            tp_rank=tp[0], tp_size=tp[1], pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
            cp_rank=getattr(cfg, "attn_cp_rank", 0) or 0, cp_size=getattr(cfg, "attn_cp_size", 1) or 1,
            dcp_size=getattr(cfg, "dcp_size", 1) or 1), keyring=self.keyring, tenant=self._opts["tenant"],
            kv_cache_dtype=self._opts["kv_cache_dtype"])
        staged = self.staged.read_deadline_s is not None or self.staged.write_deadline_s is not None
        # with deadlines the tiers behind the disk read into and write from the staging pages (kvtier.staging)
        staging = self.staged.staging_pool() if staged else None
        remotes = build_tiers(self._remote, context, staging if staging is not None else pool)
        # ranks that do not write replicated (MLA) pages read the writer's disk namespace: nothing to fill
        first = StagedDisk(self.store, staging) if staging is not None else self.store
        names = [n for n, _ in self._remote]
        self.tiers = TieredStore([("disk", first), *zip(names, remotes)], fill=self.is_writer)
        self.staged.use_tier(self.tiers if staging is not None else None, staging)
        self._v1 = self.tiers

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """An extra pool of a hybrid model (SWA KV, Mamba state, draft KV, indexer, ...): stored in a namespace
        of its own (see :mod:`kvtier.integrations._pools_v2`). ``kv`` is the anchor, already registered."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _pool_name(host_pool_name)
        if name == "kv":
            return
        cfg = self.storage_config
        sharded = name in RANK_SHARDED_POOLS or not self.is_mla
        tp = (cfg.tp_rank, cfg.tp_size) if sharded else (0, 1)
        # (a KV pool's logical dtype, as the anchor's; a state pool's own: its buffers are named in full below)
        dtype = str(getattr(host_pool, "dtype", "")).removeprefix("torch.") if name in RANK_SHARDED_POOLS \
            else self.store.dtype_of(host_pool)
        ns = Namespace.build("kvtier-v1", model=str(self.store.model_name),
                             **rank_fields(self.store.ranks, tp=tp), pool=name, dtype=str(dtype),
                             layout=str(getattr(host_pool, "layout", None)),
                             page=str(getattr(host_pool, "page_size", 1))).format()
        old = self._pools.pop(name, None)
        if old is not None:  # a pool registered again: its namespace's lock must be free for the new store
            old.close()
        self._pools[name] = PoolStore(self.store.path, ns, host_pool, capacity_bytes=self.store.capacity_bytes,
                                      budget_bytes=self.store.budget_bytes,
                                      io_threads=int(self._opts["io_threads"]), direct=self._opts["direct"],
                                      read_only=not sharded and not self.is_writer, keyring=self.keyring,
                                      tenant=self._opts["tenant"])

    # -- v2 (hybrid models) ----------------------------------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        """The longest KV prefix every extra pool can serve, by each pool's hit policy (SGLang's rules:
        ``all_pages``: every page of the prefix; ``trailing_pages``: the last ``len(keys)`` pages of it)."""
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransferResult

        kv_pages = self._worth_loading(self.store, keys, extra_info)
        hits: dict = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            present = self._pool(t.name).exists(keys[:kv_pages])
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                ok = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys) if t.keys else 1)
                ok = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window):n])}
                boundary = max(ok, default=0)
            else:
                raise InvalidArgumentError(f"invalid argument `pool_transfers`: hit policy {t.hit_policy!r} of pool "
                                           f"{_pool_name(t.name)!r} is not supported by kvtier")
            if boundary:
                hits[t.name] = boundary
            restorable &= ok
        return PoolTransferResult(max(restorable, default=0), hits, sorted(restorable))

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None) -> dict:
        return self._batch_v2(transfers, setting=False)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None) -> dict:
        return self._batch_v2(transfers, setting=True)

    def _batch_v2(self, transfers: list[Any], setting: bool) -> dict:
        """Every transfer is checked (its pool registered, its indices in range) before any byte moves; the
        anchor's pages (``kv``) go first, through v1, whose indices the core checks before its own IO."""
        checked: list[tuple[int, Any, list[str], PoolStore | None]] = []
        for t in transfers:
            keys = list(t.keys or [])
            if _pool_name(t.name) == "kv":
                checked.append((0, t, keys, None))
            else:
                extra = self._pool(t.name)
                if t.host_indices is not None:
                    extra.check(keys, t.host_indices)
                checked.append((1, t, keys, extra))
        out: dict = {}
        misses = self.staged.io.stats.deadline_misses
        before = sum(misses.values())
        for _, t, keys, pool in sorted(checked, key=lambda c: c[0]):
            # the extra pools' pages wait on the disk (only the KV pool's batches are staged): none are sent
            # while the disk is out of use or once this call's KV batch missed its deadline
            stalled = self.staged.breaker.state == "open" or sum(misses.values()) > before
            if t.host_indices is None or (pool is not None and stalled):
                out[t.name] = [False] * len(keys)
            elif pool is None:
                out[t.name] = (self.batch_set_v1 if setting else self.batch_get_v1)(keys, t.host_indices)
            else:
                out[t.name] = pool.set(keys, t.host_indices) if setting else pool.get(keys, t.host_indices)
        return out

    def _pool(self, name: Any) -> PoolStore:
        pool = self._pools.get(_pool_name(name))
        if pool is None:
            raise InvalidArgumentError(f"invalid argument `pool_transfers`: pool {_pool_name(name)!r} was never "
                                       f"registered (register_mem_host_pool_v2); registered: {sorted(self._pools)}")
        return pool

    # -- zero-copy v1 ---------------------------------------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        t0 = time.perf_counter()
        if self.tiers is None or self.staged.staged_tier is not None:
            deadline = self.staged.read_deadline_s
            if deadline == "auto":
                o = self.storage_config.extra_config or {}
                deadline = auto_read_deadline_s(len(keys), self.store.pool.page_size if self.store.pool else 1,
                                                float(o.get("prefetch_timeout_base", 2.0)),
                                                float(o.get("prefetch_timeout_per_ki_token", 0.1)))
            ok = self.staged.get(keys, host_indices, deadline)
        else:
            ok = self._v1.batch_get_v1(keys, host_indices)
        self._record("prefetch", ok, time.perf_counter() - t0)
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        if not self.is_writer:
            return [True] * len(keys)  # another rank writes the replicated pages
        t0 = time.perf_counter()
        staged = self.tiers is None or self.staged.staged_tier is not None
        ok = self.staged.set(keys, host_indices) if staged else self._v1.batch_set_v1(keys, host_indices)
        self._record("backup", ok, time.perf_counter() - t0)
        return ok

    def _record(self, kind: str, ok: list[bool], seconds: float) -> None:
        """Pages moved by one batch and their GB/s (GiB as SGLang's own backends count), for get_stats()."""
        if not self.enable_storage_metrics or not ok:
            return
        pages = sum(ok)
        gbps = pages * self.store.page_bytes / (1 << 30) / seconds if seconds > 0 else 0.0
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(gbps)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The leading run of ``keys`` stored, cut to the pages worth loading: reading them must be predicted
        faster than SGLang computing them (after the ``prefix_keys`` SGLang passes, when it passes them), by
        the tiers' measured speeds (``"restore_planner": false`` turns this off)."""
        return self._worth_loading(self._v1, keys, extra_info)

    def _worth_loading(self, tiers: Any, keys: list[str], extra_info: Any) -> int:
        if self.staged.breaker.state == "open":
            return 0  # the disk keeps missing its deadlines: nothing is promised until it answers again
        if not self.planner.enabled:
            return int(tiers.batch_exists(keys))
        prefix = getattr(extra_info, "prefix_keys", None) or []
        return self.planner.worth_loading(tiers.locate(keys), context_pages=len(prefix),
                                          page_tokens=self.store.pool.page_size, page_bytes=self.store.page_bytes,
                                          tiers=tiers.measured())

    def exists(self, key: str) -> bool:
        return bool(self._v1.exists(key))

    # -- flat-page interface (symmetric pools; a copy through a pinned scratch buffer) -------------------
    def _scratch_for(self, nbytes: int) -> HostBuffer:
        """This thread's scratch buffer, at least ``nbytes`` (grown by replacement; the old one stays
        registered and open until close(), so a store call still using it cannot lose its memory)."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.nbytes < nbytes:
            buf = HostBuffer(max(nbytes, 1 << 20), pin=False)
            with self._scratch_lock:
                self.store.native_store().register_region(buf.region)
                self._scratches.append(buf)
            self._local.scratch = buf
        return buf

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if not self.is_writer:
            return True
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentError("invalid argument `value`: expected a torch.Tensor (a flat page)")
        raw = value.detach().contiguous().view(torch.uint8).reshape(-1).cpu()
        buf = self._scratch_for(raw.numel())
        buf.as_tensor(torch.uint8, (raw.numel(),)).copy_(raw)
        return self.store.native_store().put([f"{key}.flat"], [buf.ptr], [raw.numel()])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        return all(self.set(k, v) for k, v in zip(keys, values))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        if not isinstance(target_location, torch.Tensor):
            raise InvalidArgumentError("invalid argument `target_location`: expected the destination flat-page tensor")
        dst = target_location.view(torch.uint8).reshape(-1)
        buf = self._scratch_for(dst.numel())
        if not self.store.native_store().get([f"{key}.flat"], [buf.ptr], [dst.numel()])[0]:
            return None
        dst.copy_(buf.as_tensor(torch.uint8, (dst.numel(),)))
        return target_location

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        return [self.get(k, t) for k, t in zip(keys, target_locations)]

    # -- housekeeping ---------------------------------------------------------------------------------
    def erase_tenant(self, salt: str | None = None, *, tag: str | None = None) -> int:
        """Remove one tenant's pages (the deployment's ``tenant``, or keys kvtier.page_hashes salted) from
        the disk, the cluster tier and the extra pools; returns what they report removed."""
        t = erase_tag(salt, tag)
        return int(self._v1.erase_tenant(tag=t)) + sum(p.erase_tenant(t) for p in self._pools.values())

    def clear(self) -> None:
        self.store.clear()
        for pool in self._pools.values():
            pool.clear()

    def get_stats(self):
        """SGLang's storage metrics (``--enable-metrics``): a ``StorageMetrics`` with the pages and GB/s of
        each batch since the last call, drained — what SGLang's collector asserts and reads every step.
        kvtier's own counters (hits, corruption, evictions, capacity, ...) are :meth:`kvtier_stats`."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._metrics_lock:
            for name, values in self._metrics.items():
                getattr(m, name).extend(values)
                values.clear()
        return m

    def kvtier_stats(self) -> dict:
        """The page store's counters (:meth:`kvtier.PageStore.get_stats`); with the cluster tier, the chain's per
        tier (hits, misses, fills, writes, errors, bytes, GB/s; each tier's own counters under ``"store"``)."""
        st = self.tiers.get_stats() if self.tiers is not None else self.store.get_stats()
        st["restore_planner"] = self.planner.stats.as_dict()
        st["deadlines"] = self.staged.stats()
        return st

    @property
    def pool_stores(self) -> tuple[PoolStore, ...]:
        """The stores of the extra pools registered through the v2 interface (one namespace each)."""
        return tuple(self._pools.values())

    def measured(self) -> dict[str, Any]:
        """What the tiers behind the v1 batches measured about themselves (the page store's, or the chain's)."""
        return dict(self._v1.measured())

    def report_metrics(self, scrape: Scrape, name: str) -> list[MetricsSource]:
        """Its restore decisions and store calls, labelled ``name`` (kvtier.metrics); its stores report theirs."""
        scrape.planner(name, self.planner.stats.as_dict(), self.measured)
        scrape.deadlines({"backend": name}, self.staged.stats)
        return [self.store, *self.pool_stores, *([self.tiers] if self.tiers is not None else [])]

    def _close_tiers(self) -> None:
        """Closes the tiers behind the disk (the disk store is closed with the backend)."""
        if self.tiers is not None:
            for _, tier in self.tiers.tiers[1:]:
                tier.close()

    def close(self) -> None:
        self.metrics_endpoint.close()  # first: a scrape no longer reads what closes
        self._close_tiers()
        self.staged.close()
        self.store.close()
        for pool in self._pools.values():
            pool.close()
        self._pools = {}
        with self._scratch_lock:
            for buf in self._scratches:
                buf.close()
            self._scratches = []


def _tier_specs(tiers: Any, mooncake: Any) -> list[tuple[str, dict[str, Any]]]:
    """The tiers behind the disk, each ``(name, options)``, checked before anything is opened (``[]``: the
    disk alone). ``"mooncake"`` by name takes its options from the ``"mooncake"`` key."""
    if not isinstance(tiers, (list, tuple)) or not tiers:
        raise InvalidArgumentError(f"invalid argument `tiers`: expected a list of tiers, got {tiers!r}")
    if tiers[0] != "disk":
        raise InvalidArgumentError(f'invalid argument `tiers`: {list(tiers)!r}; the first is "disk" (the tiers '
                                   "behind it are caches of the durable local disk: acknowledgements come from "
                                   "the disk)")
    if mooncake is not None and "mooncake" not in tiers:
        raise InvalidArgumentError('invalid argument `mooncake`: given, but `tiers` does not list "mooncake" '
                                   '(use "tiers": ["disk", "mooncake"])')
    if "mooncake" not in tiers:
        return check_tier_chain(list(tiers[1:]), "tiers")
    if not isinstance(mooncake, dict) or "master_server_address" not in mooncake:
        raise InvalidArgumentError('invalid argument `mooncake`: with "tiers": ["disk", "mooncake"] give '
                                   '{"master_server_address": "host:port", ...}')
    check_tier_spec({"mooncake": mooncake}, "mooncake")  # (its keys named as `mooncake`'s)
    return check_tier_chain([{"mooncake": mooncake} if s == "mooncake" else s for s in tiers[1:]], "tiers")


def _pool_name(name: Any) -> str:
    """A pool's name as a plain string (SGLang passes ``PoolName`` members, a ``str`` enum)."""
    return str(getattr(name, "value", name))
