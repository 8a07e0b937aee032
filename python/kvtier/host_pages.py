"""The controller's host index entries and counters (:class:`kvtier.TierController`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


def page_slots(starts: Sequence[int], page_tokens: int) -> torch.Tensor:
    """The host token slots of the pages that start at ``starts`` (``page_tokens`` each), in order."""
    return (torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(page_tokens)[None]).reshape(-1)


@dataclass
class HostPage:
    start: int  # first host token slot
    refs: int = 0  # transfers or writes in flight that use this page
    ready: bool = False  # backup (or store read) finished
    event: Any = None  # CUDA event of the backup, until it is seen complete
    hits: int = 0
    in_store: bool = False
    erased: bool = False  # its tenant was erased while the page was held: never a hit again, wiped when freed

    @property
    def usable(self) -> bool:
        """Its bytes are there or on their way on a stream a load can follow (a backup in flight); not in
        flight from the store, nor a backup not issued yet, nor of an erased tenant."""
        return not self.erased and (self.ready or self.event is not None)


@dataclass
class Stats:
    """Counters a demo or an engine can report."""

    backed_up_pages: int = 0
    loaded_pages: int = 0
    store_writes: int = 0
    store_write_failures: int = 0
    prefetched_pages: int = 0
    prefetch_misses: int = 0
    host_evictions: int = 0
    spills: int = 0
    spills_given_up: int = 0  # write-back evictions whose spill was skipped or missed its deadline (not stored)
    store_writes_given_up: int = 0  # pages whose store write never started before its deadline (or breaker)
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    bytes_to_store: int = 0
    bytes_from_store: int = 0
    host_hit_pages: int = 0  # match(): pages found on the host ...
    store_hit_pages: int = 0  # ... then in the store ...
    miss_pages: int = 0  # ... and the rest (to be recomputed)
