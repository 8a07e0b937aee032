"""The interface every KV tier below the host pool implements: :class:`~kvtier.PageStore` (local disk),
:class:`~kvtier.tiers.mooncake.MooncakeTier` (a cluster) and :class:`~kvtier.tiers.TieredStore` (an ordered chain
of tiers). :class:`~kvtier.TierController`, the restore planner and the SGLang and vLLM integrations use a tier
only through these methods, so a new tier (an object store, another cluster) is one class that implements them.

Pages are named by keys (``str``, e.g. :func:`kvtier.page_hashes`) and move to and from a registered host pool
through its token indices (``host_indices``: whole pages, ``page_size`` tokens each), as in SGLang's HiCache
storage interface. A batch call answers per key; a failure of one page is a ``False`` (a miss on read), never an
exception, and never a wrong byte: a tier that cannot prove a page's bytes reports it missing.

Tiers are built by name (:func:`build_tier`, :data:`TIERS`): an integration gives a spec from its configuration
and a :class:`TierContext` (what it knows of the pages: model, ranks, keyring, tenant), then registers its host
pool with the tier it gets.

Optional: ``lookups_may_block`` (a bool attribute; taken as True when absent). False says ``batch_exists`` and
``locate`` never wait on IO, so :class:`~kvtier.TierController` calls them on the caller's thread instead of
under a deadline on a thread of their own."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

import torch

from ._errors import InvalidArgumentError
from ._tier_meter import TierEstimate
from .namespace import Ranks

#: a tier by name: ``"disk"``, or ``{"mooncake": {"master_server_address": ...}}`` (its name and its options)
TierSpec: TypeAlias = str | Mapping[str, Mapping[str, Any]]


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


@dataclasses.dataclass(frozen=True)
class TierContext:
    """What an integration knows that a tier it builds may need; None: not known (the tier's own default).
    The integration registers its host pool with the tier once built (:meth:`Tier.register_mem_pool_host`)."""

    #: the engine's model (pages of different models never share keys)
    model_name: str | None = None
    #: where this process sits in the parallel layout, as far as it changes a page's bytes
    ranks: Ranks | None = None
    #: a :class:`kvtier.Keyring` (or its directory): seal the pages at rest
    keyring: Any = None
    #: a per-deployment tenant salt
    tenant: str | None = None
    #: the engine's ``--kv-cache-dtype`` of an fp8 cache (held as ``uint8``)
    kv_cache_dtype: str | None = None

    def keywords(self) -> dict[str, Any]:
        """The fields that are set, as the keyword options of :class:`kvtier.PageStore` and
        :class:`~kvtier.tiers.mooncake.MooncakeTier` (a tier taking kvtier's usual keywords passes these)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclasses.dataclass(frozen=True)
class TierEntry:
    """One tier :func:`build_tier` builds by name (an entry of :data:`TIERS`).

    Args:
        build: ``build(context, **options)``: the tier, open; the caller registers its host pool.
        options: the options a spec may give (an integration's configuration); None: any. The context
            gives the rest.
        required: the options a spec must give.
        check: ``check(**options)``: raises InvalidArgumentError naming a bad option, opening nothing; what
            an integration runs on its configuration before anything opens.
    """

    build: Callable[..., Tier]
    options: frozenset[str] | None = None
    required: frozenset[str] = frozenset()
    check: Callable[..., None] | None = None


def _disk(context: TierContext, path: Any = None, **options: Any) -> Tier:
    from .store import PageStore

    if path is None:
        raise InvalidArgumentError("invalid argument `spec`: the disk tier needs `path` (its store directory)")
    return PageStore(path, **{**context.keywords(), **options})


def _mooncake(context: TierContext, master_server_address: Any = None, **options: Any) -> Tier:
    from .tiers.mooncake import MooncakeTier

    if master_server_address is None:
        raise InvalidArgumentError("invalid argument `spec`: the mooncake tier needs `master_server_address`")
    return MooncakeTier(master_server_address, **{**context.keywords(), **options})


def _check_mooncake(**options: Any) -> None:
    from .tiers.mooncake import MooncakeTier

    MooncakeTier.validate_options(**options)


#: the options of a ``{"mooncake": {...}}`` spec (:class:`~kvtier.tiers.mooncake.MooncakeTier`'s; the context
#: gives the model, ranks, keyring, tenant and cache dtype)
MOONCAKE_OPTIONS = frozenset({"master_server_address", "protocol", "device_name", "local_hostname", "metadata_server",
                              "global_segment_size", "local_buffer_size", "replica_num", "accept_unverified",
                              "key_tag"})

#: the tiers :func:`build_tier` builds, by name (register a new tier here)
TIERS: dict[str, TierEntry] = {
    "disk": TierEntry(_disk),
    "mooncake": TierEntry(_mooncake, MOONCAKE_OPTIONS, frozenset({"master_server_address"}), _check_mooncake),
}


def _parse(spec: Any, argument: str) -> tuple[str, Mapping[str, Any], TierEntry]:
    """``spec``'s name, options and registered entry (an unknown name lists the registered ones)."""
    options: Mapping[str, Any] = {}
    if isinstance(spec, str):
        name = spec
    elif isinstance(spec, Mapping) and len(spec) == 1 and isinstance(next(iter(spec.values())), Mapping):
        name, options = next(iter(spec.items()))
    else:
        raise InvalidArgumentError(f"invalid argument `{argument}`: a tier name or {{name: {{options}}}}, got {spec!r}")
    entry = TIERS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise InvalidArgumentError(f"invalid argument `{argument}`: unknown tier {name!r}; registered tiers: "
                                   + ", ".join(sorted(TIERS)))
    return name, options, entry


def check_tier_spec(spec: Any, argument: str = "spec") -> tuple[str, dict[str, Any]]:
    """``spec``'s tier name and options as an integration's configuration gives them, checked against
    :data:`TIERS` without opening anything: a registered name, only options its entry accepts (the context
    gives the rest), the ones it requires, and its own check. Errors name ``argument``."""
    name, options, entry = _parse(spec, argument)
    unknown = sorted(set(options) - entry.options) if entry.options is not None else []
    if unknown:
        raise InvalidArgumentError(f"invalid argument `{argument}`: unknown key(s) {unknown} for the {name} tier; "
                                   f"accepted: {sorted(entry.options or ())}")
    missing = sorted(entry.required - set(options))
    if missing:
        raise InvalidArgumentError(f"invalid argument `{argument}`: the {name} tier needs {missing}")
    if entry.check is not None:
        entry.check(**options)
    return name, dict(options)


def check_tier_chain(specs: Any, argument: str) -> list[tuple[str, dict[str, Any]]]:
    """The tiers behind a durable first one (an integration's disk), each checked (:func:`check_tier_spec`)
    before anything opens: a list of specs, none the disk, each tier once."""
    if not isinstance(specs, (list, tuple)):
        raise InvalidArgumentError(f"invalid argument `{argument}`: expected a list of tier specs, got {specs!r}")
    out = [check_tier_spec(s, argument) for s in specs]
    names = [n for n, _ in out]
    if "disk" in names or len(set(names)) != len(names):
        raise InvalidArgumentError(f"invalid argument `{argument}`: {names}: each tier once, and the disk before "
                                   "them all (it is the durable one)")
    return out


def build_tier(spec: TierSpec, context: TierContext | None = None, **defaults: Any) -> Tier:
    """The tier ``spec`` names: ``"disk"`` or ``{"disk": {"path": ..., ...}}`` (a :class:`kvtier.PageStore`),
    ``{"mooncake": {"master_server_address": ..., ...}}`` (a :class:`~kvtier.tiers.mooncake.MooncakeTier`), or
    any name in :data:`TIERS`, built against ``context``; its options over ``defaults`` (any its constructor
    takes: a configuration is checked by :func:`check_tier_spec`). Options named like a :class:`TierContext`
    field (``model_name``, ``keyring``, ...) set that field. An unknown name is an InvalidArgumentError
    listing the registered ones."""
    name, given, entry = _parse(spec, "spec")
    options = {**defaults, **given}
    fields = {f.name for f in dataclasses.fields(TierContext)}
    ctx = dataclasses.replace(context or TierContext(), **{k: v for k, v in options.items() if k in fields})
    return entry.build(ctx, **{k: v for k, v in options.items() if k not in fields})


def build_tiers(specs: Sequence[tuple[str, dict[str, Any]]], context: TierContext, pool: Any) -> list[Tier]:
    """The checked tiers of :func:`check_tier_chain`, built against ``context`` and registered with ``pool``, in
    order; if one fails, those built before it are closed."""
    built: list[Tier] = []
    try:
        for name, options in specs:
            tier = build_tier({name: options}, context)
            built.append(tier)
            tier.register_mem_pool_host(pool)
    except BaseException:
        for tier in built:
            tier.close()
        raise
    return built
