"""A one-line progress bar on stderr for work that can take more than a few seconds (no dependency)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Progress:
    """Shown on a terminal once the work has taken more than ``delay`` seconds (quick runs, and output to a
    file or a pipe, get nothing; ``force`` draws anyway), redrawn in place, ended with a newline by
    :meth:`close`."""

    def __init__(self, total: int, label: str, *, delay: float = 1.0, stream: Any = None, force: bool = False) -> None:
        self.total, self.label, self.delay = max(0, total), label, delay
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = force or bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0, self.shown = time.perf_counter(), False

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        if not self.shown and elapsed < self.delay:
            return
        self.shown = True
        width = 30
        frac = done / self.total if self.total else 1.0
        fill = int(width * min(1.0, frac))
        eta = f", {elapsed / frac - elapsed:.0f} s left" if 0 < frac < 1 else ""
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} "
                          f"({elapsed:.0f} s{eta})  ")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def run_with_progress(work: Callable[[], T], poll: Callable[[], tuple[int, int]], label: str,
                      interval: float = 0.2, force: bool = False) -> T:
    """Runs ``work`` in a thread (a native call that releases the GIL) while drawing ``poll()``'s
    ``(done, total)``; returns its result or raises its exception. Ctrl-C still reaches the caller."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    t = threading.Thread(target=target, name="kvtier-progress-work", daemon=True)
    t.start()
    bar: Progress | None = None
    try:
        while t.is_alive():
            t.join(interval)
            done, total = poll()
            if total:
                bar = bar or Progress(total, label, force=force)
                bar.update(min(done, total))
    finally:
        if bar is not None:
            bar.close()
    if "error" in box:
        raise box["error"]
    result: T = box["result"]
    return result
