"""A Mooncake storage process: mounts ``segment`` bytes of this machine's memory into a cluster and serves them.

Two ways to run it:

- ``kvtier cluster storage-node --master HOST:PORT --segment 64G`` (:func:`serve`): a service. It needs no
  terminal and no standard input (``&``, ``nohup``, systemd, a container without ``-i``), serves until SIGTERM
  or SIGINT, then unmounts and exits 0; ``--log FILE`` appends its output and Mooncake's to a file.
- ``python -m kvtier.tiers._storage_node`` (:func:`main`): the child :class:`kvtier.tiers.local_cluster.
  LocalCluster` starts, which also stops when its standard input closes (its parent ended).

Both print one ``ready`` line on standard output once the segment is mounted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from .._errors import KvtierError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _mount(master: str, hostname: str, segment: int, protocol: str, metadata: str) -> Any:
    from ._mooncake_env import store_class

    store = store_class()()
    rc = store.setup(hostname, metadata, segment, 16 << 20, protocol, "", master)
    if rc != 0:
        raise KvtierError(f"the storage node could not join the cluster at {master} as {hostname} (Mooncake setup "
                          f"returned {rc}; is the master running and reachable, and is {hostname} this machine's "
                          "address?)")
    return store


def _unmount(store: Any) -> None:
    close = getattr(store, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # noqa: BLE001 - leaving: the master drops a silent client's segment after client_ttl
            pass


def _redirect(log: str) -> None:
    """Standard output and error (this process's and Mooncake's C++ logging) appended to ``log``."""
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        raise KvtierError(f"--log {log}: cannot open it for appending ({exc.strerror})") from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def serve(master: str, segment: int, *, hostname: str = "127.0.0.1", protocol: str = "tcp",
          metadata: str = "P2PHANDSHAKE", log: str | None = None, stop: threading.Event | None = None) -> int:
    """Run a storage node until SIGTERM or SIGINT (or ``stop`` is set); returns the exit status (0)."""
    if log is not None:
        _redirect(log)
    stop = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    try:
        store = _mount(master, hostname, segment, protocol, metadata)
        print(f"ready: storage node {hostname} lends {segment} bytes to the cluster at {master} (pid {os.getpid()}; "
              "SIGTERM or SIGINT stops it)", flush=True)
        try:
            while not stop.wait(1.0):
                pass
        finally:
            _unmount(store)
        print(f"storage node {hostname}: stopped", flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m kvtier.tiers._storage_node",
                                 description="LocalCluster's storage child: stops when its standard input closes. "
                                 "As a service: kvtier cluster storage-node.")
    ap.add_argument("--master", required=True)
    ap.add_argument("--hostname", default="127.0.0.1")
    ap.add_argument("--segment", type=int, required=True)
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--metadata", default="P2PHANDSHAKE")
    a = ap.parse_args()
    stop = threading.Event()

    def until_stdin_closes() -> None:
        try:
            sys.stdin.read()  # until the parent closes our stdin (or dies)
        except (OSError, ValueError):
            pass
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    try:
        return serve(a.master, a.segment, hostname=a.hostname, protocol=a.protocol, metadata=a.metadata, stop=stop)
    except KvtierError as exc:
        print(f"setup failed: {exc}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
