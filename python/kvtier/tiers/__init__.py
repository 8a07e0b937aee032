"""Tiers beyond one machine's disk: the Mooncake cluster tier (:mod:`kvtier.tiers.mooncake`), the chain that
orders tiers (:class:`TieredStore`) and a cluster on one machine for tests and trials
(:mod:`kvtier.tiers.local_cluster`). Mooncake is imported only when a Mooncake tier is built."""

from __future__ import annotations

from typing import Any

__all__ = ["TieredStore"]


def __getattr__(name: str) -> Any:
    # TieredStore on first use: `kvtier cluster master` and the Mooncake helpers run without torch
    if name == "TieredStore":
        from .chain import TieredStore

        return TieredStore
    raise AttributeError(f"module 'kvtier.tiers' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
