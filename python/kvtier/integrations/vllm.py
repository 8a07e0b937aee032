"""kvtier as a secondary tier behind vLLM's CPU KV offloading tier (vLLM 0.33, ``TieringOffloadingSpec``).

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 34359738368,
          "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.integrations.vllm",
                               "path": "/nvme/kvtier", "capacity_bytes": 549755813888}]}}'

vLLM's factory builds :class:`KvtierTier` in the scheduler process with a memoryview over the rows of its CPU
tier (one row = one offloaded chunk of every worker's KV, ``num_chunks x row_bytes``). The tier stores a row
as one object of a :class:`kvtier.PageStore` namespace, written from and read into that memory directly
(O_DIRECT where the file system allows it), and reports a store job successful only once every row of it is
durable; every read is checksum-verified, so a damaged or missing row is a failed load (vLLM recomputes it),
never a wrong byte. The namespace names the model, KV dtype, block and chunk sizes, layer layout and parallel
layout (see :func:`namespace`), so a row is only ever served to the configuration that wrote it.

Importable only where ``vllm`` is installed; kvtier itself does not depend on it. Built and tested against
vLLM 0.33.0 (the secondary-tier API is experimental upstream).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch
import vllm
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from .._errors import ClosedError, InvalidArgumentError
from .._paths import volatile_warning
from ..metrics import MetricsSource, Scrape
from ..metrics_server import MetricsEndpoint
from ..namespace import Namespace
from ..staging import StagedIO, auto_read_deadline_s
from ..store import PageStore
from ._engine_planner import EnginePlanner
from ._vllm_options import (  # noqa: F401 - OPTIONS, VLLM_KEYS: documented here
    OPTIONS,
    SECURE_HASH_BYTES,
    VLLM_KEYS,
    VLLM_VERSION,
    check_view,
    offloading_config,
    parse_options,
)

logger = init_logger(__name__)


def _digest(parts: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def namespace(config: OffloadingConfig, row_bytes: int, tag: str | None = None) -> str:
    """The page-store namespace of the rows of ``config`` (rows of ``row_bytes``): model, KV dtype (vLLM's
    cache dtype: fp8 variants differ), tokens per hash, blocks per chunk, every KV cache group (its id,
    tokens per block, sliding window and layer names), a worker's bytes per block, the row size, the KV
    cache layout, the canonical and replicated layout flags, the parallel layout (world, TP, PP, PCP and
    DCP sizes — a row holds every worker's pages in rank order), the tier's rank and the DP replica; and
    ``tag``. Any difference is another namespace, so a row is never served to a configuration that did not
    write it."""
    p = config.parallel
    groups = ",".join(
        f"{g.group_id}:{g.tokens_per_block}:{g.sliding_window_size_in_chunks}:{len(g.layer_names)}:"
        f"{_digest(g.layer_names)}"
        for g in config.groups
    )
    return Namespace.build(
        "kvtier-vllm-v1", model=str(config.model.name), dtype=str(config.model.dtype), tag=tag or "",
        tokens_per_hash=str(config.cache.tokens_per_hash), blocks_per_chunk=str(config.cache.blocks_per_chunk),
        groups=groups, worker_block_bytes=str(config.worker_kv_bytes_per_block), row=str(row_bytes),
        kv_layout=str(config.kv_cache_layout),
        canonical=int(config.canonical_layout), canonical_format=_canonical_id(config),
        replicated=int(config.replicated_layout),
        **{k: str(v) for k, v in (("world", p.world_size), ("tp", p.tp_size), ("pp", p.pp_size), ("pcp", p.pcp_size),
                                  ("dcp", p.dcp_size), ("rank", p.rank), ("dp", p.data_parallel_index))}).format()


def _canonical_id(config: OffloadingConfig) -> str | None:
    """vLLM's canonical row format id (``v{version}-{family}``) when rows are canonical: a vLLM that changes
    the canonical format gets another namespace."""
    if not config.canonical_layout:
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id

    return str(canonical_format_id(config.kv_cache_layout))


class _Rows:
    """vLLM's CPU-tier rows seen as a page-first host pool of one-slot pages with one object each (the
    shape :class:`PageStore` stores, as it does an MLA pool's latent pages): page ``i`` is row ``i``."""

    layout = "page_first"
    page_size = 1
    dtype = torch.uint8

    def __init__(self, rows: torch.Tensor) -> None:
        self.kv_buffer = rows
        self.size = self.page_num = int(rows.shape[0])
        self.row_bytes = int(rows.shape[1])
        self._base = int(rows.data_ptr())

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        idx = [int(i) for i in indices.tolist()]
        return [self._base + i * self.row_bytes for i in idx], [self.row_bytes] * len(idx)


class _RowStore(PageStore):
    """A :class:`PageStore` whose namespace is :func:`namespace`'s (not derived from a HiCache pool)."""

    def __init__(self, path: str, ns: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._namespace = Namespace.parse(ns).with_fields(
            sealed=self.keyring.id if self.keyring is not None else None).format()

    def namespace_for(self, pool: Any) -> str:
        return self._namespace

    def release(self) -> None:
        """Close, and drop every reference to the rows (vLLM releases its memoryview after the tiers)."""
        self.close()
        self._pending = None


class KvtierTier(SecondaryTierManager):
    """vLLM secondary tier over :class:`kvtier.PageStore`; built by vLLM's ``SecondaryTierFactory`` from a
    ``secondary_tiers`` entry ``{"type": "KvtierTier", "module_path": "kvtier.integrations.vllm", "path":
    ..., ...}`` (options: :data:`OPTIONS`). Every option and the primary view are checked before the store
    is opened; a bad one raises :class:`kvtier.InvalidArgumentError` (a ``ValueError``) naming it.

    Jobs run on two threads of the tier's own (one for loads, so a promotion never waits behind a store,
    one for stores); each batch is one call into kvtier's core with ``io_threads`` requests in flight."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **config: Any,
    ) -> None:
        opts = parse_options(config)
        self.num_rows, self.row_bytes = check_view(primary_kv_view)
        cfg = offloading_config(offloading_spec)
        if opts["capacity_bytes"] < 2 * self.row_bytes:
            raise InvalidArgumentError(
                f"invalid argument `capacity_bytes` (kvtier tier): {opts['capacity_bytes']} cannot hold two rows of "
                f"vLLM's CPU tier ({self.row_bytes} bytes each); give at least {2 * self.row_bytes}"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if vllm.__version__ != VLLM_VERSION:
            logger.warning(
                "kvtier's vLLM tier is built and tested against vLLM %s; this is vLLM %s",
                VLLM_VERSION,
                vllm.__version__,
            )
        note = volatile_warning(opts["path"], "path")
        if note is not None:
            logger.warning("%s", note)
        self.locality = opts["locality"]
        self.planner = EnginePlanner(opts["restore_planner"], opts["prefill_tokens_per_s"])
        self.tokens_per_row = int(cfg.cache.tokens_per_hash) * int(cfg.cache.blocks_per_chunk)
        self.namespace = namespace(cfg, self.row_bytes, opts["namespace_tag"])
        # the metrics endpoint (port + the DP replica's index: one engine core process per replica) takes its port
        # before anything is opened: a busy one is an error that costs nothing
        self.metrics_endpoint = MetricsEndpoint.claim(opts["metrics_port"], opts["metrics_host"],
                                                      offset=int(cfg.parallel.data_parallel_index))
        try:
            store = _RowStore(
                opts["path"],
                self.namespace,
                capacity_bytes=opts["capacity_bytes"],
                budget_bytes=opts["capacity_bytes"],
                io_threads=opts["io_threads"],
                direct=opts["direct"],
                keyring=opts["keyring"],
                tenant=opts["tenant"],
            )
        except BaseException:
            self.metrics_endpoint.close()
            raise
        rows = torch.from_numpy(np.asarray(primary_kv_view)).view(torch.uint8)  # zero copy
        try:
            store.register_mem_pool_host(_Rows(rows))
            self.staged = StagedIO(store, read_deadline_s=opts["read_deadline_s"],
                                   write_deadline_s=opts["write_deadline_s"], staging_bytes=opts["staging_bytes"],
                                   name="vllm")
            self.staged.prepare()
        except BaseException as e:
            # vLLM releases its view while this exception is in flight: drop every reference to the rows
            # (this frame's, and the locals of the frames the traceback keeps) so that release succeeds
            if hasattr(self, "staged"):
                self.staged.close()
            store.release()
            self.metrics_endpoint.close()
            del rows
            traceback.clear_frames(e.__traceback__)
            raise
        self._store: _RowStore | None = store
        self._cv = threading.Condition()
        self._failed_loads: set[str] = set()  # rows whose load failed: MISS until stored again
        # queued jobs with the keys and rows checked at submit (private copies: the job's own lists may change)
        self._queues: dict[str, deque[tuple[TransferJob, list[Any], np.ndarray]]] = {"load": deque(), "store": deque()}
        self._pending = 0  # jobs submitted and not finished
        self._stopping = False
        self._finished: deque[JobResult] = deque()
        self.counters = {"refused_keys": 0, "failed_store_jobs": 0, "failed_load_jobs": 0, "job_errors": 0,
                         "planned_misses": 0}
        self._warned_hash = False
        self._threads = [
            threading.Thread(target=self._run, args=(kind,), name=f"kvtier-vllm-{kind}", daemon=True)
            for kind in self._queues
        ]
        for t in self._threads:
            t.start()
        self.metrics_endpoint.attach(self)

    # ------------------------------------------------------------------ keys
    def _name(self, key: OffloadKey) -> str | None:
        """The store key of ``key`` (hex: keys are data, never paths); None for a block hash too short to
        be collision-resistant."""
        if not isinstance(key, bytes):
            raise InvalidArgumentError(f"invalid argument `keys`: an OffloadKey is bytes, got {type(key).__name__}")
        if len(get_offload_block_hash(key)) < SECURE_HASH_BYTES:
            if not self._warned_hash:
                self._warned_hash = True
                logger.error(
                    "kvtier tier: block hashes of %d bytes are not collision-resistant, so the tier stores and "
                    "serves nothing (a collision would serve another prefix's KV); run vLLM with "
                    "--prefix-caching-hash-algo sha256 (the default) or sha256_cbor",
                    len(get_offload_block_hash(key)),
                )
            return None
        return key.hex()

    def _count(self, name: str, n: int = 1) -> None:
        with self._cv:
            self.counters[name] += n

    def _store_open(self) -> _RowStore:
        if self._store is None:
            raise ClosedError("kvtier tier: used after shutdown()")
        return self._store

    # ------------------------------------------------------------------ SecondaryTierManager
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the row is stored (durably) in this namespace; MISS otherwise, and for every key whose
        block hash is shorter than :data:`SECURE_HASH_BYTES` (vLLM's non-cryptographic ``xxhash``)."""
        name = self._name(key)
        if name is None or name in self._failed_loads:  # a row that failed to load is recomputed, not retried
            return LookupResult.MISS
        store = self._store_open()
        if self.staged.breaker.state == "open" or not store.exists(name):  # (a disk missing deadlines: none)
            return LookupResult.MISS
        return LookupResult.HIT if self._worth_loading(store, key, req_context) else LookupResult.MISS

    def _worth_loading(self, store: PageStore, key: OffloadKey, req_context: ReqContext) -> bool:
        """Whether reading this row is predicted faster than vLLM recomputing its tokens (rows are promoted in
        batches, so a row is judged by the tier's sustained rate, without the per-batch cost)."""
        if not self.planner.enabled:
            return True
        est = store.measured()["disk"]
        end = req_context.get_offload_key_position(key) if req_context is not None else None
        context_rows = max(0, int(end) // self.tokens_per_row - 1) if end else 0
        ok = self.planner.worth_loading([("disk", 1)], context_pages=context_rows, page_tokens=self.tokens_per_row,
                                        page_bytes=self.row_bytes,
                                        tiers={"disk": dataclasses.replace(est, read_latency_s=0.0)}) == 1
        if not ok:
            self._count("planned_misses")
        return ok

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit("store", job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit("load", job_metadata)

    def _submit(self, kind: str, job: TransferJob) -> None:
        """Checks the job (before any IO) and queues it for the tier's thread of its kind."""
        self._store_open()
        keys, ids = list(job.keys), np.asarray(job.chunk_ids)
        if ids.ndim != 1 or len(keys) != len(ids) or (ids.size and ids.dtype.kind not in "iu"):
            raise InvalidArgumentError(
                f"invalid argument `job_metadata`: {len(keys)} keys but chunk_ids of shape {ids.shape} and dtype "
                f"{ids.dtype} (one integer row per key expected)"
            )
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise InvalidArgumentError(
                f"invalid argument `job_metadata`: chunk_ids must be rows in [0, {self.num_rows}), got "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        if kind == "load" and len(np.unique(ids)) != ids.size:
            raise InvalidArgumentError("invalid argument `job_metadata`: a load's chunk_ids must be distinct")
        for k in keys:
            self._name(k)  # type check (raises) before the job is queued
        with self._cv:
            if self._stopping:
                raise ClosedError("kvtier tier: used after shutdown()")
            self._queues[kind].append((job, keys, np.array(ids, dtype=np.int64, copy=True)))
            self._pending += 1
            self._cv.notify_all()

    def _run(self, kind: str) -> None:
        q = self._queues[kind]
        while True:
            with self._cv:
                while not q and not self._stopping:
                    self._cv.wait()
                if not q:
                    return
                job, keys, rows = q.popleft()
            try:
                result = self._do(kind, job, keys, rows)
            except BaseException:  # noqa: BLE001 - a failed job is a result, never a dead thread (pyo3 panics too)
                logger.exception("kvtier tier: %s job %s failed", kind, job.job_id)
                self._count("job_errors")
                result = JobResult(job_id=job.job_id, success=False)
            self._finished.append(result)
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def _do(self, kind: str, job: TransferJob, keys: list[Any], rows: np.ndarray) -> JobResult:
        """Runs one job on the keys and rows checked when it was submitted."""
        names = [self._name(k) for k in keys]
        usable = [i for i, n in enumerate(names) if n is not None]
        self._count("refused_keys", len(keys) - len(usable))
        ok = [False] * len(keys)
        t0 = time.perf_counter()
        if usable:
            self._store_open()
            idx = torch.from_numpy(rows[usable])
            names_ok = [n for n in names if n is not None]
            if kind == "load":
                deadline = self.staged.read_deadline_s
                if deadline == "auto":
                    deadline = auto_read_deadline_s(len(names_ok), self.tokens_per_row)
                res = self.staged.get(names_ok, idx, deadline)
            else:
                res = self.staged.set(names_ok, idx)
            for i, r in zip(usable, res):
                ok[i] = bool(r)
            # a row that failed to load (an IO error leaves it indexed) is a MISS until stored again: a HIT
            # that can never load would keep vLLM waiting on it (vLLM's own fs tier does the same)
            for i in usable:
                if kind == "load" and not ok[i]:
                    self._failed_loads.add(names[i])  # type: ignore[arg-type]
                elif kind == "store" and ok[i]:
                    self._failed_loads.discard(names[i])
        dt = time.perf_counter() - t0
        n_ok = sum(ok)
        if n_ok == len(keys):
            return JobResult(job_id=job.job_id, success=True, transfer_time=dt, transfer_bytes=n_ok * self.row_bytes)
        self._count("failed_load_jobs" if kind == "load" else "failed_store_jobs")
        good = tuple(k for k, o in zip(keys, ok) if o) if kind == "load" and n_ok else None
        return JobResult(
            job_id=job.job_id,
            success=False,
            successful_keys=good,
            transfer_time=dt,
            transfer_bytes=n_ok * self.row_bytes,
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def has_pending_work(self) -> bool:
        with self._cv:
            return self._pending > 0 or bool(self._finished)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Waits until every submitted job has finished (its result is then in ``get_finished_jobs``)."""
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0)

    def shutdown(self) -> None:
        """Cancels queued jobs (reported as failed), waits for the ones in flight, closes the store and drops
        every reference to vLLM's rows. Idempotent."""
        self.metrics_endpoint.close()  # first: a scrape no longer reads what closes
        with self._cv:
            self._stopping = True
            for q in self._queues.values():
                while q:
                    job = q.popleft()[0]
                    self._finished.append(JobResult(job_id=job.job_id, success=False))
                    self._pending -= 1
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        store, self._store = self._store, None
        self.staged.close()
        if store is not None:
            store.release()

    # ------------------------------------------------------------------ kvtier's own view
    @property
    def store(self) -> PageStore | None:
        """The page store (for ``kvtier.metrics.KvtierCollector(stores=[tier.store])``); None after shutdown."""
        return self._store

    def report_metrics(self, scrape: Scrape, name: str) -> list[MetricsSource]:
        """Its restore decisions and store calls labelled ``name`` (:mod:`kvtier.metrics`); its page store
        reports its own (none after shutdown)."""
        scrape.planner(name, self.planner.stats.as_dict())
        scrape.deadlines({"backend": name}, self.staged.stats)
        return [self._store] if self._store is not None else []

    def kvtier_stats(self) -> dict[str, Any]:
        """The store's counters (``PageStore.get_stats``) and the tier's: keys refused for a short block hash,
        failed store and load jobs, jobs that raised, rows not loaded because recomputing them was predicted
        faster (``planned_misses``; the planner's own counters under ``restore_planner``)."""
        return {**self._store_open().get_stats(), **self.counters, "restore_planner": self.planner.stats.as_dict(),
                "deadlines": self.staged.stats()}
