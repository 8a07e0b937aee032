"""The ``kvtier`` command line. Errors are one line on stderr with a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys

from ._errors import KvtierError


def _namespaces(path: str) -> list[tuple[str, str]]:
    """(directory, namespace string) of every namespace under a store root."""
    if not os.path.isdir(path):
        raise KvtierError(f"{path}: no such store directory")
    out = []
    for name in sorted(os.listdir(path)):
        ns_file = os.path.join(path, name, "NAMESPACE")
        if name.startswith("ns-") and os.path.isfile(ns_file):
            with open(ns_file) as f:
                out.append((os.path.join(path, name), f.read()))
    if not out:
        raise KvtierError(f"{path}: not a kvtier store (no namespace directories)")
    return out


def _open(path: str, ns: str):
    from . import _native

    try:
        return _native.PageStore(path, ns, 1 << 62, 4, None)
    except OSError as exc:
        if "already open" in str(exc):
            raise KvtierError(f"{path}: namespace is in use by a running process (its LOCK is held)") from None
        raise


def cmd_inspect(args) -> int:
    for d, ns in _namespaces(args.path):
        s = _open(args.path, ns)
        try:
            st = s.stats()
            files = {f: os.path.getsize(os.path.join(d, f)) for f in sorted(os.listdir(d)) if f.endswith((".dat", ".log"))}
            print(f"{os.path.basename(d)}  {ns}")
            print(f"  objects {st['objects']} ({st['objects'] // 2} pages), {st['bytes_used'] / 1e6:.1f} MB in slots, "
                  f"O_DIRECT {'yes' if st['o_direct'] else 'no: ' + str(st['o_direct_note'])}")
            if st["recovered_tail_bytes"]:
                print(f"  recovered: {st['recovered_tail_bytes']} bytes of a torn journal tail were cut off")
            for f, n in files.items():
                print(f"  {f:<24} {n / 1e6:10.1f} MB")
        finally:
            s.close()
    return 0


def cmd_verify(args) -> int:
    bad_total = 0
    for d, ns in _namespaces(args.path):
        s = _open(args.path, ns)
        try:
            checked, bad = s.verify(args.drop)
        finally:
            s.close()
        bad_total += len(bad)
        verdict = "ok" if not bad else f"{len(bad)} corrupt" + (" (dropped)" if args.drop else "")
        print(f"{os.path.basename(d)}: {checked} objects checked, {verdict}")
        for k in bad[:20]:
            print(f"  corrupt: {k}")
    return 1 if bad_total and not args.drop else 0


def cmd_demo(args) -> int:
    from .demo import run

    return run(layers=args.layers, pages=args.pages, seed=args.seed, conversations=args.conversations,
               turns=args.turns, keep=args.keep, store_dir=args.store_dir)


def cmd_bench(args, rest: list[str]) -> int:
    import importlib

    if args.which in ("pin", "transfer"):
        import torch

        if not torch.cuda.is_available():
            raise KvtierError(f"kvtier bench {args.which} needs a CUDA GPU (torch.cuda.is_available() is False)")

    importlib.import_module(f"kvtier.benchmarks.{args.which}").main(rest)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier", description="Host-memory and disk tier for LLM KV caches.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the verified end-to-end demo (GPU if present, else CPU)")
    demo.add_argument("--layers", type=int, default=8, help="layers of the transfer round trip (default 8)")
    demo.add_argument("--pages", type=int, default=32, help="pages of the transfer round trip (default 32)")
    demo.add_argument("--conversations", type=int, default=3, help="conversations served (default 3)")
    demo.add_argument("--turns", type=int, default=3, help="turns per conversation (default 3)")
    demo.add_argument("--store-dir", default=None, help="page store directory (default: a temp dir under the working directory)")
    demo.add_argument("--keep", action="store_true", help="keep the store directory after the run")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    bench = sub.add_parser("bench", help="benchmarks against the hardware ceilings: pin, transfer (GPU), store; "
                           "options after the name go to the bench (e.g. kvtier bench transfer --plot out.png)")
    bench.add_argument("which", choices=["pin", "transfer", "store"])
    ins = sub.add_parser("inspect", help="namespaces, pages, bytes and files of a store directory")
    ins.add_argument("path")
    ver = sub.add_parser("verify", help="re-read every object of a store and check its checksum")
    ver.add_argument("path")
    ver.add_argument("--drop", action="store_true", help="delete corrupt objects")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "demo":
            return cmd_demo(args)
        if args.command == "bench":
            return cmd_bench(args, rest)
        if args.command == "inspect":
            return cmd_inspect(args)
        if args.command == "verify":
            return cmd_verify(args)
    except (KvtierError, OSError, ValueError) as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
