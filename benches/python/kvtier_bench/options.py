"""The command-line options of every ``python -m kvtier_bench NAME``, free of torch: ``python -m kvtier_bench NAME
--help`` answers on any machine (each bench itself imports torch, which a storage host may not have, and which costs
seconds). The trace replay's options are the package's own (kvtier.replay.options: ``kvtier replay``)."""

from __future__ import annotations

import argparse

#: the cases of ``python -m kvtier_bench store`` (its ``CASES``) and ``python -m kvtier_bench mooncake`` (its ``CASES``)
STORE_CASES = ("mimo", "small")
MOONCAKE_CASES = ("64KiB", "256KiB", "1MiB", "4MiB", "mimo-kv", "deepseek-latent")


def parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of ``python -m kvtier_bench NAME``."""
    build = BENCHES.get(name)
    if build is None:
        raise ValueError(f"no bench named {name!r}")
    ap = argparse.ArgumentParser(prog=f"python -m kvtier_bench {name}")
    build(ap)
    return ap


def _pin(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gib", type=int, default=16, help="GiB to allocate and pin per run, at least 2 (default 16)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported (default 3)")
    ap.add_argument("--json", default=None, help="write the result to this JSON file")
    ap.add_argument("--out", default=None, help="directory for pin.json (alternative to --json; default: print only)")
    ap.add_argument("--plot", default=None, help="write a bar chart (PNG) of GB/s per method (needs matplotlib)")


def _transfer(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=None, help="directory for transfer.json and transfer.md (default: print only)")
    ap.add_argument("--geoms", default="A,B,C,D", help="comma-separated geometries: A MiMo-V2-like (48 layers, 4 heads, K 192 / V 128), B Llama-3.1-8B-like "
                    "(32, 8, 128/128), C MiMo at TP 8 (48, 1, 192/128), D DeepSeek-V3-like MLA (61 layers, 512+64), E MiMo at TP 4 "
                    "(48, 2, 192/128); "
                    "default A,B,C,D")
    ap.add_argument("--pages", default="16,64,256,1024", help="page counts per call (default 16,64,256,1024)")
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per cell; medians are reported (default 7)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the kernel-backend block sweep")
    ap.add_argument("--streams", default="side,default",
                    help="caller streams to measure: side (a torch.cuda.Stream) and/or default (a plain script)")
    ap.add_argument("--no-overlap", action="store_true", help="skip the overlap measurements")
    ap.add_argument("--indices", default="cpu", help="where the index tensors live: cpu and/or cuda (a plain "
                    "script may hold either)")
    ap.add_argument("--plot", default=None, help="write a PNG of GB/s against pages per backend (needs matplotlib)")


def _store(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dir", default=None,
                    help="directory on the disk to measure (default: a temporary directory in the working directory, "
                    "removed afterwards)")
    ap.add_argument("--reps", type=int, default=3, help="fresh stores per case; medians are reported (default 3)")
    ap.add_argument("--out", default=None, help="directory for store.json and store.md (default: print only)")
    ap.add_argument("--plot", default=None, help="write a bar chart (PNG) of ceiling and kvtier GB/s (needs matplotlib)")
    ap.add_argument("--cases", default="mimo,small", help=f"comma-separated cases of {sorted(STORE_CASES)} (default mimo,small)")
    ap.add_argument("--pages", type=int, default=None, help="override the page count of every case (quick runs)")


def _mooncake(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--reps", type=int, default=7, help="repetitions per case, fresh keys each, raw and kvtier going first in turn; medians (default 7)")
    ap.add_argument("--storage-nodes", type=int, default=1, help="storage processes of the local cluster (default 1)")
    ap.add_argument("--cases", default=",".join(MOONCAKE_CASES), help=f"comma-separated cases of {list(MOONCAKE_CASES)}")
    ap.add_argument("--out", default=None, help="directory for cpu-mooncake.json and .md (default: print only)")


def _tenants(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dir", action="append", default=None, help="a directory on a disk to measure, repeatable "
                    "(default: a temporary directory in the working directory, removed afterwards)")
    ap.add_argument("--reps", type=int, default=3, help="fresh stores per disk case and mode; medians (default 3)")
    ap.add_argument("--cases", default="mimo,small", help="disk cases of `python -m kvtier_bench store` (default mimo,small)")
    ap.add_argument("--pages", type=int, default=None, help="override the page count of every disk case")
    ap.add_argument("--cluster-reps", type=int, default=5, help="repetitions per cluster case and mode (default 5)")
    ap.add_argument("--cluster-cases", default="64KiB,mimo-kv", help="cases of `python -m kvtier_bench mooncake` (default 64KiB,mimo-kv)")
    ap.add_argument("--no-cluster", action="store_true", help="skip the cluster tier (no Mooncake)")
    ap.add_argument("--out", default=None, help="directory for cpu-tenants.json and .md (default: print only)")


#: every bench ``python -m kvtier_bench NAME`` runs, with its options
BENCHES = {"pin": _pin, "transfer": _transfer, "store": _store, "mooncake": _mooncake, "tenants": _tenants}
