"""The ``kvtier`` command line. Errors are one line on stderr with a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from ._errors import KvtierError
from ._progress import run_with_progress
from .namespace import Namespace


def _is_mla(ns: str) -> bool:
    """Whether a namespace string names an MLA geometry (one object per page)."""
    parsed = Namespace.parse_or_none(ns)
    return parsed is not None and parsed.mla


def _namespaces(path: str) -> list[tuple[str, str, str | None]]:
    """``(directory, namespace string, problem)`` of every namespace directory under a store root. A
    directory whose ``NAMESPACE`` names another directory (a copy or a rename: opening it would open that
    other one) or cannot be read has a problem and is not opened."""
    from ._native import namespace_dir

    if not os.path.isdir(path):
        raise KvtierError(f"{path}: no such store directory")
    out: list[tuple[str, str, str | None]] = []
    for name in sorted(os.listdir(path)):
        ns_file = os.path.join(path, name, "NAMESPACE")
        if not (name.startswith("ns-") and os.path.isfile(ns_file)):
            continue
        try:
            with open(ns_file, encoding="utf-8") as f:
                ns = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            out.append((os.path.join(path, name), "", f"its NAMESPACE file cannot be read ({exc})"))
            continue
        problem = None
        if namespace_dir(ns) != name:
            problem = (f"its NAMESPACE names the directory {namespace_dir(ns)}, not this one (a copied or renamed "
                       "namespace directory: kvtier never reads it; move it back or delete it)")
        out.append((os.path.join(path, name), ns, problem))
    if not out:
        raise KvtierError(f"{path}: not a kvtier store (no namespace directories)")
    return out


def _open(path: str, ns: str, writable: bool = False) -> Any:
    """A namespace opened read-only (nothing on disk changes), or writable for a repair: opened for
    maintenance, which keeps the counters and capacity its engine left in STATS."""
    from . import _native

    try:
        if writable:
            return _native.PageStore(path, ns, 1 << 62, 4, None, maintenance=True)
        return _native.PageStore(path, ns, 1 << 62, 4, None, True)
    except OSError as exc:
        if "already open" in str(exc):
            raise KvtierError(f"{path}: namespace is in use by a running process (its LOCK is held); "
                              "stop it before repairing") from None
        raise


def _damage(st: dict[str, Any]) -> list[str]:
    """What opening the store found that a repair would remove."""
    out = []
    if st["journal_damaged_spans"]:
        out.append(f"{st['journal_damaged_spans']} damaged journal span(s), {st['journal_damaged_bytes']} bytes "
                   "(records skipped)")
    if st["dropped_records"]:
        out.append(f"{st['dropped_records']} journal record(s) naming bytes the data files do not have (dropped)")
    if st["missing_class_files"]:
        out.append("missing data file(s): " + ", ".join(f"class-{c}.dat" for c in st["missing_class_files"]))
    if st["read_only"] and st["recovered_tail_bytes"]:
        out.append(f"a torn journal tail of {st['recovered_tail_bytes']} bytes"
                   + (" (a write in progress?)" if st["live_writer"] else ""))
    return out


def cmd_inspect(args: argparse.Namespace) -> int:
    for d, ns, problem in _namespaces(args.path):
        if problem:
            print(f"{os.path.basename(d)}  damage: {problem}")
            continue
        s = _open(args.path, ns)
        try:
            st = s.stats()
            files = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.endswith((".dat", ".log"))}
            print(f"{os.path.basename(d)}  {ns}")
            per = 1 if _is_mla(ns) else 2  # an MLA page is one object
            print(f"  objects {st['objects']} ({st['objects'] // per} pages), {st['bytes_used'] / 1e6:.1f} MB in slots"
                  + ("  [open in a running process: a snapshot]" if st["live_writer"] else ""))
            if st["coded_objects"]:
                print(f"  compressed: {st['coded_objects']} objects; {st['content_bytes'] / 1e6:.1f} MB of KV in "
                      f"{st['stored_bytes'] / 1e6:.1f} MB ({st['content_bytes'] / st['stored_bytes']:.3f}x)")
            for what in _damage(st):
                print(f"  damage: {what}")
            for f, n in files.items():
                print(f"  {f:<24} {n / 1e6:10.1f} MB")
        finally:
            s.close()
    return 0


#: what `kvtier stats` shows of the store on disk (the opening process's own traffic counters are nothing)
_DISK_STATS = ("objects", "bytes_used", "data_bytes_held", "journal_bytes_held", "journal_damaged_spans",
               "journal_damaged_bytes", "dropped_records", "missing_class_files", "recovered_tail_bytes",
               "superseded_by_slot", "live_writer", "dir", "coded_objects", "stored_bytes", "content_bytes")


def cmd_stats(args: argparse.Namespace) -> int:
    """Every namespace's counters, read-only (the store is opened without its lock and nothing is written):
    what is on disk, and the traffic its writer counted (hits, misses, bytes moved, evictions, failures,
    capacity), which the writer leaves in the namespace's STATS file every 2 s and when it closes."""
    import json

    from . import _native
    from ._store_cli import writer_counters

    budget, held = _native.store_namespaces(args.path) if os.path.isdir(args.path) else (None, [])
    holders = {e["dir"]: e["pid"] for e in held}
    out: dict[str, dict[str, Any]] = {}
    for d, ns, problem in _namespaces(args.path):
        if problem:
            out[os.path.basename(d)] = {"namespace": ns, "damage": problem}
            continue
        s = _open(args.path, ns)
        try:
            st = dict(s.stats())
        finally:
            s.close()
        st = {k: st[k] for k in _DISK_STATS if k in st}
        st["pages"] = st["objects"] // (1 if _is_mla(ns) else 2)
        st["compression_ratio"] = round(st["content_bytes"] / st["stored_bytes"], 4) if st.get("stored_bytes") else 1.0
        st["namespace"] = ns
        st["store_budget_bytes"] = budget
        st.update(writer_counters(d, bool(st["live_writer"]), holders.get(os.path.basename(d))))
        out[os.path.basename(d)] = st
    if args.json:
        print(json.dumps(out, indent=1, sort_keys=True))
        return 0
    for name, st in out.items():
        print(f"{name}  {st.pop('namespace')}")
        for k in sorted(st):
            print(f"  {k:<28} {st[k]}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    repair = args.repair or args.drop
    damaged = unrepaired = 0  # (a namespace directory with a problem is reported, never repaired)
    for d, ns, problem in _namespaces(args.path):
        if problem:
            damaged += 1
            unrepaired += 1
            print(f"{os.path.basename(d)}: DAMAGED — {problem}" + (" (not repaired)" if repair else ""))
            continue
        s = _open(args.path, ns, writable=repair)
        try:
            st = s.stats()
            found = _damage(st)
            r = run_with_progress(functools.partial(s.verify, repair), s.verify_progress,
                                  f"verifying {os.path.basename(d)}")
        finally:
            s.close()
        bad = r["corrupt"] + r["unreadable"]
        found += [f"{len(r['corrupt'])} corrupt object(s) (failing their checksum)"] if r["corrupt"] else []
        found += [f"{len(r['unreadable'])} object(s) that cannot be read"] if r["unreadable"] else []
        name = os.path.basename(d)
        if not found:
            print(f"{name}: {r['checked']} objects checked, ok")
            continue
        damaged += 1
        print(f"{name}: {r['checked']} objects checked, DAMAGED" + (" — repaired" if repair else ""))
        for what in found:
            print(f"  {what}")
        for k in bad[:20]:
            print(f"  {'dropped' if repair else 'corrupt'}: {k}")
        if not repair:
            print(f"  `kvtier verify --repair {args.path}` would delete the bad objects and rewrite the journal "
                  "without the damaged records")
            if st["live_writer"]:
                print("  note: a running process has this store open; objects replaced while this ran can "
                      "show as checksum failures")
    return 1 if (damaged and not repair) or unrepaired else 0


#: the options of the demo (examples/kvtier_demo, ``python -m kvtier_demo --help`` describes each)
DEMO_OPTIONS = ("[--layers N] [--pages N] [--conversations N] [--turns N] [--store-dir DIR] [--keep] [--seed N] "
                "[--window N|all] [--cluster]")


def moved_demo_text() -> str:
    """What ``kvtier demo`` says: the demo is not part of the package; where it runs, with its options."""
    return ("kvtier demo: the demo runs from kvtier's source checkout (examples/kvtier_demo/), not from the installed "
            "package: make demo, or PYTHONPATH=python:examples python -m kvtier_demo " + DEMO_OPTIONS
            + " (python -m kvtier_demo --help describes them; --cluster needs kvtier[mooncake]; README 'Try it')")


def cmd_demo() -> int:
    print(moved_demo_text(), file=sys.stderr)
    return 2


#: the benches that moved out of the package into the source checkout (benches/python/kvtier_bench)
MOVED_BENCHES = ("pin", "transfer", "store", "mooncake", "tenants")


def moved_bench_text(name: str) -> str:
    """What ``kvtier bench NAME`` says for a bench that is no longer part of the package."""
    return (f"kvtier bench {name}: the benches are not part of the installed package; they run from kvtier's source "
            f"checkout (benches/python/kvtier_bench/): PYTHONPATH=python:benches/python python -m kvtier_bench {name} "
            "[options] (README 'Benchmarks'). The trace replay ships here: kvtier replay --help")


def cmd_replay(rest: list[str], prog: str) -> int:
    if {"-h", "--help"} & set(rest):  # (the options without the replay: no torch needed, nothing imported)
        from .replay.options import parser

        parser(prog).print_help()
        return 0
    from .replay.command import main

    main(rest)
    return 0


def cmd_bench(args: argparse.Namespace, rest: list[str], bench_parser: argparse.ArgumentParser) -> int:
    if args.which is None:
        bench_parser.print_help()
        return 0 if {"-h", "--help"} & set(rest) else 2
    if args.which in MOVED_BENCHES:
        print(moved_bench_text(args.which), file=sys.stderr)
        return 2
    return cmd_replay(rest, "kvtier bench replay")


def _main(argv: list[str] | None) -> int:
    from ._native import __version__

    parser = argparse.ArgumentParser(prog="kvtier", description="Host-memory and disk tier for LLM KV caches.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", add_help=False,
                   help="the verified end-to-end demo: it runs from a source checkout (make demo, or python -m "
                   "kvtier_demo; `kvtier demo` says how)")
    sub.add_parser("replay", add_help=False,
                   help="replay a request trace through kvtier's real tiers beside an LRU model of them: hit rates, "
                   "bytes moved and time to first token for a host tier and store capacity (a sizing tool; "
                   "`kvtier replay --help` lists its options)")
    bench = sub.add_parser("bench", add_help=False,
                           help="`kvtier bench replay` is `kvtier replay`; the benchmarks (pin, transfer, store, "
                           "mooncake, tenants) run from a source checkout: python -m kvtier_bench NAME",
                           description="kvtier bench replay [options]: the same as `kvtier replay`. The benchmarks "
                           f"({', '.join(MOVED_BENCHES)}) are not part of the installed package; from a source "
                           "checkout: PYTHONPATH=python:benches/python python -m kvtier_bench NAME [options].")
    bench.add_argument("which", nargs="?", choices=[*MOVED_BENCHES, "replay"])
    ins = sub.add_parser("inspect", help="namespaces, pages, bytes, files and damage of a store directory (read-only)")
    ins.add_argument("path")
    stats = sub.add_parser("stats", help="a store's counters per namespace: what is on disk, and its writer's hits, "
                           "misses, bytes moved and capacity with their age (read-only: changes nothing on disk)")
    stats.add_argument("path")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    from . import _store_cli

    nss = sub.add_parser("namespaces", help="the namespaces of a store directory: size, objects, last write, the "
                         "process holding each, and the directory's budget (read-only)")
    nss.add_argument("path")
    nss.add_argument("--json", action="store_true", help="print JSON instead of a table")
    rm = sub.add_parser("remove", help="remove namespaces of a store directory (named, or by --model / --older-than "
                        "/ --all); says what it would remove unless --yes")
    rm.add_argument("path")
    rm.add_argument("dirs", nargs="*", metavar="NAMESPACE-DIR", help="ns-... directory names (or namespace strings)")
    rm.add_argument("--model", help="only namespaces of this model name")
    rm.add_argument("--older-than", metavar="AGE", help="only namespaces not written for AGE (e.g. 30d, 12h)")
    rm.add_argument("--all", action="store_true", help="every namespace (with the other filters: every match)")
    rm.add_argument("--force", action="store_true", help="also namespaces a live process holds (it keeps their "
                    "space until it exits)")
    rm.add_argument("--yes", action="store_true", help="remove (without it, only say what would be removed)")
    bud = sub.add_parser("budget", help="show or set the disk budget of a whole store directory (every namespace, "
                         "every process)")
    bud.add_argument("path")
    bud.add_argument("size", nargs="?", help="a size (e.g. 512G), or none (or off) to remove the budget")
    ver = sub.add_parser("verify", help="re-read every object of a store and check its checksum and journal "
                         "(read-only; exit 1 on damage)")
    ver.add_argument("path")
    ver.add_argument("--repair", action="store_true",
                     help="delete corrupt objects and rewrite the journal without damaged records (needs the store "
                     "closed)")
    ver.add_argument("--drop", action="store_true", help="the same as --repair (kept for old scripts)")
    from . import _cluster_cli, _tenant_cli

    _cluster_cli.add_parser(sub)
    _tenant_cli.add_parsers(sub)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("bench", "replay", "cluster", "demo"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if isinstance(getattr(args, "path", None), str) and not args.path.strip():
        parser.error(f"`kvtier {args.command}`: PATH must name a store directory, got an empty string")
    commands = {"demo": lambda: cmd_demo(), "bench": lambda: cmd_bench(args, rest, bench),
                "replay": lambda: cmd_replay(rest, "kvtier replay"),
                "inspect": lambda: cmd_inspect(args), "verify": lambda: cmd_verify(args),
                "stats": lambda: cmd_stats(args), "cluster": lambda: _cluster_cli.run(args, rest),
                "namespaces": lambda: _store_cli.cmd_namespaces(args), "remove": lambda: _store_cli.cmd_remove(args),
                "budget": lambda: _store_cli.cmd_budget(args), "keys": lambda: _tenant_cli.cmd_keys(args),
                "erase": lambda: _tenant_cli.cmd_erase(args)}
    return exit_status("kvtier", commands[args.command],
                       f"`kvtier {args.command}` needs torch, which is not installed: pip install 'kvtier[torch]' "
                       "(or torch itself)")


def exit_status(prog: str, command: Callable[[], int], needs_torch: str) -> int:
    """``command()``'s exit status, its errors as one line each on stderr, led by ``prog``: a reader that left
    (141, silent), Ctrl-C (130), torch missing (``needs_torch``), kvtier's, the OS's and bad values, an
    allocation the machine cannot make (1). The kvtier CLI's, and the checkout's bench and demo commands'."""
    try:
        return command()
    except BrokenPipeError:  # `kvtier stats DIR | head`: the reader left; say nothing, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        print(f"{prog}: error: {needs_torch}", file=sys.stderr)
        return 1
    except (KvtierError, OSError, ValueError) as exc:
        print(f"{prog}: error: {os_error_text(exc) if isinstance(exc, OSError) else exc}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as exc:  # e.g. an allocation the machine cannot make
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{prog}: error: {type(exc).__name__}: {first}", file=sys.stderr)
        return 1


def os_error_text(exc: OSError) -> str:
    """An OSError as an operator reads it: the file, then what went wrong (``/x: Permission denied``), not
    Python's ``[Errno 13] Permission denied: '/x'``; kvtier's own errors (which carry no errno) as they are."""
    if exc.errno is None or not exc.strerror:
        return str(exc)
    files = [str(f) for f in (exc.filename, exc.filename2) if f is not None]
    return f"{' -> '.join(files)}: {exc.strerror}" if files else exc.strerror


def main(argv: list[str] | None = None) -> int:
    """The CLI; Ctrl-C at any point (even while starting) is one line and exit status 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
