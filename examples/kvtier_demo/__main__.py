"""``python -m kvtier_demo [options]``: kvtier's verified end-to-end demo, from a checkout (``make demo``).

``python -m kvtier_demo --help`` lists the options without importing torch. The arguments are checked before any
work; errors are one line on stderr with exit status 1, never a traceback, as in ``kvtier``'s own commands."""

from __future__ import annotations

import argparse
import os
import re
import sys

from kvtier import KvtierError
from kvtier.cli import exit_status

PROG = "kvtier_demo"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kvtier_demo",
        description="kvtier's verified end-to-end demo (GPU if present, else CPU): host buffers, transfers of an "
        "asymmetric and an MLA KV cache through host pools and a disk store, then a multi-turn chat workload "
        "served through kvtier against no tier. Runs from a source checkout: make demo, or "
        "PYTHONPATH=python:examples python -m kvtier_demo [options].")
    ap.add_argument("--layers", type=int, default=8, help="layers of the transfer round trip (default 8)")
    ap.add_argument("--pages", type=int, default=32, help="pages of the transfer round trip (default 32)")
    ap.add_argument("--conversations", type=int, default=None,
                    help="conversations served (default: 16 on a GPU, 8 on the CPU; 3 with --cluster)")
    ap.add_argument("--turns", type=int, default=None,
                    help="rounds per conversation (default 5, as SGLang's bench_multiturn; 3 with --cluster)")
    ap.add_argument("--store-dir", default=None,
                    help="directory for every store the demo writes (created if missing; its parent must exist; kept "
                    "after the run). Default: temp directories under the working directory, removed unless --keep")
    ap.add_argument("--keep", action="store_true", help="keep the default store directory after the run")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--window", default=None,
                    help="layers the served model's KVTier keeps on the device: a number, or 'all' (default: KVTier's "
                    "'auto', every layer where half the free device memory holds them; more than the model has means all)")
    ap.add_argument("--cluster", action="store_true",
                    help="two inference-node processes sharing prefixes through a local Mooncake cluster "
                    "(needs kvtier[mooncake]; README 'Use it across nodes')")
    return ap


def run(args: argparse.Namespace) -> int:
    for name, most in (("layers", 256), ("pages", 65536), ("conversations", 1000), ("turns", 1000)):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= most:
            raise KvtierError(f"--{name} must be in [1, {most}], got {value}")
    if not 0 <= args.seed < 2**63:
        raise KvtierError(f"--seed must be in [0, 2**63), got {args.seed}")
    window = None
    if args.window is not None:
        if args.window == "all":
            window = 0
        elif re.fullmatch(r"[0-9]{1,4}", args.window) and 1 <= int(args.window) <= 1024:
            window = int(args.window)
        else:
            raise KvtierError(f"--window must be 'all' or a number of layers in [1, 1024], got {args.window!r}")
    if args.store_dir is not None:
        if not args.store_dir.strip():
            raise KvtierError("--store-dir must name a directory, got an empty string")
        d = os.path.abspath(args.store_dir)
        if os.path.exists(d) and not os.path.isdir(d):
            raise KvtierError(f"--store-dir {args.store_dir}: exists and is not a directory")
        if not os.path.isdir(os.path.dirname(d)):
            raise KvtierError(f"--store-dir {args.store_dir}: its parent {os.path.dirname(d)} is not an existing "
                              "directory (the demo creates one directory, not a tree)")
        if not os.access(d if os.path.isdir(d) else os.path.dirname(d), os.W_OK):
            raise KvtierError(f"--store-dir {args.store_dir}: not writable")
    if args.cluster:
        if window is not None:
            raise KvtierError("--window applies to the one-node demo, not to --cluster")
        from .cluster import run_cluster

        return run_cluster(conversations=args.conversations or 3, turns=args.turns or 3, seed=args.seed,
                           store_dir=args.store_dir)
    from .tour import run as tour

    return tour(layers=args.layers, pages=args.pages, seed=args.seed, conversations=args.conversations,
                turns=args.turns, keep=args.keep, store_dir=args.store_dir, window=window)


def main(argv: list[str] | None = None) -> int:
    """The demo's command line; Ctrl-C at any point is one line and exit status 130."""
    return exit_status(PROG, lambda: run(parser().parse_args(sys.argv[1:] if argv is None else argv)),
                       "the demo needs torch, which is not installed: pip install torch")


if __name__ == "__main__":
    sys.exit(main())
