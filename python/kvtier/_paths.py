"""Where stores live: a default directory that survives a reboot, and a check for file systems that do
not (tmpfs, ramfs: memory, emptied at every boot and often cleaned)."""

from __future__ import annotations

import os

#: File systems whose contents do not survive a reboot.
VOLATILE_FS = frozenset({"tmpfs", "ramfs"})
MOUNTINFO = "/proc/self/mountinfo"


def default_store_dir(name: str) -> str:
    """``$XDG_CACHE_HOME/kvtier/<name>``, or ``~/.cache/kvtier/<name>`` (the XDG default): a user's cache
    directory, on a disk and kept across reboots, unlike the system temp directory."""
    base = os.environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):  # the XDG spec: a relative value is invalid and ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvtier", name)


def _unescape(field: str) -> str:
    """A mountinfo path: spaces, tabs, newlines and backslashes are octal escapes (``\\040``)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def fs_type(path: str | os.PathLike[str], mountinfo: str = MOUNTINFO) -> str | None:
    """The type of the file system ``path`` is (or, not existing yet, would be) on: the longest mount point
    of ``mountinfo`` that holds it. None when that cannot be told (no /proc)."""
    p = os.path.realpath(os.fspath(path))
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    best, kind = -1, None
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                parts = left.split()
                if not sep or len(parts) < 5 or not right.split():
                    continue
                mount = _unescape(parts[4])
                inside = p == mount or p.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= best:  # later lines stack over earlier ones at the same point
                    best, kind = len(mount), right.split()[0]
    except OSError:
        return None
    return kind


def volatile_warning(path: str | os.PathLike[str], option: str, mountinfo: str = MOUNTINFO) -> str | None:
    """A warning when ``path`` is on a file system that does not survive a reboot, else None."""
    kind = fs_type(path, mountinfo)
    if kind not in VOLATILE_FS:
        return None
    return (f"kvtier store `{option}` {os.fspath(path)} is on {kind} (memory): its pages are lost at every reboot "
            f"and take RAM, not disk; give a directory on a local disk, e.g. {default_store_dir('hicache')}")
