"""Download on first use of the two Mooncake FAST'25 traces the replay bench knows by name.

A named trace that is in none of the directories :func:`kvtier.replay.trace.trace_dirs` lists is
fetched from the Mooncake repository at the commit the traces last changed in (benches/traces/ATTRIBUTION.md),
into a cache directory, and kept only if its bytes have the sha256 the bench knows: a download that fails,
stops half-way, is interrupted or has other bytes leaves nothing behind.

Environment: ``KVTIER_TRACE_OFFLINE=1`` never downloads; ``KVTIER_TRACE_URL`` replaces the base URL (a mirror:
the file name is appended); ``KVTIER_TRACE_CACHE`` replaces the cache directory (default
``$XDG_CACHE_HOME/kvtier/traces``, else ``~/.cache/kvtier/traces``).
"""

from __future__ import annotations

import hashlib
import http.client
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .._errors import KvtierError
from .._progress import Progress

#: the Mooncake repository at the commit its FAST25 traces last changed in ("add FAST25 release")
DEFAULT_URL = ("https://raw.githubusercontent.com/kvcache-ai/Mooncake/3cca71daccf2a7afb8fe3f0295358f70e3a69fdb/"
               "FAST25-release/traces")
#: no known trace is larger than 4 MB; a response longer than this is not one of them
MAX_BYTES = 64 << 20
#: seconds a connection or a read may wait (each), and the whole download may take
TIMEOUT_S = 30.0
DEADLINE_S = 300.0


def cache_dir() -> Path:
    """Where downloaded traces are kept."""
    if os.environ.get("KVTIER_TRACE_CACHE"):
        return Path(os.environ["KVTIER_TRACE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / "traces"


def offline() -> bool:
    return os.environ.get("KVTIER_TRACE_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


def _remove_stale_parts(dest_dir: Path, file: str) -> None:
    """Removes temporary files of earlier downloads of ``file`` that died (SIGKILL, power loss) an hour ago or
    more; a younger one may be another process's download in progress."""
    now = time.time()
    for part in dest_dir.glob(f".{file}.*.part"):
        try:
            if now - part.stat().st_mtime > 3600:
                part.unlink()
        except OSError:
            pass


def fetch(name: str, file: str, sha256: str) -> Path:
    """Downloads trace ``name`` (``file`` in the repository) into :func:`cache_dir` and returns its path, after
    checking that its bytes have ``sha256``. Raises :class:`KvtierError` on any failure (naming the URL when the
    download failed, the cache directory when writing there did); nothing is left in the cache directory then."""
    url = f"{os.environ.get('KVTIER_TRACE_URL') or DEFAULT_URL}".rstrip("/") + "/" + file
    dest_dir = cache_dir()

    def local(e: OSError) -> KvtierError:
        return KvtierError(f"--trace {name}: cannot write the trace cache {dest_dir}: {e.strerror or e}")

    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_parts(dest_dir, file)
    except OSError as e:
        raise local(e) from None
    print(f"kvtier: downloading the {name} trace ({file}, kvcache-ai/Mooncake, Apache-2.0; "
          f"benches/traces/ATTRIBUTION.md) from {url}", file=sys.stderr)
    tmp: str | None = None
    try:
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{file}.", suffix=".part", dir=dest_dir)
        except OSError as e:
            raise local(e) from None
        try:
            out = os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            raise
        digest = hashlib.sha256()
        deadline = time.monotonic() + DEADLINE_S
        with out:
            try:
                resp = urllib.request.urlopen(url, timeout=TIMEOUT_S)  # noqa: S310 - https, or a mirror one chose
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
                raise _network(name, url, file, getattr(e, "reason", None) or e) from None
            with resp:
                total = max(0, int(resp.headers.get("Content-Length") or 0))
                if total > MAX_BYTES:
                    raise KvtierError(f"--trace {name}: {url} is {total} bytes, more than any known trace")
                bar = Progress(total or MAX_BYTES, f"downloading {file}")
                got = 0
                try:
                    while True:
                        try:
                            chunk = resp.read(1 << 16)
                        except (http.client.HTTPException, OSError, ValueError) as e:
                            raise _network(name, url, file, e) from None
                        if not chunk:
                            break
                        got += len(chunk)
                        if got > MAX_BYTES:
                            raise KvtierError(f"--trace {name}: {url} sent more than {MAX_BYTES} bytes, more than "
                                              "any known trace")
                        if time.monotonic() > deadline:
                            raise _network(name, url, file, f"not done after {DEADLINE_S:.0f} s ({got} bytes)")
                        digest.update(chunk)
                        try:
                            out.write(chunk)
                        except OSError as e:
                            raise local(e) from None
                        bar.update(got)
                finally:
                    bar.close()
            if total and got != total:
                raise _network(name, url, file, f"the response ended after {got} of {total} bytes")
            if digest.hexdigest() != sha256:
                raise KvtierError(f"--trace {name}: {url} sent bytes whose sha256 is {digest.hexdigest()}, not "
                                  f"the {name} trace's {sha256}; nothing was kept")
            try:
                out.flush()
                os.fsync(out.fileno())
                os.fchmod(out.fileno(), 0o644)  # (mkstemp makes it 0600; public data others sharing the cache read)
            except OSError as e:
                raise local(e) from None
        dest = dest_dir / file
        try:
            os.replace(tmp, dest)
        except OSError as e:
            raise local(e) from None
        tmp = None
        return dest
    finally:  # a failure, a Ctrl-C: no partial file is left
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _network(name: str, url: str, file: str, why: object) -> KvtierError:
    return KvtierError(f"--trace {name}: could not download {url}: {why}. Put {file} in one of the directories the "
                       "bench searches (benches/traces/ATTRIBUTION.md), set KVTIER_TRACE_DIR, or pass a path")
