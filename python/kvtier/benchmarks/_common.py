"""What the benches share: where results go, the file system under a path, and the plots."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .._errors import KvtierError


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


def out_dir(path: str | None) -> str | None:
    """Proves ``--out`` writable before the bench runs (a bench that fails after its work because it cannot
    save is minutes lost), without creating anything yet: the directory is made when the results are written,
    so an interrupted or refused run leaves none. None: results are only printed."""
    if path is None:
        return None
    if os.path.exists(path) and not os.path.isdir(path):
        raise KvtierError(f"--out {path}: exists and is not a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise KvtierError(f"--out {path}: cannot write there ({existing} is not a writable directory)")
    return path


def write_results(out: str, files: dict[str, str]) -> None:
    """Writes each ``{name: text}`` into ``out`` (created now)."""
    os.makedirs(out, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(out, name), "w") as f:
            f.write(text)


def check_plot_path(path: str | None) -> None:
    """Fails at once (not after the run) when ``--plot`` cannot be drawn or written: matplotlib missing, a
    directory, no or an unsupported file extension, a parent that is not a writable directory."""
    if path is None:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:
        raise KvtierError("--plot needs matplotlib: pip install matplotlib") from None
    if path.endswith(os.sep) or os.path.isdir(path):
        raise KvtierError(f"--plot {path}: is a directory; give a file name such as {os.path.join(path, 'bench.png')}")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    supported = Figure().canvas.get_supported_filetypes()
    if ext not in supported:
        raise KvtierError(f"--plot {path}: give a file name ending in one of {sorted(supported)} (e.g. .png)")
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise KvtierError(f"--plot {path}: directory {d} does not exist or is not writable")


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
