"""The replay bench's tables, its agreement check against the LRU model, and its plot."""

from __future__ import annotations

import math
from typing import Any

from .trace import KNOWN, parse_tokens


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}" if n >= 1e7 else f"{n / 1e9:.4f}"


def _cap(row: dict[str, Any]) -> str:
    return str(row["capacity"])


def _ttft(row: dict[str, Any]) -> str:
    t = row["ttft"]
    saved = 100.0 * (1 - t["planned_mean_s"] / t["recompute_mean_s"]) if t["recompute_mean_s"] else 0.0
    return f"{t['recompute_mean_s']:.2f} → {t['planned_mean_s']:.2f} s (−{saved:.1f}%)"


def sweep_table(rows: list[dict[str, Any]], best_pct: float, known: str | None) -> str:
    """Hit rate against the store's capacity, kvtier beside the model, with each tier's share, bytes moved
    (actually, and scaled to the model's geometry), the planner's TTFT and the replay time per request."""
    paper = KNOWN[known] if known else None
    t = rows[0].get("store_tier", "disk") if rows else "disk"
    out = [
        "| store capacity (tokens) | kvtier hit % | model hit % | one LRU hit % | % of best (kvtier) | paper | "
        f"host share % | {t} share % | {t} read MB (scaled GB) | {t} written MB (scaled GB) | store pages held "
        "kvtier / model | TTFT mean, recompute → planned | replay ms/request kvtier (model) |",
        "|" + "---|" * 13,
    ]
    for r in rows:
        k, m = r["kvtier"], r["model"]
        cap = _cap(r)
        note = ""
        if paper and cap == "3M":
            note = f"{paper.paper_pct_of_best_at_3m}% of best"
        elif paper and cap == "50M":
            note = "nearly the best"
        best = f"{100 * k['hit_pct'] / best_pct:.0f}%" if best_pct else "-"
        mv, sc = r["moved"], r["moved_scaled"]
        out.append(
            f"| {cap} | {k['hit_pct']:.2f} | {m['hit_pct']:.2f} | {r['one_lru_pct']:.2f} | {best} | {note} | "
            f"{k['host_pct']:.2f} | {k['store_pct']:.2f} | {mv[t + '_read_bytes'] / 1e6:.1f} "
            f"({_gb(sc[t + '_read_bytes'])}) | {mv[t + '_written_bytes'] / 1e6:.1f} ({_gb(sc[t + '_written_bytes'])}) | "
            f"{k['store_pages_held']} / {m['store_pages_held']} | {_ttft(r)} | {k['ms_per_request']:.2f} "
            f"({m['ms_per_request']:.3f}) |"
        )
    return "\n".join(out) + "\n"


def nodes_table(pairs: list[tuple[dict[str, Any], dict[str, Any]]], known: str | None) -> str:
    """Separate caches against one shared store, per node capacity: hit rates and their ratio."""
    paper = KNOWN[known] if known else None
    out = [
        "| per-node store (tokens) | nodes | shared tier | separate: kvtier / model hit % | shared: kvtier / model "
        "hit % | shared/separate kvtier | model | paper | shared tier's share %, kvtier / model | host share % "
        "separate → shared | TTFT mean planned, separate → shared | replay ms/request separate / shared |",
        "|" + "---|" * 12,
    ]
    for sep, shr in pairs:
        ks, ms, kh, mh = sep["kvtier"], sep["model"], shr["kvtier"], shr["model"]
        ratio = kh["hit_pct"] / ks["hit_pct"] if ks["hit_pct"] else math.inf
        mratio = mh["hit_pct"] / ms["hit_pct"] if ms["hit_pct"] else math.inf
        p = f"{paper.paper_shared_ratio:.2f}×" if paper and _cap(sep) == "3M" and sep["nodes"] == 10 else ""
        tier = "Mooncake cluster" if shr.get("store_tier") == "mooncake" else "PageStore"
        out.append(
            f"| {_cap(sep)} | {sep['nodes']} | {tier} | {ks['hit_pct']:.2f} / {ms['hit_pct']:.2f} | "
            f"{kh['hit_pct']:.2f} / {mh['hit_pct']:.2f} | {ratio:.2f}× | {mratio:.2f}× | {p} | "
            f"{kh['store_pct']:.2f} / {mh['store_pct']:.2f} | {ks['host_pct']:.2f} → {kh['host_pct']:.2f} | "
            f"{sep['ttft']['planned_mean_s']:.2f} → {shr['ttft']['planned_mean_s']:.2f} s | "
            f"{ks['ms_per_request']:.2f} / {kh['ms_per_request']:.2f} |"
        )
    return "\n".join(out) + "\n"


def disagreements(rows: list[dict[str, Any]], points: float) -> list[str]:
    """Every row where kvtier's hit rate, or a tier's share of it, is more than ``points`` from the model's."""
    bad = []
    for r in rows:
        for what in ("hit_pct", "host_pct", "store_pct"):
            d = r["kvtier"][what] - r["model"][what]
            if abs(d) > points:
                bad.append(
                    f"{r['label']}: kvtier {what} {r['kvtier'][what]:.2f} vs model {r['model'][what]:.2f} "
                    f"({d:+.2f} points, more than {points})"
                )
    return bad


def plot(path: str, rows: list[dict[str, Any]], best_pct: float, title: str) -> None:
    """Hit rate against store capacity (log scale), kvtier and the model; unlimited drawn as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    # the capacity asked for (a cluster row's store_pages is what its memory holds, finite even for "inf")
    finite = [r for r in rows if math.isfinite(parse_tokens("capacity", str(r["capacity"])))]
    xs = [parse_tokens("capacity", str(r["capacity"])) for r in finite]
    tier = "Mooncake cluster" if finite and finite[0].get("store_tier") == "mooncake" else "PageStore"
    ax.plot(xs, [r["kvtier"]["hit_pct"] for r in finite], "o-", label=f"kvtier (host + {tier})")
    ax.plot(xs, [r["model"]["hit_pct"] for r in finite], "x--", label="LRU model of the same tiers")
    ax.plot(xs, [r["one_lru_pct"] for r in finite], ":", color="grey", label="one LRU cache")
    ax.axhline(best_pct, color="black", lw=0.8, label=f"best possible ({best_pct:.1f}%)")
    ax.axvline(3e6, color="grey", lw=0.6, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("store capacity (tokens)")
    ax.set_ylabel("prefix hit rate (% of input tokens)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
