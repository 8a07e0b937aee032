"""What keeps the objects of in-flight copies alive: holds released once the GPU (and, for a background
submission, its thread) has passed them, and one re-recorded mark per caller stream for repeated per-layer
loads."""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch


class InFlight:
    """The holds and marks of one transfer engine. Copies may be issued from several threads."""

    def __init__(self) -> None:
        self._entries: collections.deque[tuple[Any, Any, tuple[Any, ...]]] = collections.deque()
        self._lock = threading.Lock()
        #: (device index, stream handle) -> [event after the last warm load, its refs, the event's handle]
        self.marks: dict[Any, list[Any]] = {}

    def __len__(self) -> int:
        """Holds not yet released."""
        return len(self._entries)

    def held(self) -> list[tuple[Any, ...]]:
        """The refs of every hold not yet released, oldest first (for tests and diagnostics)."""
        with self._lock:
            return [entry[2] for entry in self._entries]

    def hold(self, refs: tuple[Any, ...], event: Any = None, submission: Any = None) -> None:
        """Keep ``refs`` alive until the current stream (of the current device: callers run under
        ``torch.cuda.device``) passes this point — or, for a background submission, until it has finished
        and ``event`` (its last events) has completed."""
        if event is None:
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            self._entries.append((event, submission, refs))
            while self._entries and self._released(self._entries[0]):
                self._entries.popleft()

    @staticmethod
    def _released(entry: tuple[Any, Any, tuple[Any, ...]]) -> bool:
        event, submission, _ = entry
        if submission is not None and not submission.finished():
            return False
        return all(ev.query() for ev in event) if isinstance(event, (list, tuple)) else bool(event.query())

    def mark(self, index: int, handle: int, stream: Any, refs: tuple[Any, ...]) -> None:
        """:meth:`hold` for repeated per-layer loads: one event per (device, caller stream), re-recorded after
        every load on it, marks the last of them (a stream runs in order, so it passes every earlier one
        first); :meth:`synchronize` waits for it. Creating an event per call cost 7.6 µs of a 16-page call's
        ~50 µs (benches/results/h200-probe-host-cost.json). ``refs`` (the pool's host regions and the plans,
        the same objects for every call of a warm load) stay referenced until the mark is dropped. ``index``,
        ``handle``: the device's index and the stream's handle."""
        key = (index, handle)
        entry = self.marks.get(key)
        if entry is not None and entry[1] is not refs:
            self.hold(entry[1])  # another index set: its copies, enqueued before this point, keep their refs
        if entry is None:
            entry = self.marks[key] = [torch.cuda.Event(), refs, 0]
            with self._lock:
                while len(self.marks) > 8:  # an old mark is waited for like any other hold
                    old = self.marks.pop(next(iter(self.marks)))
                    self._entries.append((old[0], None, old[1]))
        entry[1] = refs
        entry[0].record(stream)
        entry[2] = entry[0].cuda_event  # recorded once: load_layer may now have the core re-record it

    def synchronize(self) -> None:
        """Wait for every mark and hold (used before a pool releases its memory)."""
        for mark in list(self.marks.values()):
            mark[0].synchronize()
        while True:
            with self._lock:
                if not self._entries:
                    return
                event, submission, _ = self._entries.popleft()
            if submission is not None:
                try:
                    submission.join()
                except Exception:  # noqa: BLE001 - the error reaches the load's own waiter; a failed
                    pass  # submission has waited for everything it enqueued before it reports finished
            for ev in event if isinstance(event, (list, tuple)) else (event,):
                ev.synchronize()
