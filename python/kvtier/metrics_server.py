"""kvtier's Prometheus families on an HTTP endpoint of the engine process: the engine backends'
``metrics_port`` option (SGLang's ``KvtierStorage``, vLLM's ``KvtierTier``).

    endpoint = MetricsEndpoint.claim(9400)       # binds 127.0.0.1:9400, or joins this process's server there
    endpoint.attach(store)                       # a PageStore, a TieredStore, or an engine backend
    ...                                          # scrape http://127.0.0.1:9400/metrics
    endpoint.close()                             # detaches; the last lease on a port stops its server

One server per (host, port) and process, shared by every backend of the process that asks for that port; it
serves its own ``prometheus_client.CollectorRegistry`` (never the global ``REGISTRY``, which SGLang's
``--enable-metrics`` runs in multiprocess mode), holding one :class:`kvtier.metrics.KvtierCollector` over
every attached object. Nothing is read between scrapes. Needs ``prometheus-client``
(``pip install 'kvtier[metrics]'``).
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import logging
import os
import socket
import socketserver
import threading
import weakref
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from ._errors import InvalidArgumentError, KvtierError
from .metrics import KvtierCollector, check_source, require_prometheus

logger = logging.getLogger("kvtier.metrics")

#: the default ``metrics_host``: loopback only (``"0.0.0.0"`` exposes the endpoint to every network)
DEFAULT_HOST = "127.0.0.1"


def check_options(port: Any, host: Any, *, offset: int = 0, where: str = "") -> tuple[int | None, str]:
    """``(port to bind, host)`` from a backend's ``metrics_port`` and ``metrics_host``: None (off), 0 (a free
    port, picked at bind) or a port in [1, 65535], to which ``offset`` (the process's rank index) is added.
    A bad value raises :class:`~kvtier.InvalidArgumentError` naming the option (``where``, e.g.
    ``" (kvtier tier)"``, follows the name)."""
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise InvalidArgumentError(f"invalid argument `metrics_port`{where}: null (off), 0 (a free port) or a "
                                   f"port in [1, 65535], got {port!r}")
    if not isinstance(host, str) or not host.strip():
        raise InvalidArgumentError(f"invalid argument `metrics_host`{where}: a host name or address to bind "
                                   f"(\"127.0.0.1\": this machine only; \"0.0.0.0\": every network), got {host!r}")
    if port and port + offset > 65535:
        raise InvalidArgumentError(f"invalid argument `metrics_port`{where}: {port} plus this process's rank "
                                   f"index {offset} is past 65535; choose a lower port")
    return (port + offset if port else port), host.strip()


class _Sources:
    """The registry's one collector: a :class:`KvtierCollector` over what every lease attached, built at each
    scrape (a backend attached or closed between scrapes is in, or out, of the next one)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # weak references where the object allows them: serving a backend never keeps it (its store, its
        # namespace lock) alive after the engine dropped it
        self.by_lease: dict[int, list[Any]] = {}

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        with self.lock:
            refs = [s for lease in self.by_lease.values() for s in lease]
        stores = [x for x in (r() if isinstance(r, weakref.ref) else r for r in refs) if x is not None]
        if stores:
            yield from KvtierCollector(stores=stores).collect()


class _Handler(BaseHTTPRequestHandler):
    timeout = 10  # seconds a client may take to send its request
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if urlsplit(self.path).path != "/metrics":
            self.send_error(404, "kvtier serves /metrics")
            return
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        try:
            body = encoder(self.server.registry)
        except Exception:  # noqa: BLE001 - a failed scrape is an HTTP 500, never a dead server
            logger.exception("kvtier metrics: a scrape failed")
            self.send_error(500, "kvtier metrics: the scrape failed (see the process's log)")
            return
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # one line per scrape is noise in an engine's log


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_port = False  # (two processes must never share a port silently)
    request_queue_size = 64
    orphaned = False  # set in a forked child: the server thread is the parent's

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a scraper that hung up early (its timeout) is no traceback on the engine's standard error
        logger.debug("kvtier metrics: a request from %s failed", client_address, exc_info=True)

    def __init__(self, host: str, port: int, family: int) -> None:
        self.address_family = family
        self.host, self.sources, self.leases = host, _Sources(), 0
        self.registry = require_prometheus().CollectorRegistry(auto_describe=False)
        self.registry.register(self.sources)
        super().__init__((host, port), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1},
                                       name=f"kvtier-metrics-{self.port}", daemon=True)

    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # (HTTPServer's would look the host's name up in DNS)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host if ':' not in self.host else f'[{self.host}]'}:{self.port}/metrics"


_lock = threading.Lock()
#: this process's servers, by (host, port asked): port 0 names the one a first ``metrics_port: 0`` picked
_servers: dict[tuple[str, int], _Server] = {}
_lease_ids = itertools.count()


