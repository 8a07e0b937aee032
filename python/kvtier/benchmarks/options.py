"""The command-line options of every ``kvtier bench NAME``, free of torch: ``kvtier bench NAME --help`` answers
on any machine (each bench itself imports torch, which a storage host may not have, and which costs seconds)."""

from __future__ import annotations

import argparse

#: the cases of ``kvtier bench store`` (its ``CASES``) and ``kvtier bench mooncake`` (its ``CASES``)
STORE_CASES = ("mimo", "small")
MOONCAKE_CASES = ("64KiB", "256KiB", "1MiB", "4MiB", "mimo-kv", "deepseek-latent")
#: LLaMA3-70B's KV bytes per token (80 layers x 8 KV heads x 128 dims x K and V x 2 bytes), the paper's Table 1
LLAMA3_70B_BYTES_PER_TOKEN = 320 << 10
#: prefill rate assumed for the TTFT prediction: the paper's Figure 10 (local cache, LLaMA3-70B on 8xA800)
#: shows about 1.4 s of prefill GPU time per conversation request (avg 12,035 input tokens, ~17% hit), i.e.
#: about 7,200 tokens/s
DEFAULT_PREFILL = 7200.0


def parser(name: str) -> argparse.ArgumentParser:
    """The argument parser of ``kvtier bench NAME``."""
    build = {"pin": _pin, "transfer": _transfer, "store": _store, "mooncake": _mooncake, "tenants": _tenants,
             "replay": _replay}.get(name)
    if build is None:
        raise ValueError(f"no bench named {name!r}")
    ap = argparse.ArgumentParser(prog=f"kvtier bench {name}", description=DESCRIPTIONS.get(name))
    build(ap)
    return ap


DESCRIPTIONS = {
    "replay": "Replays a request trace (Mooncake FAST'25 format) through kvtier's real tiers and an exact LRU "
              "model of them.",
}


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
    ap.add_argument("--cases", default="mimo,small", help="disk cases of `kvtier bench store` (default mimo,small)")
    ap.add_argument("--pages", type=int, default=None, help="override the page count of every disk case")
    ap.add_argument("--cluster-reps", type=int, default=5, help="repetitions per cluster case and mode (default 5)")
    ap.add_argument("--cluster-cases", default="64KiB,mimo-kv", help="cases of `kvtier bench mooncake` (default 64KiB,mimo-kv)")
    ap.add_argument("--no-cluster", action="store_true", help="skip the cluster tier (no Mooncake)")
    ap.add_argument("--out", default=None, help="directory for cpu-tenants.json and .md (default: print only)")


def _replay(ap: argparse.ArgumentParser) -> None:
    from .replay_trace import KNOWN

    ap.add_argument(
        "--trace",
        required=True,
        help=f"a trace file (.jsonl or .jsonl.gz), or one of {sorted(KNOWN)} (found in "
        "$KVTIER_TRACE_DIR, benches/traces/ or shared/traces/, checked against its sha256)",
    )
    ap.add_argument(
        "--capacities",
        default=None,
        help="store capacities in tokens, comma-separated, decimal units, inf for unlimited (default "
        "1M,3M,10M,50M,inf; with --nodes: 3M per node)",
    )
    ap.add_argument("--host-tokens", default="256K", help="each node's host tier in tokens (default 256K)")
    ap.add_argument(
        "--page-bytes", default="16K", help="bytes really stored per 512-token block, a multiple of 8K (default 16K)"
    )
    ap.add_argument(
        "--bytes-per-token",
        default=str(LLAMA3_70B_BYTES_PER_TOKEN),
        help="the model geometry bytes moved are scaled to (default 327680: LLaMA3-70B, 320 KiB)",
    )
    ap.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=DEFAULT_PREFILL,
        help=f"prefill rate the TTFT prediction assumes (default {DEFAULT_PREFILL:.0f}, from the paper)",
    )
    ap.add_argument(
        "--read-gbps",
        default=None,
        metavar="TIER=GBPS",
        help="assume a tier's read rate for the TTFT prediction instead of kvtier's measurement (e.g. disk=6, "
        "mooncake=20)",
    )
    ap.add_argument("--nodes", type=int, default=1, help="nodes: >1 replays separate stores against one shared")
    ap.add_argument(
        "--routing",
        choices=["prefix", "random"],
        default="prefix",
        help="how a request picks its node with --nodes (default prefix)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of random routing (default 0)")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=1.0,
        help="most points kvtier's hit rates may differ from the model's (default 1)",
    )
    ap.add_argument(
        "--dir",
        default=None,
        help="where the stores are made (default: a temporary directory in the working directory, removed afterwards)",
    )
    ap.add_argument(
        "--out", default=None, help="directory for cpu-replay.json (this run merged into it) and cpu-replay.md"
    )
    ap.add_argument("--plot", default=None, help="draw hit rate against capacity (PNG; needs matplotlib)")
    ap.add_argument(
        "--cluster",
        action="store_true",
        help="replay the Mooncake cluster tier (a LocalCluster on 127.0.0.1) behind the host tier instead of a "
        "PageStore; with --nodes, the tier all nodes share",
    )
