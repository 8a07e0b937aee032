"""Tiers beyond one machine's disk: the Mooncake cluster tier (:mod:`kvtier.tiers.mooncake`), the chain that
orders tiers (:class:`TieredStore`) and a cluster on one machine for tests and trials
(:mod:`kvtier.tiers.local_cluster`). Mooncake is imported only when a Mooncake tier is built."""

from .chain import TieredStore

__all__ = ["TieredStore"]
