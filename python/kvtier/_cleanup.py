"""Removing what a command created, so that a Ctrl-C cannot leave half of it behind."""

from __future__ import annotations

import shutil
import signal
import threading


def remove_tree(path: str) -> None:
    """``shutil.rmtree`` that a Ctrl-C cannot cut short: in the main thread, SIGINT is held off until the
    tree is gone (the interrupt that started the cleanup has already been delivered)."""
    if threading.current_thread() is not threading.main_thread():
        shutil.rmtree(path, ignore_errors=True)
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        signal.signal(signal.SIGINT, old)
