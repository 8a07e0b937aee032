"""``python -m kvtier_bench NAME [options]``: one of kvtier's benches, from a checkout (kvtier_bench/__init__.py).

``python -m kvtier_bench NAME --help`` lists the bench's options without importing it (no torch needed). Errors are
one line on stderr with exit status 1, never a traceback, as in ``kvtier``'s own commands."""

from __future__ import annotations

import argparse
import importlib
import sys

from kvtier._errors import KvtierError
from kvtier.cli import os_error_text

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
    prog = "kvtier_bench"
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        print(f"{prog}: error: each bench needs torch, which is not installed: pip install torch", file=sys.stderr)
        return 1
    except (KvtierError, OSError, ValueError) as exc:
        print(f"{prog}: error: {os_error_text(exc) if isinstance(exc, OSError) else exc}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError) as exc:  # e.g. an allocation the machine cannot make
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"{prog}: error: {type(exc).__name__}: {first}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
