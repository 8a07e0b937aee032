"""Request traces in the Mooncake FAST'25 format, and the token counts the replay bench takes.

One JSON object per line: ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens) and
``hash_ids``: one id per block of :data:`BLOCK_TOKENS` tokens of the prompt, equal ids naming the same
prefix block (the last block may be partial). Plain ``.jsonl`` or gzip-compressed ``.jsonl.gz``.

The two traces the paper's figures come from are known by name (``conversation``, ``synthetic``) and by
the sha256 of their uncompressed bytes; a named trace is looked for in ``$KVTIER_TRACE_DIR``, then
``benches/traces/`` and ``shared/traces/`` of the source tree, then the download cache, and downloaded on
first use where it is in none of them (:mod:`kvtier.replay.fetch`); a file that matches neither
checksum is refused. benches/traces/ATTRIBUTION.md says where they come from.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .._errors import KvtierError
from . import fetch as replay_fetch

#: tokens per block of the trace format (``hash_ids`` are per 512-token block)
BLOCK_TOKENS = 512


@dataclass(frozen=True)
class KnownTrace:
    file: str  # uncompressed file name in the Mooncake repository
    sha256: str  # of the uncompressed JSONL bytes
    requests: int
    #: the paper's figures for this workload (Mooncake, FAST'25, §5.3.1 Figure 9 and §5.3.2 Figure 10)
    paper_pct_of_best_at_3m: int
    paper_shared_ratio: float


KNOWN = {
    "conversation": KnownTrace(
        "conversation_trace.jsonl", "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df", 12031, 41, 2.22
    ),
    "synthetic": KnownTrace(
        "synthetic_trace.jsonl", "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131", 3993, 46, 2.36
    ),
}
_BY_SHA = {k.sha256: name for name, k in KNOWN.items()}


@dataclass(frozen=True)
class Request:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass
class Trace:
    path: str
    sha256: str
    requests: list[Request]
    #: the known workload these bytes are (by checksum), or None
    known: str | None


def _source_root() -> Path:
    return Path(__file__).resolve().parents[3]


def trace_dirs() -> list[Path]:
    """Where a trace named ``conversation`` or ``synthetic`` is looked for, in order."""
    env = os.environ.get("KVTIER_TRACE_DIR")
    root = _source_root()
    return [Path(p) for p in ([env] if env else [])] + [
        root / "benches" / "traces",
        root / "shared" / "traces",
        root.parent / "shared" / "traces",  # a shared/ directory beside the checkout
        Path.cwd() / "benches" / "traces",
        replay_fetch.cache_dir(),  # downloaded on first use
    ]


def resolve(spec: str) -> tuple[str, str | None]:
    """``(path, known name or None)`` of ``--trace``: a file path, or a known workload's name."""
    if spec in KNOWN:
        base = KNOWN[spec].file
        for d in trace_dirs():
            for cand in (d / (base + ".gz"), d / base):
                if cand.is_file():
                    return str(cand), spec
        if not replay_fetch.offline():
            return str(replay_fetch.fetch(spec, base, KNOWN[spec].sha256)), spec
        raise KvtierError(
            f"--trace {spec}: {base}[.gz] is not in any of "
            f"{', '.join(str(d) for d in trace_dirs())} and KVTIER_TRACE_OFFLINE is set (benches/traces/"
            "ATTRIBUTION.md says where it comes from; or set KVTIER_TRACE_DIR, or pass a path)"
        )
    if not os.path.exists(spec):
        raise KvtierError(f"--trace {spec}: no such file (give a path, or one of {sorted(KNOWN)})")
    if os.path.isdir(spec):
        raise KvtierError(f"--trace {spec}: is a directory, not a trace file")
    return spec, None


def _int_field(obj: dict[str, object], name: str, where: str, minimum: int) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise KvtierError(f"{where}: `{name}` must be an integer >= {minimum}, got {v!r}")
    return v


