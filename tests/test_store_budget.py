"""One budget for a store directory, as operators meet it: two processes writing two namespaces of one root at
once stay within it; a writer killed with -9 leaves a namespace `kvtier remove` removes; removal is refused
while a writer holds the namespace; the format version; the writer's counters in `kvtier stats`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from kvtier import InvalidArgumentError, PageStore, _native

WRITER = r"""
import os, sys, time, torch
from kvtier import DeviceKVPool, PageStore, host_pool_for
root, model, budget, batches, linger = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
go = sys.argv[6] if len(sys.argv) > 6 else None  # a file whose creation starts the writes (writers at once)
PS = 16
dp = DeviceKVPool(64 * PS, PS, 2, 2, 128, 64, torch.bfloat16, "cpu")   # K page 16 KiB, V page 8 KiB
hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
for t in (hp.k_buffer, hp.v_buffer):
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
st = PageStore(root, capacity_bytes=budget, budget_bytes=budget, model_name=model, probe_bytes=0)
st.register_mem_pool_host(hp)
idx = torch.arange(8 * PS, dtype=torch.int64)
while go and not os.path.exists(go):
    time.sleep(0.005)
stored = 0
for b in range(batches):
    stored += sum(st.batch_set_v1([f"{model}-{b}-{i}" for i in range(8)], idx))
got = st.batch_get_v1([f"{model}-{batches - 1}-{i}" for i in range(8)] + ["absent"], torch.arange(9 * PS))
print("stored", stored, "hits", sum(got), flush=True)
time.sleep(linger)
if linger:  # a batch after 2 s: the writer's counters reach STATS while it runs
    st.batch_get_v1(["absent"], torch.arange(PS))
    print("counted", flush=True)
    time.sleep(600)
