"""What the benches share: where results go (the checks and writes of ``kvtier replay``'s own, re-exported), the
file system under a path, and the plots."""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvtier.replay._output import check_plot_path, out_dir, write_results

__all__ = ["bar_plot", "check_plot_path", "fs_type", "out_dir", "write_results"]


def fs_type(path: str) -> str:
    """``"<type> on <device>"`` of the mount holding ``path`` (from /proc/mounts: ``stat -f`` reports ext4 as
    "ext2/ext3")."""
    path = os.path.realpath(path)
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                    best = (mnt, parts[2], parts[0])
    except OSError:
        pass
    return f"{best[1]} on {best[2]}"


def bar_plot(path: str, title: str, groups: Sequence[str], series: dict[str, Sequence[float]], ylabel: str) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series (e.g. ceiling and kvtier)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * max(1, len(series)) / 2), 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
