"""The soak's short version (CI): two processes x three threads for a few seconds, zero divergences and flat
RSS / file descriptors; and a self-check that the soak does catch lost pages (torn writes injected). The long
run is `make soak` (SOAK_SECONDS, default 120); its figures are in docs/RELIABILITY.md."""

import json
import os
import subprocess
import sys

SOAK = os.path.join(os.path.dirname(__file__), "soak.py")
SECONDS = os.environ.get("KVTIER_SOAK_CI_SECONDS", "8")


def run(tmp_path, *extra):
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, SOAK, "--seconds", SECONDS, "--procs", "2", "--threads", "3", "--out", str(out),
                        *extra], capture_output=True, text=True, timeout=600)
    return r, json.loads(out.read_text())


def test_short_soak_has_no_divergence(tmp_path):
    r, res = run(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert res["divergences"] == 0 and len(res["processes"]) == 2
    for p in res["processes"]:
        assert p["ops"] > 500, p  # the run really did work
        for op in ("backup", "load", "set", "get", "delete", "reopen", "ctrl_backup", "ctrl_prefetch", "ctrl_load"):
            assert p["counts"].get(op, 0) > 0, (op, p["counts"])
    assert any(p["store_evictions"] > 0 for p in res["processes"]), "process 0's store must evict"


def test_short_soak_with_disk_full_episodes(tmp_path):
    """The store on a small tmpfs that is filled to the last byte every few seconds: writes fail (False),
    deletes still work, and no acknowledged page is lost or read back wrong."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("--disk-full mounts a tmpfs: needs root")
    root = tmp_path / "root"
    root.mkdir()
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, SOAK, "--seconds", SECONDS, "--procs", "2", "--threads", "3", "--disk-full",
                        "--root", str(root), "--out", str(out)], capture_output=True, text=True, timeout=600)
    if "needs root to mount" in r.stderr:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["divergences"] == 0 and res["disk_full_episodes"] >= 1, res
    assert res["store_write_failures"] > 0, "the disk-full episodes never reached a write"


def test_soak_catches_lost_pages(tmp_path):
    r, res = run(tmp_path, "--torn-writes")
    assert r.returncode == 1
    assert any("lost" in f for f in res["failures"]), res["failures"][:5]


def test_short_stall_soak_has_no_divergence_no_stuck_request_and_no_fence_left(tmp_path):
    """The chaos soak of the deadlines (tests/soak/stalls.py) for a few seconds: stall, EIO, disk-full and slow
    episodes, every loaded page checked; the long run is `make soak-stalls` (docs/RELIABILITY.md)."""
    out = tmp_path / "stalls.json"
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "stalls.py"), "--seconds",
                        os.environ.get("KVTIER_STALL_SOAK_CI_SECONDS", "15"), "--seed", "3", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["requests"] > 100 and res["divergences"] == 0 and res["stuck"] == 0
    assert res["fenced_at_end"] == 0 and res["stuck_calls_at_end"] == 0
    assert sum(res["episodes"].values()) >= 2, res["episodes"]  # the chaos really ran
    assert res["pages_from_host"] > 0 and res["deadline"]["calls"]["read"] > 0  # the disk really served


def test_the_descriptor_check_tells_a_leak_from_a_lazy_singleton():
    """A descriptor opened once after the warm-up (a lazily made singleton) is not a leak; a target held more
    times than at warm-up, or more than a couple of new ones, is."""
    sys.path.insert(0, os.path.dirname(SOAK))
    try:
        from soak import fd_leak
    finally:
        sys.path.remove(os.path.dirname(SOAK))
    base = ["/dev/null", "pipe:[1]", "/dev/urandom"]
    assert fd_leak(base, base) is None
    assert fd_leak(base, [*base, "anon_inode:[eventfd]"]) is None
    assert fd_leak(base, [*base, "/dev/null"]) is not None  # the same target opened again and kept
    assert fd_leak(base, [*base, "socket:[7]", "socket:[8]", "socket:[9]"]) is not None  # new ones piling up