def _start(host: str, port: int) -> _Server:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise InvalidArgumentError(f"invalid argument `metrics_host`: cannot resolve {host!r} ({e})") from None
    try:
        server = _Server(host, port, infos[0][0])
    except OSError as e:
        hint = "choose another `metrics_port`, or 0 for a free one"
        if e.errno == errno.EADDRINUSE:
            hint = f"another process holds it; {hint}"
        raise KvtierError(f"`metrics_port` {port}: cannot serve kvtier's metrics on {host}:{port}: "
                          f"{e.strerror or e} ({hint})") from None
    server.thread.start()
    try:
        loopback = ipaddress.ip_address(str(server.server_address[0])).is_loopback
    except ValueError:
        loopback = False
    if not loopback:  # reachable from other machines: say so where it is seen
        logger.warning("kvtier metrics: serving %s, reachable beyond this machine (metrics_host %r)", server.url, host)
    elif port:
        logger.info("kvtier metrics: serving %s", server.url)
    else:  # the operator asked for a free port: it must reach the log whatever its configuration
        logger.warning("kvtier metrics: metrics_port 0 picked port %d: serving %s", server.port, server.url)
    return server


class MetricsEndpoint:
    """A lease on this process's ``/metrics`` server at (host, port): :meth:`claim` binds it (or joins the one
    already serving there), :meth:`attach` adds objects to what it serves, :meth:`close` removes them and
    stops the server once no lease is left. ``claim(None)`` is a lease on nothing (the option off)."""

    def __init__(self, server: _Server | None) -> None:
        self._server = server
        self._id = next(_lease_ids)

    @classmethod
    def claim(cls, port: int | None, host: str = DEFAULT_HOST, *, offset: int = 0) -> MetricsEndpoint:
        """Binds (host, ``port`` + ``offset``) or joins this process's server there; ``port`` 0 picks a free
        port (shared by every later ``port`` 0 on that host) and logs it. Raises
        :class:`~kvtier.InvalidArgumentError` for a bad value and :class:`~kvtier.KvtierError` when the port
        is held by someone else or ``prometheus-client`` is missing."""
        port, host = check_options(port, host, offset=offset)
        if port is None:
            return cls(None)
        require_prometheus()
        with _lock:
            # (a port asked for by number that a `metrics_port: 0` server picked earlier is that server)
            server = _servers.get((host, port)) or next(
                (s for (h, _), s in _servers.items() if port and h == host and s.port == port), None)
            if server is None:
                server = _servers[(host, port)] = _start(host, port)
            server.leases += 1
        return cls(server)

    @property
    def port(self) -> int | None:
        """The port served (the one picked, for ``metrics_port`` 0); None when off or closed."""
        return self._server.port if self._server is not None else None

    @property
    def url(self) -> str | None:
        """``http://host:port/metrics``; None when off or closed."""
        return self._server.url if self._server is not None else None

    def attach(self, source: Any) -> None:
        """Serves ``source``'s families from now on: a :class:`~kvtier.PageStore`, a
        :class:`~kvtier.tiers.TieredStore`, or an engine backend (what ``KvtierCollector(stores=...)``
        takes: a :class:`kvtier.metrics.MetricsSource`; anything else is an
        :class:`~kvtier.InvalidArgumentError` naming ``source``). No-op when off."""
        check_source(source, "source")
        if self._server is not None:
            try:
                ref: Any = weakref.ref(source)
                # (collected without close: it leaves what is served; the lease ends with its last object)
                weakref.finalize(source, self._dropped, ref).atexit = False  # (not at exit: no thread then)
            except TypeError:  # (an object without weak references is held)
                ref = source
            with self._server.sources.lock:
                self._server.sources.by_lease.setdefault(self._id, []).append(ref)

    def _dropped(self, ref: Any) -> None:
        # an attached object collected without close(): it leaves what is served, and a lease left with nothing
        # ends on a thread of its own (a collection may run on the server's thread, which shutdown() waits for)
        server = self._server
        if server is None:
            return
        with server.sources.lock:
            left = server.sources.by_lease.get(self._id, [])
            if ref in left:
                left.remove(ref)
            if left:
                return
        threading.Thread(target=self.close, name="kvtier-metrics-close", daemon=True).start()

    def close(self) -> None:
        """Removes what this lease attached; the last lease on a server stops it. Idempotent."""
        with _lock:
            server, self._server = self._server, None
            if server is None:
                return
            with server.sources.lock:
                server.sources.by_lease.pop(self._id, None)
            server.leases -= 1
            if server.leases > 0 or server.orphaned:  # (a forked child's copy: its thread is the parent's)
                return
            for key in [k for k, s in _servers.items() if s is server]:
                del _servers[key]
            server.shutdown()
            server.server_close()
        server.thread.join(timeout=5)


def _forget_after_fork() -> None:
    """In a forked child: the servers are the parent's (their threads did not come along). The child closes
    its copies of their sockets, keeps serving nothing, and may claim ports of its own."""
    global _lock
    _lock = threading.Lock()
    for server in _servers.values():
        server.orphaned = True
        try:
            server.socket.close()
        except OSError:
            pass
    _servers.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