def parse_line(line: str, where: str) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise KvtierError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise KvtierError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in ids):
        raise KvtierError(f"{where}: `hash_ids` must be a list of integers")
    n = _int_field(obj, "input_length", where, 1)
    if len(ids) != math.ceil(n / BLOCK_TOKENS):
        raise KvtierError(
            f"{where}: {len(ids)} hash_ids for input_length {n} (expected one per "
            f"{BLOCK_TOKENS}-token block: {math.ceil(n / BLOCK_TOKENS)})"
        )
    return Request(_int_field(obj, "timestamp", where, 0), n, _int_field(obj, "output_length", where, 0), tuple(ids))


def load(spec: str, limit: int | None = None) -> Trace:
    """Reads and checks a trace (every line, even past ``limit``, so the checksum covers the file); a known
    workload's name must find bytes with its checksum. A downloaded copy whose bytes are no longer the known
    ones (a damaged disk, a cut copy) is removed and downloaded again, once."""
    try:
        return _load(spec, limit)
    except _DamagedCopy as damaged:
        try:
            os.unlink(damaged.path)
        except OSError as e:
            raise KvtierError(f"{damaged.path}: a damaged downloaded copy (sha256 {damaged.sha}) that cannot be "
                              f"removed ({e.strerror or e}): delete it") from None
        print(f"kvtier: {damaged.path}: the downloaded copy is damaged (sha256 {damaged.sha}); removed, "
              "downloading it again", file=sys.stderr)
    try:
        return _load(spec, limit)
    except _DamagedCopy as again:  # (the copy just downloaded was checked before it was kept: a disk at fault)
        raise KvtierError(f"{again.path}: sha256 {again.sha} is not the known trace's, again after a fresh "
                          "download (benches/traces/ATTRIBUTION.md)") from None


class _DamagedCopy(Exception):
    def __init__(self, path: str, sha: str) -> None:
        super().__init__(path)
        self.path, self.sha = path, sha


def _load(spec: str, limit: int | None) -> Trace:
    path, name = resolve(spec)
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise KvtierError(f"{path}: cannot read the trace ({exc})") from None
    sha = hashlib.sha256(raw).hexdigest()
    if name is not None and sha != KNOWN[name].sha256:
        if Path(path).parent == replay_fetch.cache_dir() and not replay_fetch.offline():
            raise _DamagedCopy(path, sha)
        raise KvtierError(
            f"{path}: sha256 {sha} is not the {name} trace's {KNOWN[name].sha256} (a damaged or "
            "different file; benches/traces/ATTRIBUTION.md)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvtierError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    reqs = []
    for no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            reqs.append(parse_line(line, f"{path}:{no}"))
    if not reqs:
        raise KvtierError(f"{path}: no requests in the trace")
    return Trace(path, sha, reqs[:limit] if limit is not None else reqs, _BY_SHA.get(sha))


_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
#: a capacity without a limit
UNLIMITED = math.inf


def parse_tokens(name: str, text: str) -> float:
    """A token count: ``"3M"`` (decimal units: K = 10^3, M = 10^6, G = 10^9), ``"1.5M"``, ``"524288"``, or
    ``inf`` / ``unlimited``. Whole blocks are what a tier holds (a capacity is rounded down to blocks)."""
    s = text.strip().lower().replace("_", "")
    if s in ("inf", "unlimited"):
        return UNLIMITED
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([kmg]?)", s)
    if m is None:
        raise KvtierError(f"{name}: {text!r} is not a token count (e.g. 3M, 500K, 1048576 or inf)")
    value = float(m.group(1)) * _TOKEN_UNITS[m.group(2)]
    if value < BLOCK_TOKENS:
        raise KvtierError(f"{name}: {text!r} is less than one {BLOCK_TOKENS}-token block")
    return value


def blocks_of(tokens: float) -> int | None:
    """Whole blocks of a token capacity (None: unlimited)."""
    return None if math.isinf(tokens) else int(tokens // BLOCK_TOKENS)


def label(tokens: float) -> str:
    if math.isinf(tokens):
        return "inf"
    for unit, div in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if tokens >= div and tokens % (div // 100 or 1) == 0:
            return f"{tokens / div:g}{unit}"
    return f"{int(tokens)}"