st.close()
"""


def writer(root, model, budget, batches, linger=0.0, go=None):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), model, str(budget), str(batches), str(linger)]
                            + ([str(go)] if go else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kv(*args):
    return subprocess.run([sys.executable, "-m", "kvtier", *map(str, args)], capture_output=True, text=True)


def ns_blocks(root):
    """Bytes of disk blocks in every namespace directory of the root."""
    total = 0
    for d in os.listdir(root):
        if d.startswith("ns-"):
            for f in os.listdir(os.path.join(root, d)):
                try:
                    total += os.stat(os.path.join(root, d, f)).st_blocks * 512
                except FileNotFoundError:
                    pass
    return total


def test_two_processes_writing_two_namespaces_stay_within_one_budget(tmp_path):
    budget = 2 << 20  # about 80 pages of 24 KiB for both together; each writes 480
    worst, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            worst[0] = max(worst[0], ns_blocks(tmp_path))
            time.sleep(0.002)

    go = tmp_path.parent / f"{tmp_path.name}-go"
    procs = [writer(tmp_path, f"model-{i}", budget, 60, go=go) for i in range(2)]
    while len([d for d in os.listdir(tmp_path) if d.startswith("ns-")]) < 2 and all(p.poll() is None for p in procs):
        time.sleep(0.01)  # both namespaces are open
    t = threading.Thread(target=sample)
    t.start()
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    stop.set()
    t.join()
    worst[0] = max(worst[0], ns_blocks(tmp_path))  # (and what they left: however few samples the thread took)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        stored = int(out.split()[1])
        assert stored > 0, out  # each got a share
    # the stated bound: the budget, plus per namespace its fixed files (NAMESPACE, LOCK, FORMAT, STATS: 64 KiB
    # allowed, as for one namespace's capacity) and a running compaction's new journal (a few KiB here)
    print(f"worst {worst[0]} bytes on disk for a budget of {budget}")
    assert 0 < worst[0] <= budget + 2 * (64 << 10), worst[0]
    info = json.loads(kv("namespaces", "--json", tmp_path).stdout)
    assert info["budget_bytes"] == budget and len(info["namespaces"]) == 2
    assert sum(e["claimed_bytes"] for e in info["namespaces"]) <= budget
    assert not any(e["live"] for e in info["namespaces"])


def test_a_writer_killed_with_9_leaves_a_namespace_kvtier_removes(tmp_path):
    p = writer(tmp_path, "killed", 1 << 30, 4, linger=60)
    line = p.stdout.readline()
    assert line.startswith("stored 32"), line + p.stderr.read()
    r = kv("remove", tmp_path, "--all", "--yes")  # held: refused, exit 1, nothing removed
    assert r.returncode == 1 and f"in use by pid {p.pid}" in r.stdout, r.stdout + r.stderr
    assert len([d for d in os.listdir(tmp_path) if d.startswith("ns-")]) == 1
    os.kill(p.pid, signal.SIGKILL)
    p.communicate()
    info = json.loads(kv("namespaces", "--json", tmp_path).stdout)
    (e,) = info["namespaces"]
    assert not e["live"] and e["objects"] == 64 and e["model"] == "killed" and e["disk_bytes"] > 32 * 24576
    assert e["claimed_bytes"] >= e["disk_bytes"] - (64 << 10), "a dead writer's bytes still count"
    r = kv("remove", tmp_path, "--model", "killed")  # without --yes: says what it would do
    assert r.returncode == 0 and "would remove" in r.stdout and "add --yes" in r.stdout, r.stdout
    assert os.path.isdir(tmp_path / e["dir"])
    r = kv("remove", tmp_path, "--model", "killed", "--yes")
    assert r.returncode == 0 and f"removed {e['dir']}" in r.stdout, r.stdout + r.stderr
    assert not any(d.startswith(("ns-", ".removing-")) for d in os.listdir(tmp_path))
    assert json.loads(kv("namespaces", "--json", tmp_path).stdout)["namespaces"] == []
    _, slots = _native.store_namespaces(tmp_path)
    assert slots == []


def test_removal_while_a_writer_holds_the_lock_is_refused_unless_forced(tmp_path):
    p = writer(tmp_path, "held", 1 << 30, 2, linger=60)
    try:
        assert p.stdout.readline().startswith("stored 16")
        (name,) = [d for d in os.listdir(tmp_path) if d.startswith("ns-")]
        r = kv("remove", tmp_path, name, "--yes")
        assert r.returncode == 1 and "LOCK is held" in r.stdout and "--force" in r.stdout, r.stdout + r.stderr
        assert os.path.isdir(tmp_path / name)
        with pytest.raises(OSError, match="in use by a running process"):
            _native.remove_namespace(tmp_path, name)
        r = kv("remove", tmp_path, name, "--yes", "--force")
        assert r.returncode == 0 and "once its process exits" in r.stdout, r.stdout + r.stderr
        assert not (tmp_path / name).exists()
    finally:
        p.kill()
        p.communicate()


def test_lifecycle_commands_check_their_arguments(tmp_path):
    for args, word in ((["remove", tmp_path], "--model, --older-than or --all"),
                       (["remove", tmp_path, "--all", "--older-than", "soon"], "--older-than"),
                       (["remove", tmp_path / "nope", "--all"], "no such store directory"),
                       (["namespaces", tmp_path / "nope"], "no such store directory"),
                       (["budget", tmp_path, "lots"], "`SIZE`"),
                       (["budget", tmp_path, "100"], "`SIZE`"),
                       (["budget", tmp_path, "1e100"], "1.000e100 is outside"),  # (not a 101-digit number)
                       (["budget", tmp_path, "0"], "to remove the budget say"),  # (0 never means "no budget")
                       (["budget", tmp_path, "0.0"], "to remove the budget say"),
                       (["budget", tmp_path, "0G"], "to remove the budget say"),
                       (["budget", tmp_path, "."], "`SIZE`")):
        r = kv(*args)
        assert r.returncode == 1 and word in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert os.listdir(tmp_path) == [], "refused commands leave the directory as it was"
    with PageStore(tmp_path, capacity_bytes=1 << 30, model_name="m") as st:
        assert st.budget_bytes is None
    r = kv("remove", tmp_path, "ns-0000000000000000", "--yes")
    assert r.returncode == 1 and "no namespace directory" in r.stderr, r.stderr
    r = kv("budget", tmp_path, "64M")
    assert r.returncode == 0 and "budget 64.0 MiB" in r.stdout, r.stdout + r.stderr
    assert _native.store_budget(tmp_path) == 64 << 20
    assert kv("budget", tmp_path, "none").stdout.strip().endswith("no budget")
    with pytest.raises(InvalidArgumentError, match="budget_bytes"):
        PageStore(tmp_path, budget_bytes=100)


def test_a_future_or_foreign_format_is_refused_and_a_store_without_the_file_opens(tmp_path):
    p = writer(tmp_path, "fmt", 1 << 30, 2)
    assert p.communicate(timeout=120)[0].startswith("stored 16")
    (name,) = [d for d in os.listdir(tmp_path) if d.startswith("ns-")]
    want = f"kvtier page store format {_native.store_format_version()}\n"
    assert (tmp_path / "FORMAT").read_text() == want and (tmp_path / name / "FORMAT").read_text() == want
    # written by the current format before the file existed: opens as before, and gets the file
    os.remove(tmp_path / "FORMAT")
    os.remove(tmp_path / name / "FORMAT")
    r = kv("verify", tmp_path)
    assert r.returncode == 0 and "32 objects checked, ok" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / "FORMAT").exists(), "read-only commands write nothing"
    (tmp_path / "FORMAT").write_text("kvtier page store format 9\n")
    for cmd in ("stats", "inspect", "verify", "namespaces"):
        r = kv(cmd, tmp_path)
        reads = re.search(rf"reads formats \[[\d, ]*\] and {_native.store_format_version()}\b", r.stderr)
        assert r.returncode == 1 and "format 9" in r.stderr and reads, (cmd, r.stderr)
        assert "rm -rf" in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    (tmp_path / "FORMAT").write_bytes(b"\x7fELF\x02\x01")
    r = kv("stats", tmp_path)
    assert r.returncode == 1 and "not a kvtier format file" in r.stderr, r.stderr


def test_kvtier_stats_shows_the_writers_hits_misses_bytes_and_capacity(tmp_path):
    p = writer(tmp_path, "counted", 8 << 20, 3, linger=2.2)
    try:
        assert p.stdout.readline().startswith("stored 24")
        assert p.stdout.readline().strip() == "counted"
        # the writer's thread rewrites STATS after that batch (in the background): read it once it has (the
        # batch's two misses); the guard only ends a wait that would never end
        end = time.monotonic() + 120  # (a guard against a wait that never ends, not a bound on speed)
        while True:
            r = kv("stats", "--json", tmp_path)
            assert r.returncode == 0, r.stderr
            (st,) = json.loads(r.stdout).values()
            if st["misses"] >= 4 or time.monotonic() > end:
                break
            time.sleep(0.1)
        # 3 batches of 8 pages (two objects each); a get of 8 pages and one absent (its 2 objects), then 1 more
        assert st["puts"] == 48 and st["hits"] == 16 and st["misses"] == 4, st
        assert st["bytes_written"] == 24 * 24576 and st["bytes_read"] == 8 * 24576, st
        assert st["capacity_bytes"] == 8 << 20 and st["budget_bytes"] == 8 << 20 == st["store_budget_bytes"]
        assert st["counters_writer"] == f"pid {p.pid}, running (updated every 2 s)" and st["live_writer"]
        assert isinstance(st["counters_age_s"], float) and st["counters_age_s"] >= 0
    finally:
        p.terminate()
        p.communicate()
    r = kv("stats", tmp_path)
    assert r.returncode == 0 and "hits" in r.stdout and f"pid {p.pid}, ended" in r.stdout, r.stdout


def test_root_files_do_not_change_the_store_of_a_refused_open(tmp_path):
    (tmp_path / "FORMAT").write_text("kvtier page store format 9\n")
    with pytest.raises(InvalidArgumentError, match="format 9"):
        st = PageStore(tmp_path, capacity_bytes=1 << 30, model_name="m")
        from kvtier import DeviceKVPool, host_pool_for
        import torch

        st.register_mem_pool_host(host_pool_for(DeviceKVPool(64, 16, 1, 1, 64, 64, torch.bfloat16, "cpu"),
                                                layout="page_first_direct", host_to_device_ratio=1.0))
    assert sorted(os.listdir(tmp_path)) == ["FORMAT"]
