"""``kvtier namespaces``, ``kvtier remove`` and ``kvtier budget``: a store directory's namespaces as a whole
(docs/STORE.md, "Namespaces of a store directory"), and the writer's counters ``kvtier stats`` shows."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from typing import Any

from ._errors import KvtierError
from .config import parse_size
from .namespace import Namespace

_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> int:
    """Seconds of an age such as ``30d``, ``12h``, ``90m``, ``2w`` or ``45s``."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([smhdw])\s*", text or "")
    if m is None:
        raise KvtierError(f"--older-than: expected a number and a unit (s, m, h, d or w), e.g. 30d; got {text!r}")
    return int(m.group(1)) * _AGE_UNITS[m.group(2)]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{max(seconds, 0):.0f}s ago"


def model_of(namespace: str | None) -> str | None:
    """The model a namespace string names (``...|model=NAME|...``), as far as it can be told."""
    ns = Namespace.parse_or_none(namespace)
    model = ns.model if ns is not None else None
    # (SGLang names an MLA model "NAME|mla": the model is NAME)
    return model.split("|", 1)[0] if model is not None else None


def names_model(namespace: str | None, model: str) -> bool:
    """Whether a namespace string names ``model`` (an MLA model's ``NAME|mla`` matches ``NAME`` too)."""
    ns = Namespace.parse_or_none(namespace)
    named = ns.model if ns is not None else None
    return named is not None and named in (model, model + "|mla")


def _objects(path: str, ns: str) -> tuple[int | None, str | None]:
    """Objects of a namespace (a read-only open replays its journal), or a problem."""
    from . import _native

    try:
        s = _native.PageStore(path, ns, 1 << 62, 4, None, True)
    except (OSError, KvtierError, ValueError) as exc:
        return None, str(exc)
    try:
        return int(s.stats()["objects"]), None
    finally:
        s.close()


def list_namespaces(path: str) -> dict[str, Any]:
    """The store's budget and every namespace directory with its size, objects, last write and holder."""
    from . import _native

    if not os.path.isdir(path):
        raise KvtierError(f"{path}: no such store directory")
    budget, entries = _native.store_namespaces(path)
    now = time.time()
    out = []
    for e in entries:
        e = dict(e)
        ns = e["namespace"]
        e["model"] = model_of(ns)
        e["objects"], e["problem"] = None, None
        if e["dir"].startswith(".removing-"):
            e["problem"] = f"an interrupted removal (`kvtier remove {path} {e['dir']} --yes` finishes it)"
        elif ns is None:
            e["problem"] = "no readable NAMESPACE file"
        elif _native.namespace_dir(ns) != e["dir"]:
            e["problem"] = f"its NAMESPACE names the directory {_native.namespace_dir(ns)} (a copy or a rename)"
        else:
            e["objects"], e["problem"] = _objects(path, ns)
        last = e["last_write_unix"]
        e["idle_s"] = None if last is None else max(0, int(now - last))
        out.append(e)
    return {"path": os.path.abspath(path), "format": _native.store_format_version(), "budget_bytes": budget,
            "disk_bytes": sum(e["disk_bytes"] for e in out), "namespaces": out}


def cmd_namespaces(args: argparse.Namespace) -> int:
    info = list_namespaces(args.path)
    if args.json:
        print(json.dumps(info, indent=1, sort_keys=True))
        return 0
    budget = info["budget_bytes"]
    print(f"{info['path']}: {len(info['namespaces'])} namespace(s) holding {human_bytes(info['disk_bytes'])} on disk; "
          + (f"budget {human_bytes(budget)} for the whole directory" if budget else "no budget for the directory")
          + f" (format {info['format']})")
    if not info["namespaces"]:
        return 0
    print(f"{'DIR':<20} {'SIZE':>10} {'OBJECTS':>9} {'LAST WRITE':>11}  {'HELD BY':<12} NAMESPACE")
    for e in info["namespaces"]:
        held = (f"pid {e['pid']}" if e["pid"] else "a process") if e["live"] else "-"
        objects = "-" if e["objects"] is None else str(e["objects"])
        print(f"{e['dir']:<20} {human_bytes(e['disk_bytes']):>10} {objects:>9} {human_age(e['idle_s']):>11}  "
              f"{held:<12} {e['namespace'] or '?'}")
        if e["problem"]:
            print(f"{'':<20} problem: {e['problem']}")
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    """Removes the namespaces named or selected; without --yes, says what it would remove."""
    from . import _native

    if not (args.dirs or args.model or args.older_than or args.all):
        raise KvtierError("kvtier remove: name namespace directories (ns-...), or select them with --model, "
                          "--older-than or --all")
    older = parse_age(args.older_than) if args.older_than else None
    info = list_namespaces(args.path)
    by_dir = {e["dir"]: e for e in info["namespaces"]}
    chosen = []
    for d in args.dirs:
        name = d if d in by_dir or d.startswith(("ns-", ".removing-")) else _native.namespace_dir(d)
        if name not in by_dir:
            raise KvtierError(f"{args.path}: no namespace directory {d!r} (`kvtier namespaces {args.path}` lists them)")
        chosen.append(by_dir[name])
    if not args.dirs:
        chosen = list(info["namespaces"])
    if args.model:
        chosen = [e for e in chosen if names_model(e["namespace"], args.model)]
    if older is not None:
        chosen = [e for e in chosen if e["idle_s"] is None or e["idle_s"] >= older]
    if not chosen:
        print(f"{info['path']}: no namespace matches; nothing removed")
        return 0
    refused = 0
    for e in chosen:
        what = f"{e['dir']} ({human_bytes(e['disk_bytes'])}, last write {human_age(e['idle_s'])}, {e['namespace'] or '?'})"
        if e["live"] and not args.force:
            refused += 1
            who = f"pid {e['pid']}" if e["pid"] else "a running process"
            print(f"kept {what}: in use by {who} (its LOCK is held; stop it, or --force)")
            continue
        if not args.yes:
            print(f"would remove {what}")
            continue
        try:
            freed = _native.remove_namespace(args.path, e["dir"], args.force)
        except OSError as exc:  # taken by a writer since it was listed
            refused += 1
            print(f"kept {e['dir']}: {exc}")
            continue
        print(f"removed {what}: {human_bytes(freed)} freed"
              + (" once its process exits (it holds the files open)" if e["live"] else ""))
    if not args.yes:
        print("(nothing removed: add --yes to remove)")
    return 1 if refused else 0


