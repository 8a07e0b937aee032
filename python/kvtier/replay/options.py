"""The command-line options of ``kvtier replay`` (also ``kvtier bench replay``), free of torch: ``--help`` answers
on any machine (the replay itself imports torch, which a storage host may not have, and which costs seconds)."""

from __future__ import annotations

import argparse

#: LLaMA3-70B's KV bytes per token (80 layers x 8 KV heads x 128 dims x K and V x 2 bytes), the paper's Table 1
LLAMA3_70B_BYTES_PER_TOKEN = 320 << 10
#: prefill rate assumed for the TTFT prediction: the paper's Figure 10 (local cache, LLaMA3-70B on 8xA800)
#: shows about 1.4 s of prefill GPU time per conversation request (avg 12,035 input tokens, ~17% hit), i.e.
#: about 7,200 tokens/s
DEFAULT_PREFILL = 7200.0

DESCRIPTION = ("Replays a request trace (Mooncake FAST'25 format) through kvtier's real tiers and an exact LRU model "
               "of them.")


def parser(prog: str = "kvtier replay") -> argparse.ArgumentParser:
    """The argument parser of ``kvtier replay``."""
    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    _replay(ap)
    return ap


def _replay(ap: argparse.ArgumentParser) -> None:
    from .trace import KNOWN

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
