"""``python -m kvtier_bench NAME [options]``: one of kvtier's benches, from a checkout (kvtier_bench/__init__.py).

``python -m kvtier_bench NAME --help`` lists the bench's options without importing it (no torch needed). Errors are
one line on stderr with exit status 1, never a traceback, as in ``kvtier``'s own commands."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtier._errors import KvtierError
from kvtier.cli import exit_status

from .options import BENCHES, parser

#: the benches that need a CUDA GPU
GPU = ("pin", "transfer")


def usage() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m kvtier_bench", add_help=False,
        description="python -m kvtier_bench NAME [options]: NAME is pin, transfer (GPU), store, mooncake or tenants; "
        "`python -m kvtier_bench NAME --help` lists that bench's options. The trace replay is `kvtier replay`.")
    ap.add_argument("which", nargs="?", choices=sorted(BENCHES))
    return ap


def run(argv: list[str]) -> int:
    ap = usage()
    args, rest = ap.parse_known_args(argv)
    if args.which is None:
        ap.print_help()
        return 0 if {"-h", "--help"} & set(rest) else 2
    if {"-h", "--help"} & set(rest):  # (the options without the bench: no torch needed, nothing imported)
        parser(args.which).print_help()
        return 0
    if args.which in GPU:
        import torch

        if not torch.cuda.is_available():
            raise KvtierError(f"the {args.which} bench needs a CUDA GPU (torch.cuda.is_available() is False)")
    importlib.import_module(f"kvtier_bench.{args.which}").main(rest)
    return 0


def main(argv: list[str] | None = None) -> int:
    return exit_status("kvtier_bench", lambda: run(sys.argv[1:] if argv is None else argv),
                       "each bench needs torch, which is not installed: pip install torch")


if __name__ == "__main__":
    sys.exit(main())
