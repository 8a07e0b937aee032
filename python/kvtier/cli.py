"""The ``kvtier`` command line. Errors are one line on stderr with a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import sys

from ._errors import KvtierError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvtier", description="Host-memory and disk tier for LLM KV caches.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the verified end-to-end demo (GPU if present, else CPU)")
    demo.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    demo.add_argument("--pages", type=int, default=32, help="KV pages moved (default 32)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run

            return run(layers=args.layers, pages=args.pages, seed=args.seed)
    except (KvtierError, OSError) as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
