"""Download on first use of the two Mooncake FAST'25 traces the replay bench knows by name.

A named trace that is in none of the directories :func:`kvtier.benchmarks.replay_trace.trace_dirs` lists is
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
TIMEOUT_S = 30.0


def cache_dir() -> Path:
    """Where downloaded traces are kept."""
    if os.environ.get("KVTIER_TRACE_CACHE"):
        return Path(os.environ["KVTIER_TRACE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / "traces"


def offline() -> bool:
    return os.environ.get("KVTIER_TRACE_OFFLINE", "").strip().lower() not in ("", "0", "false", "no")


def fetch(name: str, file: str, sha256: str) -> Path:
    """Downloads trace ``name`` (``file`` in the repository) into :func:`cache_dir` and returns its path, after
    checking that its bytes have ``sha256``. Raises :class:`KvtierError` (naming the URL) on any failure; nothing
    is left in the cache directory then."""
    url = f"{os.environ.get('KVTIER_TRACE_URL') or DEFAULT_URL}".rstrip("/") + "/" + file
    dest_dir = cache_dir()
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvtierError(f"--trace {name}: cannot create the trace cache {dest_dir}: {e.strerror or e}") from None
    print(f"kvtier: downloading the {name} trace ({file}, kvcache-ai/Mooncake, Apache-2.0; "
          f"benches/traces/ATTRIBUTION.md) from {url}", file=sys.stderr)
    fd, tmp = tempfile.mkstemp(prefix=f".{file}.", suffix=".part", dir=dest_dir)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:  # noqa: S310 - https or a chosen mirror
                    total = int(resp.headers.get("Content-Length") or 0)
                    if total > MAX_BYTES:
                        raise KvtierError(f"--trace {name}: {url} is {total} bytes, more than any known trace")
                    bar = Progress(total or MAX_BYTES, f"downloading {file}")
                    got = 0
                    try:
                        while chunk := resp.read(1 << 16):
                            got += len(chunk)
                            if got > MAX_BYTES:
                                raise KvtierError(f"--trace {name}: {url} sent more than {MAX_BYTES} bytes, more than "
                                                  "any known trace")
                            digest.update(chunk)
                            out.write(chunk)
                            bar.update(got)
                    finally:
                        bar.close()
                    if total and got != total:
                        raise KvtierError(f"--trace {name}: {url} ended after {got} of {total} bytes")
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
                why = getattr(e, "reason", None) or e
                raise KvtierError(f"--trace {name}: could not download {url}: {why}. Put {file} in one of the "
                                  "directories the bench searches (benches/traces/ATTRIBUTION.md), set "
                                  "KVTIER_TRACE_DIR, or pass a path") from None
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            raise KvtierError(f"--trace {name}: {url} sent bytes whose sha256 is {digest.hexdigest()}, not the "
                              f"{name} trace's {sha256}; nothing was kept")
        dest = dest_dir / file
        os.replace(tmp, dest)
        return dest
    except BaseException:  # a failure, a Ctrl-C: no partial file is left
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
