"""A Mooncake cluster on one machine: a master and N storage processes, children of this process, bound to
127.0.0.1 on free ports, for tests, the demo and anyone trying the cluster tier.

    with LocalCluster(storage_nodes=2, segment_bytes=1 << 30) as c:
        tier = MooncakeTier(c.master_address, ...)

Logs are kept under ``log_dir`` (a temporary directory by default, kept after :meth:`stop` and named in
errors). Children are stopped by :meth:`stop` (also on ``with`` exit and at interpreter exit); every child
also gets SIGTERM when its parent dies, however it dies (Linux ``PR_SET_PDEATHSIG``). Mooncake's transfer engine listens on
all interfaces for its data port (no flag controls it in 0.3.13); the master's RPC and metrics ports are
bound to 127.0.0.1.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from .._errors import InvalidArgumentError, KvtierError
from ._mooncake_env import binary, child_env


def _die_with_parent() -> None:
    """(in the child, before exec) SIGTERM when the parent dies, however it dies (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[Any], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise KvtierError(f"mooncake_master exited with {proc.returncode} at start-up; log: {log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise KvtierError(f"mooncake_master did not listen on 127.0.0.1:{port} within {timeout:.0f} s; log: {log}")


class LocalCluster:
    """See the module docs.

    Args:
        storage_nodes: storage processes to start (0: a master only; clients then bring their own segments).
        segment_bytes: memory each storage process mounts into the cluster.
        client_ttl_s: seconds the master keeps a silent client's segments listed (Mooncake's ``client_ttl``).
        lease_ttl_ms: Mooncake's ``default_kv_lease_ttl`` (a read object cannot be evicted or removed for
            this long).
        eviction_high_watermark_ratio, eviction_ratio: Mooncake's eviction settings (``None``: the master's
            defaults, 0.9 and 0.05): when the allocated share of the cluster's memory passes the watermark, the
            master evicts about that ratio of its objects, those whose leases expired longest ago first.
        log_dir: where the children's logs go (default: a new temporary directory, removed by :meth:`stop`
            unless a child failed to start: its log is then kept and named in the error).
        start_timeout_s: how long each child may take to be ready.
    """

    def __init__(self, storage_nodes: int = 1, segment_bytes: int = 256 << 20, *, client_ttl_s: int = 10,
                 lease_ttl_ms: int = 5000, log_dir: str | os.PathLike[str] | None = None,
                 start_timeout_s: float = 30.0, eviction_high_watermark_ratio: float | None = None,
                 eviction_ratio: float | None = None) -> None:
        for fname, f in (("eviction_high_watermark_ratio", eviction_high_watermark_ratio),
                         ("eviction_ratio", eviction_ratio)):
            if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0):
                raise InvalidArgumentError(f"invalid argument `{fname}`: must be a number in (0, 1], got {f!r}")
        self.eviction = {"eviction_high_watermark_ratio": eviction_high_watermark_ratio,
                         "eviction_ratio": eviction_ratio}
        for name, v, lo in (("storage_nodes", storage_nodes, 0), ("segment_bytes", segment_bytes, 1 << 20),
                            ("client_ttl_s", client_ttl_s, 1), ("lease_ttl_ms", lease_ttl_ms, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidArgumentError(f"invalid argument `{name}`: must be an int >= {lo}, got {v!r}")
        self.storage_nodes, self.segment_bytes = storage_nodes, segment_bytes
        self.client_ttl_s, self.lease_ttl_ms, self.start_timeout_s = client_ttl_s, lease_ttl_ms, start_timeout_s
        self._own_logs = log_dir is None
        self._failed = False
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="kvtier-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.rpc_port = 0
        self.metrics_port = 0
        self.master: subprocess.Popen[Any] | None = None
        self.nodes: list[subprocess.Popen[Any] | None] = []
        self._logs: list[IO[Any]] = []
        self._master_starts = 0
        self._atexit = False

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def start(self) -> LocalCluster:
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        try:
            self.start_master()
            for _ in range(self.storage_nodes):
                self.add_node()
        except BaseException:
            self.stop()
            raise
        return self

    def _log(self, name: str) -> tuple[Path, IO[Any]]:
        path = self.log_dir / name
        f = open(path, "ab")
        self._logs.append(f)
        return path, f

    def start_master(self) -> None:
        """Start (or, after :meth:`stop_master`, restart on the same port) the master."""
        if self.master is not None and self.master.poll() is None:
            raise KvtierError("the master is already running")
        for attempt in range(3):
            port = self.rpc_port or free_port()
            log, f = self._log(f"master{'-' + str(self._master_starts) if self._master_starts else ''}.log")
            self.metrics_port = free_port()
            cmd = [binary("mooncake_master"), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                   "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
                   f"--default_kv_lease_ttl={self.lease_ttl_ms}", f"--client_ttl={self.client_ttl_s}"]
            cmd += [f"--{k}={v}" for k, v in self.eviction.items() if v is not None]
            self.master = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=child_env(), preexec_fn=_die_with_parent)
            try:
                _wait_port(port, self.master, self.start_timeout_s, log)
            except KvtierError:
                self.stop_master()
                if attempt == 2 or self.rpc_port:
                    self._failed = True
                    raise
                continue  # the free port was taken meanwhile: try another
            self.rpc_port, self._master_starts = port, self._master_starts + 1
            return

    def metrics(self) -> dict[str, float]:
        """The master's counters (its Prometheus text on the metrics port), by name: ``master_key_count``,
        ``master_allocated_bytes``, ``master_evicted_key_count``, ... (labelled series are left out)."""
        text = self._master_http("metrics", "read the master's metrics")
        out = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
                try:
                    out[parts[0]] = float(parts[1])
                except ValueError:
                    continue
        return out

    def object_names(self) -> list[str]:
        """The name of every object the cluster holds, sorted (the master's ``/get_all_keys`` on its metrics
        port): what an operator of the cluster sees, whoever wrote the objects."""
        text = self._master_http("get_all_keys", "list the cluster's objects")
        return sorted(n for n in text.split("\n") if n)

    def _master_http(self, path: str, what: str) -> str:
        """The text the running master serves at ``path`` on its metrics port (``what``: for the error)."""
        if self.master is None or self.master.poll() is not None:
            raise KvtierError("the master is not running")
        url = f"http://127.0.0.1:{self.metrics_port}/{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return str(r.read().decode())
        except OSError as exc:
            raise KvtierError(f"cannot {what} at {url}: {exc}") from None

    def stop_master(self) -> None:
        if self.master is not None:
            _end(self.master)
            self.master = None

    def add_node(self, segment_bytes: int | None = None) -> int:
        """Start one more storage process; returns its index."""
        i = len(self.nodes)
        log, f = self._log(f"storage{i}.log")
        cmd = [sys.executable, "-m", "kvtier.tiers._storage_node", "--master", self.master_address,
               "--segment", str(segment_bytes or self.segment_bytes)]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, env=child_env(),
                             preexec_fn=_die_with_parent)
        self.nodes.append(p)
        deadline = time.monotonic() + self.start_timeout_s
        assert p.stdout is not None
        os.set_blocking(p.stdout.fileno(), False)
        buf = b""
        while time.monotonic() < deadline:
            chunk = p.stdout.read() or b""
            buf += chunk
            if b"ready" in buf:
                return i
            if p.poll() is not None:
                self._failed = True
                raise KvtierError(f"storage process {i} exited with {p.returncode}: {buf.decode(errors='replace')!r}; "
                                  f"log: {log}")
            time.sleep(0.05)
        _end(p)
        self._failed = True
        raise KvtierError(f"storage process {i} was not ready within {self.start_timeout_s:.0f} s; log: {log}")

    def kill_node(self, i: int) -> None:
        """SIGKILL storage process ``i`` (a crashed node: its memory and objects are gone)."""
        p = self.nodes[i]
        if p is not None:
            p.kill()
            _end(p)
            self.nodes[i] = None

    def stop(self) -> None:
        """Stop every child (storage processes first). Idempotent; logs are kept."""
        for i, p in enumerate(self.nodes):
            if p is not None:
                _end(p)
                self.nodes[i] = None
        self.stop_master()
        for f in self._logs:
            f.close()
        self._logs = []
        if self._own_logs and not self._failed:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _end(p: subprocess.Popen[Any]) -> None:
    if p.poll() is None:
        if p.stdin is not None:
            try:
                p.stdin.close()
            except OSError:
                pass
        p.terminate()
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for s in (p.stdin, p.stdout):
        if s is not None:
            try:
                s.close()
            except OSError:
                pass
