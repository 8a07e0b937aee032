"""The replay bench's cluster tier: a Mooncake Store cluster on this machine (:class:`kvtier.tiers.local_cluster.
LocalCluster`, loopback only: a master and one storage process), and per node a :class:`kvtier.tiers.mooncake.
MooncakeTier` client over it — the tier SGLang's HiCache puts behind its host tier (L3), and what ``--cluster``
replays.

One cluster per replayed configuration, started before its first request and stopped after its last, also
when the replay raises or is interrupted (Ctrl-C): :class:`ClusterRun` is a context manager, the children die
with this process whatever ends it (``PR_SET_PDEATHSIG``), and nothing listens on anything but 127.0.0.1 except
Mooncake's transfer engine data port (see local_cluster's docs).

Sizing. The cluster's capacity is its storage process's memory: ``pages × (page_bytes + RECORD_BYTES)``
(a page is a K object, a V object and kvtier's 44-byte integrity record; Mooncake's offset allocator placed
them without padding when measured), rounded up to a MiB. Mooncake keeps it under its eviction watermark
(``HIGH_WATERMARK`` = 90% by default) and evicts ``EVICTION_RATIO`` (5%) of its objects, least recently leased
first, when it passes it: a cluster of C tokens holds between about 85% and 90% of C (the model does the
same: :class:`kvtier.replay.model.ClusterLru`). An unlimited capacity gets room for every distinct
block of the trace below the watermark. The lease is 1 ms (``LEASE_MS``), so the order of expiry Mooncake
evicts by is the order of last use (a replay runs hours of trace in minutes: a lease of seconds would pin a
hundred requests' pages).
"""

from __future__ import annotations

import math
from typing import Any

from .._errors import KvtierError
from .model import ClusterLru

#: kvtier's integrity record of a page in clear (docs/CLUSTER.md)
RECORD_BYTES = 44
#: Mooncake master's eviction settings (its defaults, passed explicitly so that the model holds the same)
HIGH_WATERMARK = 0.9
EVICTION_RATIO = 0.05
#: read lease of the replay's cluster, in ms (see the module docs)
LEASE_MS = 200
MIB = 1 << 20
#: the smallest segment a Mooncake storage process mounts (its client_buffer_allocation refuses less)
MIN_SEGMENT = 16 * MIB


def cluster_memory(pages: int | None, page_bytes: int, distinct_pages: int) -> int:
    """The storage process's memory for a cluster of ``pages`` pages (None: room for ``distinct_pages`` under
    the watermark), in whole MiB."""
    cost = page_bytes + RECORD_BYTES
    want = pages * cost if pages is not None else math.ceil(distinct_pages * cost / (HIGH_WATERMARK - EVICTION_RATIO))
    memory = max(-(-want // MIB) * MIB, MIN_SEGMENT if pages is None else 0)
    if memory < MIN_SEGMENT:
        raise KvtierError(
            f"--capacities: {pages} blocks of {page_bytes} B is {want / MIB:.1f} MiB of cluster memory, under the "
            f"{MIN_SEGMENT // MIB} MiB Mooncake mounts at least: give a larger capacity or --page-bytes"
        )
    return memory


class ClusterRun:
    """A LocalCluster of ``memory`` bytes and the MooncakeTier clients made over it (:meth:`tier`); the
    model of the same tier (:attr:`model`). Closing closes every client, then stops the cluster."""

    def __init__(self, memory: int, page_bytes: int) -> None:
        from ..tiers.local_cluster import LocalCluster

        self.memory, self.page_bytes = memory, page_bytes
        self.cluster = LocalCluster(
            storage_nodes=1,
            segment_bytes=memory,
            lease_ttl_ms=LEASE_MS,
            eviction_high_watermark_ratio=HIGH_WATERMARK,
            eviction_ratio=EVICTION_RATIO,
        )
        self.tiers: list[Any] = []
        self.cluster_pids: list[Any] = []
        self.model = ClusterLru(memory, page_bytes + RECORD_BYTES, HIGH_WATERMARK, EVICTION_RATIO)

    def __enter__(self) -> ClusterRun:
        self.cluster.start()
        #: the children started (master, storage process): what a test checks are gone after :meth:`close`
        self.cluster_pids = [p for p in [self.cluster.master, *self.cluster.nodes] if p is not None]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def tier(self, pool: Any) -> Any:
        """A MooncakeTier client of the cluster registered with a node's host pool."""
        from ..tiers.mooncake import MooncakeTier

        t = MooncakeTier(self.cluster.master_address, model_name="replay")
        self.tiers.append(t)
        t.register_mem_pool_host(pool)
        objs = t.page_objects
        if objs is None or objs.rec_bytes != RECORD_BYTES or t.page_bytes != self.page_bytes:
            raise KvtierError(
                f"replay --cluster: a page is {t.page_bytes} B with a {getattr(objs, 'rec_bytes', None)} B record "
                f"in Mooncake, not the {self.page_bytes} + {RECORD_BYTES} B the cluster was sized for"
            )
        return t

    def held(self) -> tuple[int, int]:
        """``(pages held, pages evicted)`` by the cluster, from the master's object counts."""
        m = self.cluster.metrics()
        k = ClusterLru.OBJECTS_PER_PAGE
        return int(m.get("master_key_count", 0)) // k, int(m.get("master_evicted_key_count", 0)) // k

    def close(self) -> None:
        try:
            for t in self.tiers:
                t.close()
        finally:
            self.tiers = []
            self.cluster.stop()

