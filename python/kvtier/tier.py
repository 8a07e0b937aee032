"""The interface every KV tier below the host pool implements: :class:`~kvtier.PageStore` (local disk),
:class:`~kvtier.tiers.mooncake.MooncakeTier` (a cluster) and :class:`~kvtier.tiers.TieredStore` (an ordered chain
of tiers). :class:`~kvtier.TierController`, the restore planner and the SGLang and vLLM integrations use a tier
only through these methods, so a new tier (an object store, another cluster) is one class that implements them.

Pages are named by keys (``str``, e.g. :func:`kvtier.page_hashes`) and move to and from a registered host pool
through its token indices (``host_indices``: whole pages, ``page_size`` tokens each), as in SGLang's HiCache
storage interface. A batch call answers per key; a failure of one page is a ``False`` (a miss on read), never an
exception, and never a wrong byte: a tier that cannot prove a page's bytes reports it missing.

Optional: ``lookups_may_block`` (a bool attribute; taken as True when absent). False says ``batch_exists`` and
``locate`` never wait on IO, so :class:`~kvtier.TierController` calls them on the caller's thread instead of
under a deadline on a thread of their own."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ._errors import InvalidArgumentError
from ._tier_meter import TierEstimate


@runtime_checkable
class Tier(Protocol):
    """A KV tier: pages by key, to and from a registered host pool, with its own measured speed."""

    #: bytes of one page (K and V) once a host pool is registered; 0 before
    page_bytes: int

    @property
    def name(self) -> str:
        """The name this tier's figures go by: the keys of :meth:`measured` and the names :meth:`locate` gives
        (the planner costs a run of pages by the estimate of the same name). A chain's is its first, durable
        tier's."""

    @property
    def pool(self) -> Any:
        """The registered host pool, or None before :meth:`register_mem_pool_host`."""

    def register_mem_pool_host(self, pool: Any) -> None:
        """Attach the host pool whose pages this tier reads and writes (its geometry names the namespace)."""

    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the pages at ``host_indices`` under ``keys``; ``True`` for each page made durable here."""
        ...

    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Read ``keys`` into the pages at ``host_indices``; ``True`` for each page whose bytes were verified."""
        ...

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """How many leading ``keys`` this tier holds (and a read would verify)."""
        ...

    def exists(self, key: str) -> bool:
        """Whether this tier holds ``key``."""
        ...

    def locate(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        """Runs of leading ``keys`` by the tier that holds them: ``[(tier name, pages), ...]``."""
        ...

    def measured(self) -> dict[str, TierEstimate]:
        """This tier's moving estimate of itself (read and write GB/s, batch latency, hit rate), by tier name."""
        ...

    def delete(self, keys: Sequence[str]) -> int:
        """Remove ``keys``; returns how many were held."""
        ...

    def erase_tenant(self, salt: str | None = None, *, tag: str | None = None) -> int:
        """Remove every page of one tenant (by its salt or tag); returns the pages removed."""
        ...

    def clear(self) -> None:
        """Remove every page of this tier's namespace."""

    def get_stats(self) -> dict[str, Any]:
        """Counters: hits, misses, bytes, failures, capacity."""
        ...

    def close(self) -> None:
        """Finish pending writes and release the tier's files, connections and registered memory."""


def check_registered(store: Any, host_pool: Any) -> None:
    """Refuses a ``store`` (None: no store) that is not registered with ``host_pool``."""
    if store is None:
        return
    bound = getattr(store, "pool", None)
    if bound is None:
        raise InvalidArgumentError("invalid argument `store`: it has no host pool; call store."
                                   "register_mem_pool_host(host_pool) before building the TierController")
    if bound is not host_pool:
        raise InvalidArgumentError("invalid argument `store`: it is registered with another host pool than "
                                   "`host_pool`; its batches would read and write that pool's memory at "
                                   "this pool's indices")


def _disk(path: Any = None, **options: Any) -> Tier:
    from .store import PageStore

    if path is None:
        raise InvalidArgumentError("invalid argument `spec`: the disk tier needs `path` (its store directory)")
    return PageStore(path, **options)


def _mooncake(master_server_address: Any = None, **options: Any) -> Tier:
    from .tiers.mooncake import MooncakeTier

    if master_server_address is None:
        raise InvalidArgumentError("invalid argument `spec`: the mooncake tier needs `master_server_address`")
    return MooncakeTier(master_server_address, **options)


#: the tiers :func:`build_tier` builds, by name: each a constructor of keyword options (register a new tier here)
TIERS: dict[str, Callable[..., Tier]] = {"disk": _disk, "mooncake": _mooncake}


def build_tier(spec: str | Mapping[str, Mapping[str, Any]], **defaults: Any) -> Tier:
    """The tier ``spec`` names: ``"disk"`` or ``{"disk": {"path": ..., ...}}`` (a :class:`kvtier.PageStore`),
    ``{"mooncake": {"master_server_address": ..., "model_name": ..., ...}}`` (a
    :class:`~kvtier.tiers.mooncake.MooncakeTier`), or any name in :data:`TIERS`; its options over
    ``defaults``. An unknown name is an InvalidArgumentError listing the registered ones."""
    options: Mapping[str, Any] = {}
    if isinstance(spec, str):
        name = spec
    elif isinstance(spec, Mapping) and len(spec) == 1 and isinstance(next(iter(spec.values())), Mapping):
        name, options = next(iter(spec.items()))
    else:
        raise InvalidArgumentError(f"invalid argument `spec`: a tier name or {{name: {{options}}}}, got {spec!r}")
    if name not in TIERS:
        raise InvalidArgumentError(f"invalid argument `spec`: unknown tier {name!r}; registered tiers: "
                                   + ", ".join(sorted(TIERS)))
    return TIERS[name](**{**defaults, **options})