def cmd_budget(args: argparse.Namespace) -> int:
    from . import _native

    if not os.path.isdir(args.path):
        raise KvtierError(f"{args.path}: no such store directory")
    if args.size is not None:
        if args.size.strip().lower() in ("none", "off"):
            _native.set_store_budget(args.path, None)
        elif parse_size("SIZE", args.size) == 0:  # (PageStore(budget_bytes=0) means none; said here, not guessed)
            raise KvtierError(f"a budget of {args.size.strip()} would hold nothing; to remove the budget say "
                              f"`kvtier budget {args.path} none`")
        else:
            size = parse_size("SIZE", args.size, 4096)
            _native.set_store_budget(args.path, size)
    budget = _native.store_budget(args.path)
    print(f"{os.path.abspath(args.path)}: " + (f"budget {human_bytes(budget)} ({budget} bytes) for the whole "
                                                 "directory" if budget else "no budget"))
    return 0


#: counters the writer leaves in STATS that `kvtier stats` shows
WRITER_COUNTERS = ("hits", "misses", "bytes_read", "bytes_written", "puts", "evictions", "corrupt_reads",
                   "write_failures", "read_failures", "journal_failures", "compactions", "capacity_bytes",
                   "budget_bytes", "claimed_bytes", "raw_bytes_written", "decoded_bytes")


def writer_counters(ns_dir: str, live: bool, holder_pid: int | None) -> dict[str, Any]:
    """The counters the namespace's writer left in its ``STATS`` file, with their age and whether that writer
    is still running; ``{"counters": "none recorded"}`` without the file."""
    try:
        with open(os.path.join(ns_dir, "STATS"), encoding="utf-8") as f:
            st = json.load(f)
        assert isinstance(st, dict)
    except FileNotFoundError:
        return {"counters": "none recorded (no writer of this kvtier version has run 2 s or closed it)"}
    except (OSError, ValueError, AssertionError) as exc:
        return {"counters": f"unreadable STATS file ({exc})"}
    out = {k: st[k] for k in WRITER_COUNTERS if k in st}
    if st.get("decode_ns"):  # the writer's decoding, GB/s of decoded bytes per thread
        out["decode_GBps_per_thread"] = round(st.get("decoded_bytes", 0) / st["decode_ns"], 3)
    if st.get("encode_ns"):  # its put batches' coding, GB/s of bytes handed to the codec
        out["encode_GBps_batch"] = round(st.get("encode_input_bytes", 0) / st["encode_ns"], 3)
    written = st.get("written_unix_ms", 0) / 1000
    out["counters_age_s"] = round(max(0.0, time.time() - written), 1)
    out["counters_since"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(st.get("opened_unix_ms", 0) / 1000))
    if st.get("maintained_unix_ms"):  # an erase or a repair since, which kept these counters
        out["counters_maintained"] = time.strftime("%Y-%m-%d %H:%M:%S",
                                                   time.localtime(st["maintained_unix_ms"] / 1000))
    pid = st.get("pid")
    alive = bool(live and holder_pid == pid)
    out["counters_writer"] = f"pid {pid}, " + ("running (updated every 2 s)" if alive else "ended")
    return out
