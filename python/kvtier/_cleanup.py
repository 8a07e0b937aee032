"""Removing what a command created, so that a Ctrl-C cannot leave half of it behind."""

from __future__ import annotations

import shutil
import signal
import threading


def remove_tree(path: str) -> None:
    """``shutil.rmtree`` that a Ctrl-C cannot cut short: in the main thread, a SIGINT that arrives while the
    tree is being removed is held until it is gone, then raised as ``KeyboardInterrupt`` (never dropped: a
    Ctrl-C during the cleanup that ends a normal step still stops the command)."""
    if threading.current_thread() is not threading.main_thread():
        shutil.rmtree(path, ignore_errors=True)
        return
    held: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        signal.signal(signal.SIGINT, old)
    if held and old is not signal.SIG_IGN:
        if callable(old):
            old(signal.SIGINT, None)  # the handler that was in place (Python's raises KeyboardInterrupt)
        else:
            raise KeyboardInterrupt
