"""A tier's measurements of itself: :class:`TierMeter` observes every batch kvtier moves through a tier and
every lookup, and :class:`TierEstimate` is one reading of it (sustained GB/s, the fixed cost of a batch, the
recent hit rate). Part of :mod:`kvtier.planner`, which re-exports both; nothing here touches a tier."""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


#: Observations a meter or a prefill model keeps (the oldest are forgotten first).
WINDOW = 64


@dataclass(frozen=True)
class TierEstimate:
    """One reading of a tier's meter. ``read_GBps``/``write_GBps`` are sustained rates (bytes after the
    fixed per-batch cost); ``0.0`` means nothing is known. ``source``: ``"measured"`` (kvtier's own
    transfers), ``"probe"`` (the probe at open) or ``"none"``."""

    name: str
    read_GBps: float = 0.0
    write_GBps: float = 0.0
    read_latency_s: float = 0.0
    write_latency_s: float = 0.0
    hit_rate: float = 0.0
    samples: int = 0
    source: str = "none"

    @property
    def known(self) -> bool:
        return self.read_GBps > 0

    def read_s(self, nbytes: int) -> float:
        """Predicted seconds to read ``nbytes`` in one batch (``inf`` when the tier was never measured)."""
        return _batch_s(nbytes, self.read_GBps, self.read_latency_s)

    def write_s(self, nbytes: int) -> float:
        """Predicted seconds to write ``nbytes`` in one batch (``inf`` when never measured)."""
        return _batch_s(nbytes, self.write_GBps, self.write_latency_s)


def _batch_s(nbytes: int, gbps: float, latency_s: float) -> float:
    if nbytes <= 0:
        return 0.0
    return latency_s + nbytes / (gbps * 1e9) if gbps > 0 else math.inf


def _fit_rate(obs: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(GB/s, latency s)`` of ``seconds = latency + bytes / rate`` over observations: a least-squares line
    when the batch sizes vary enough to tell the two apart, else the plain ratio (latency 0)."""
    b = np.array([o[0] for o in obs], dtype=np.float64)
    s = np.array([o[1] for o in obs], dtype=np.float64)
    if len(obs) >= 3 and b.max() > 1.5 * max(b.min(), 1.0):
        slope, icept = np.polyfit(b, s, 1)
        if slope > 0 and icept >= 0:
            return float(1.0 / slope / 1e9), float(icept)
    total = float(s.sum())
    return (float(b.sum()) / total / 1e9 if total > 0 else 0.0), 0.0


class TierMeter:
    """A tier's moving estimate of itself (thread-safe): every batch kvtier moves is observed
    (:meth:`observe`), every lookup too (:meth:`observe_lookup`); :meth:`estimate` fits the last
    :data:`WINDOW` batches of each direction. Until a direction has been observed, the probe's figure
    (:meth:`seed`) stands in for it."""

    def __init__(self, name: str, *, window: int = WINDOW) -> None:
        self.name = name
        self._obs: dict[str, collections.deque[tuple[int, float]]] = {
            "read": collections.deque(maxlen=window), "write": collections.deque(maxlen=window)}
        self._seed = {"read": 0.0, "write": 0.0}
        self._looked: collections.deque[tuple[int, int]] = collections.deque(maxlen=4 * window)
        self._fits: dict[str, tuple[float, float]] = {}  # per direction, until its next observation
        self._lock = threading.Lock()

    def seed(self, read_GBps: float | None = None, write_GBps: float | None = None) -> None:
        """The probe's figures (GB/s), used until kvtier's own transfers have been observed."""
        with self._lock:
            if read_GBps is not None and read_GBps > 0 and math.isfinite(read_GBps):
                self._seed["read"] = float(read_GBps)
            if write_GBps is not None and write_GBps > 0 and math.isfinite(write_GBps):
                self._seed["write"] = float(write_GBps)
            self._fits.clear()

    def observe(self, kind: str, nbytes: int, seconds: float) -> None:
        """One batch of ``kind`` (``"read"`` or ``"write"``) moved ``nbytes`` in ``seconds``; batches that
        moved nothing (misses, failures) tell nothing about speed and are ignored."""
        if nbytes > 0 and seconds > 0 and math.isfinite(seconds):
            with self._lock:
                self._obs[kind].append((int(nbytes), float(seconds)))
                self._fits.pop(kind, None)

    def observe_lookup(self, found: int, asked: int) -> None:
        if asked > 0:
            with self._lock:
                self._looked.append((int(found), int(asked)))

    def estimate(self) -> TierEstimate:
        with self._lock:
            for kind in ("read", "write"):  # refitted only after new observations
                if kind not in self._fits:
                    obs = self._obs[kind]
                    self._fits[kind] = _fit_rate(list(obs)) if obs else (self._seed[kind], 0.0)
            out = dict(self._fits)
            seed = dict(self._seed)
            looked = list(self._looked)
            samples = len(self._obs["read"])
            measured = bool(self._obs["read"] or self._obs["write"])
        asked = sum(a for _, a in looked)
        return TierEstimate(
            name=self.name, read_GBps=out["read"][0], write_GBps=out["write"][0], read_latency_s=out["read"][1],
            write_latency_s=out["write"][1], hit_rate=sum(f for f, _ in looked) / asked if asked else 0.0,
            samples=samples, source="measured" if measured else ("probe" if any(seed.values()) else "none"))
