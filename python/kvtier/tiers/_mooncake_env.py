"""Finding Mooncake (its Python module, its binaries, the system libraries its shared objects link) and
connecting a client to a cluster that can store.

Mooncake's wheel (``mooncake-transfer-engine-non-cuda``) links ``libibverbs.so.1`` even without RDMA
hardware. Where the system has it (Debian: ``apt-get install libibverbs1``) nothing else is needed; where it
does not and root is not at hand, ``make install-test`` unpacks the Debian packages (``apt-get download`` +
``dpkg -x``, no root) into ``<venv>/lib/kvtier-syslibs``, and this module loads them from there (or from
``$KVTIER_SYSLIB_DIR``) before Mooncake is imported; child processes get the same directories on their
``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from .._errors import KvtierError

PROBES = 6  # probe puts at construction, 0.5 s apart
#: Loaded in this order (each needs the ones before it).
_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")
INSTALL_HINT = (
    "kvtier's cluster tier needs Mooncake: pip install 'kvtier[mooncake]' (the mooncake-transfer-engine-non-cuda "
    "wheel) and the system library libibverbs1 (apt-get install libibverbs1; without root: `make syslibs`, see "
    "README 'Use it across nodes')"
)


def syslib_dirs() -> list[str]:
    """Directories holding unpacked system libraries for Mooncake (may be empty)."""
    roots = [os.environ.get("KVTIER_SYSLIB_DIR", ""), str(Path(sys.prefix) / "lib" / "kvtier-syslibs")]
    out = []
    for root in filter(None, roots):
        for sub in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu",
                    "lib/aarch64-linux-gnu", ""):
            d = Path(root) / sub
            if d.is_dir() and any(d.glob("lib*.so*")) and str(d) not in out:
                out.append(str(d))
    return out


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """An environment for a Mooncake child process: the unpacked system libraries on its loader path."""
    env = dict(os.environ)
    dirs = syslib_dirs()
    if dirs:
        env["LD_LIBRARY_PATH"] = ":".join(dirs + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p])
    env.update(extra or {})
    return env


def _preload() -> None:
    try:
        ctypes.CDLL("libibverbs.so.1", mode=ctypes.RTLD_GLOBAL)
        return  # the system has it
    except OSError:
        pass
    for d in syslib_dirs():
        if (Path(d) / "libibverbs.so.1").exists():
            for lib in _LIBS:
                for cand in [Path(x) / lib for x in syslib_dirs()]:
                    if cand.exists():
                        ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
                        break
            return


def store_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``, or one clear error saying what to install. Mooncake's client
    logs at WARNING and above in this process unless ``MC_LOG_LEVEL`` says otherwise (its INFO lines, a dozen
    per client, say nothing an operator acts on)."""
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    _preload()
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise KvtierError(f"{INSTALL_HINT} (import failed: {e})") from None
    return MooncakeDistributedStore


def binary(name: str) -> str:
    """Path of a binary shipped in Mooncake's wheel (``mooncake_master``)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise KvtierError(INSTALL_HINT)
    path = Path(list(spec.submodule_search_locations)[0]) / name
    if not path.exists():
        raise KvtierError(f"{INSTALL_HINT} ({path} is missing)")
    return str(path)


def missing_libraries(path: str, env: dict[str, str]) -> list[str]:
    """The shared libraries the executable at ``path`` links and the dynamic loader cannot find with ``env``'s
    loader path (``ldd``'s "not found" lines); empty where ldd is not installed or says nothing."""
    import subprocess

    try:
        r = subprocess.run(["ldd", path], env=env, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return list(dict.fromkeys(line.split("=>")[0].strip() for line in r.stdout.splitlines() if "=> not found" in line))


def connect(address: str, protocol: str, device: str, hostname: str, metadata: str, segment: int, local_buf: int,
            replicas: int, timeout: float) -> tuple[Any, Any]:
    """A Mooncake client connected to the master at ``address`` that has proven the cluster can store (a probe
    object put and found), and the replicate config of its puts. Raises KvtierError with the cause."""
    cls = store_class()
    host, _, port = address.rpartition(":")
    try:  # an unreachable master is one clear error now, not a Mooncake retry loop
        with socket.create_connection((host, int(port)), timeout=min(timeout, 5.0)):
            pass
    except OSError as e:
        raise KvtierError(f"MooncakeTier: cannot reach the master at {address}: {e}") from None
    store = cls()
    rc = store.setup(hostname, metadata, segment, local_buf, protocol, device, address)
    if rc != 0:
        raise KvtierError(f"MooncakeTier: Mooncake setup failed with code {rc} (master {address}, protocol "
                          f"{protocol!r}, device {device!r}, hostname {hostname!r}); see Mooncake's log above")
    from mooncake.store import ReplicateConfig

    replicate = ReplicateConfig()
    replicate.replica_num = replicas
    # a probe object proves the cluster can store: a cluster with no mounted memory (no storage process,
    # and global_segment_size=0 here) fails every put — one error now rather than every page a miss
    # (retried: for a few seconds after a storage process dies the master may still place objects on it)
    key, val = f"kvtier_probe_{uuid.uuid4().hex}", b"kvtier" * 64
    for _attempt in range(PROBES):
        rc = store.put(key, val, replicate)
        if rc == 0 and store.is_exist(key) == 1:  # (not a get: a read object is leased and stays)
            break
        time.sleep(0.5)
    else:
        store.close()
        raise KvtierError(f"MooncakeTier: the cluster at {address} cannot store objects (probe put returned {rc}): "
                          f"no storage process has mounted memory and this client's global_segment_size={segment}")
    store.remove(key)
    return store, replicate
