"""Where a replay's results go and its plot: ``--out`` and ``--plot`` checked before the run, written after it."""

from __future__ import annotations

import os

from .._errors import KvtierError


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
