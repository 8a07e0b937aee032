"""The page store as an operator meets it: a disk that fills up (small tmpfs and loop-mounted ext4), a
capacity that must bound the blocks on disk, journal appends failing after each kind of change, damaged
journal records, inspect/verify that must change nothing (also on a live store and a read-only file
system), and a controller wired to the wrong pool. Mounts need root; without it those tests skip, saying so."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest
from conftest import fill_up, run_cmd
import torch

from kvtier import DeviceKVPool, InvalidArgumentError, PageStore, TierController, host_pool_for, testing

PS = 16


@pytest.fixture(autouse=True)
def _no_faults_left():
    testing.clear_faults()
    yield
    testing.clear_faults()


def make_pool(pages=64, dk=128, dv=64, layers=2, heads=2, seed=0):
    """K page 16 KiB, V page 8 KiB (two size classes)."""
    dp = DeviceKVPool(pages * PS, PS, layers, heads, dk, dv, torch.bfloat16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    g = torch.Generator().manual_seed(seed)
    for t in (hp.k_buffer, hp.v_buffer):
        u = t.view(torch.uint8)
        u.copy_(torch.randint(0, 256, u.shape, generator=g, dtype=torch.uint8))
    return dp, hp


def idx(pages):
    return torch.tensor([p * PS + i for p in pages for i in range(PS)], dtype=torch.int64)


def page(hp, p):
    return hp.k_buffer[p].clone(), hp.v_buffer[p].clone()


def same(hp, p, want):
    return torch.equal(hp.k_buffer[p].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(
        hp.v_buffer[p].view(torch.uint8), want[1].view(torch.uint8))


def blocks(root):
    """Bytes of disk blocks of every file under root (what du counts)."""
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
def test_full_disk_fails_pages_not_the_store_and_drains(mounted, fs):
    """Fill a small file system through the store (capacity far above it): puts turn False — never an
    exception — while every acknowledged page stays readable; deletes still work on the full disk; after
    them both size classes (K and V) can be stored again; a reopen loses nothing acknowledged."""
    mnt = mounted(fs, 8 if fs == "tmpfs" else 12)
    dp, hp = make_pool(pages=400)
    want = {p: page(hp, p) for p in range(400)}
    acked = []
    with PageStore(mnt / "store", capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        full = False
        for p in range(0, 396, 4):
            ok = st.batch_set_v1([f"p{q}" for q in range(p, p + 4)], idx(range(p, p + 4)))
            acked += [q for q, o in zip(range(p, p + 4), ok) if o]
            if not all(ok):
                full = True
                break
        assert full, "the file system never filled up"
        assert len(acked) > 100, f"only {len(acked)} pages fit on {fs}: space was wasted"
        assert st.get_stats()["write_failures"] > 0
        fill_up(mnt)  # the last bytes too: a filler file takes whatever the store left
        # more writes on the full disk: no exception; False unless a slot the store already has takes the page
        # (the written half of a page that failed is given back as a free slot), and then it reads back
        late = st.batch_set_v1(["late0", "late1"], idx([396, 397]))
        for name, q, o in zip(["late0", "late1"], [396, 397], late):
            assert not o or (st.batch_get_v1([name], idx([3])) == [True] and same(hp, 3, want[q])), name
        gone = acked[: len(acked) // 4]
        assert st.delete([f"p{q}" for q in gone]) == len(gone), "deletes must work on a full disk"
        acked = acked[len(acked) // 4:]
        ok = st.batch_set_v1([f"again{q}" for q in range(4)], idx(range(396, 400)))
        assert all(ok), f"after deletes freed room, pages (K and V) must fit again: {ok}"
        for q in acked:
            assert st.batch_get_v1([f"p{q}"], idx([0])) == [True] and same(hp, 0, want[q]), f"p{q}"
    with PageStore(mnt / "store", capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        for q in acked:
            assert st.batch_get_v1([f"p{q}"], idx([1])) == [True] and same(hp, 1, want[q]), f"p{q} lost"
        for q in range(396, 400):
            assert st.batch_get_v1([f"again{q - 396}"], idx([2])) == [True] and same(hp, 2, want[q])


@pytest.mark.parametrize("fs", ["tmpfs", "ext4"])
def test_nearly_full_disk_still_takes_the_other_class(mounted, fs):
    """A store that grew a class file by a speculative 64 MiB and, with less free, took the whole disk:
    no page of the other class fit. Now growth is exact: with 3 MiB free, pages keep fitting."""
    mnt = mounted(fs, 16)
    filler = mnt / "filler"
    free = shutil.disk_usage(mnt).free
    with open(filler, "wb") as f:
        f.write(b"\0" * (free - (3 << 20)))
    dp, hp = make_pool(pages=64)
    with PageStore(mnt / "store", capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        ok = st.batch_set_v1([f"p{q}" for q in range(40)], idx(range(40)))
        assert all(ok), f"40 pages of 24 KiB must fit in 3 MiB: {ok}"


@pytest.mark.parametrize("cap", [800 << 10, 4 << 20])
def test_capacity_bounds_blocks_on_disk(tmp_path, cap):
    """A 800 KiB store occupied 128 MiB (preallocation); now data files and journal stay within the
    capacity plus a small overhead (NAMESPACE, LOCK: < 64 KiB), across churn and a reopen."""
    dp, hp = make_pool(pages=64)
    root = tmp_path / "s"
    with PageStore(root, capacity_bytes=cap) as st:
        st.register_mem_pool_host(hp)
        for r in range(12):
            ok = st.batch_set_v1([f"r{r}-{q}" for q in range(16)], idx(range(16)))
            assert any(ok), f"round {r}: eviction must make room"
            if r % 3 == 2:
                st.delete([f"r{r - 1}-{q}" for q in range(0, 16, 2)])
            assert blocks(root) <= cap + (64 << 10), f"round {r}: {blocks(root)} bytes on disk"
        s = st.get_stats()
        assert s["data_bytes_held"] + s["journal_bytes_held"] <= cap
    with PageStore(root, capacity_bytes=cap) as st:
        st.register_mem_pool_host(hp)
        assert blocks(root) <= cap + (64 << 10)


@pytest.mark.parametrize("change", ["delete", "evict", "corrupt_drop"])
def test_failed_journal_append_loses_no_acknowledged_page(tmp_path, change):
    """The journal's disk fails after each kind of change that deletes: nothing is removed early, no slot
    is reused under a live record, batch calls return False instead of raising, and after a reopen every
    acknowledged page is intact (a store that changed its index before the record was durable lost 48 of 48 new pages here)."""
    dp, hp = make_pool(pages=64)
    want = {p: page(hp, p) for p in range(64)}
    cap = 10 * 24576 + (32 << 10)
    acked = {}
    with PageStore(tmp_path, capacity_bytes=cap) as st:
        st.register_mem_pool_host(hp)
        for p in range(8):
            assert st.batch_set_v1([f"old{p}"], idx([p])) == [True]
            acked[f"old{p}"] = p
        with testing.faults("journal_write", errno=errno.ENOSPC, times=None):
            if change == "delete":
                with pytest.raises(OSError):
                    st.delete(["old0", "old1"])
                assert st.exists("old0") and st.exists("old1")
            elif change == "evict":
                ok = st.batch_set_v1([f"x{p}" for p in range(8, 16)], idx(range(8, 16)))
                assert ok.count(True) <= 2, ok  # the room that was left; no eviction could be logged
                for k, p in zip([f"x{p}" for p in range(8, 16)], range(8, 16)):
                    if st.exists(k):
                        acked[k] = p
            else:
                data = sorted((os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                               if f.endswith(".dat")), key=os.path.getsize)
                with open(data[-1], "r+b") as f:  # slot 0 of the K file: old0's K
                    f.write(b"\xee" * 8)
                assert st.batch_get_v1(["old0"], idx([60])) == [False]
                assert not st.exists("old0"), "a corrupt page is never served, even when its drop cannot be logged"
                del acked["old0"]
        for p in range(16, 40):
            if st.batch_set_v1([f"new{p}"], idx([p])) == [True]:
                acked[f"new{p}"] = p
        assert sum(k.startswith("new") for k in acked) == 24, "once the disk is back, writes succeed (evicting)"
        live = {k for k in acked if st.exists(k)}
    with PageStore(tmp_path, capacity_bytes=1 << 30) as st:  # room: the writes below take freed slots
        st.register_mem_pool_host(hp)
        for k in live:
            assert st.batch_get_v1([k], idx([63])) == [True], f"acknowledged {k} lost"
            assert same(hp, 63, want[acked[k]]), f"{k}: wrong bytes"
        # Records of a store that freed slots before the del was durable still pointed old keys at reused slots: reading them dropped them and
        # freed slots that new pages live in, and the next writes overwrote those pages.
        for p in range(8):
            st.batch_get_v1([f"old{p}"], idx([62]))
        for p in range(40, 52):
            if st.batch_set_v1([f"more{p}"], idx([p])) == [True]:
                acked[f"more{p}"] = p
        # every object still present (an evicted page is a miss by design, but no stored K or V may have been
        # overwritten) reads back its own bytes
        ptrs, sizes = hp.get_page_buffer_meta(idx([63]))
        checked = 0
        for k, p in acked.items():
            for j, side in enumerate(("k", "v")):
                name = f"{k}.{side}"
                if st.native_store().exists([name])[0]:
                    assert st.native_store().get([name], [ptrs[j]], [sizes[j]]) == [True], f"acknowledged {name} lost"
                    got = (hp.k_buffer, hp.v_buffer)[j][63].view(torch.uint8)
                    assert torch.equal(got, want[p][j].view(torch.uint8)), f"{name}: wrong bytes"
                    checked += 1
        assert checked >= 16


def _snapshot(root):
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.join(d, f)] = (fh.read(), os.stat(os.path.join(d, f)).st_mtime_ns)
    return out


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True)


def test_damaged_journal_costs_one_record_and_inspect_verify_are_read_only(tmp_path):
    """Flipped bytes in the middle of journal.log cost the record they hit (an inspector that cut the journal at the first bad record cut 34 of 54
    objects); inspect and verify report the damage, exit non-zero, and leave every file byte-identical;
    verify --repair removes it."""
    dp, hp = make_pool(pages=64)
    keys = [f"{i:064x}" for i in range(27)]  # 54 objects
    with PageStore(tmp_path, capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(keys, idx(range(27))))
    (ns,) = [d for d in tmp_path.iterdir() if d.name.startswith("ns-")]
    j = bytearray((ns / "journal.log").read_bytes())
    rec = len(j) // 54
    for i in range(20 * rec + 12, 20 * rec + 16):
        j[i] ^= 0x5A
    (ns / "journal.log").write_bytes(bytes(j))
    before = _snapshot(tmp_path)
    r = _cli("inspect", str(tmp_path))
    assert r.returncode == 0 and "damage" in r.stdout and "53 objects" in r.stdout.replace("objects 53", "53 objects"), r.stdout
    r = _cli("verify", str(tmp_path))
    assert r.returncode == 1 and "DAMAGED" in r.stdout and "damaged journal span" in r.stdout and "--repair" in r.stdout, r.stdout
    assert _snapshot(tmp_path) == before, "inspect/verify changed the store"
    with PageStore(tmp_path, capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_exists(keys) == 10  # page 10 lost one object; every page after it is intact
        assert sum(st.exists(k) for k in keys) == 26
        s = st.get_stats()
        assert s["journal_damaged_spans"] == 1 and s["damaged"]
    r = _cli("verify", "--repair", str(tmp_path))
    assert r.returncode == 0 and "repaired" in r.stdout, r.stdout
    r = _cli("verify", str(tmp_path))
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout


def test_inspect_and_verify_work_on_a_live_store(tmp_path):
    """A store open in a running process (its LOCK held): inspect and verify read a snapshot, change
    nothing, and say the store is live; --repair refuses."""
    dp, hp = make_pool(pages=16)
    with PageStore(tmp_path, capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(["a", "b"], idx([0, 1])))
        before = _snapshot(tmp_path)
        r = _cli("inspect", str(tmp_path))
        assert r.returncode == 0 and "running process" in r.stdout, r.stdout
        r = _cli("verify", str(tmp_path))
        assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
        assert _snapshot(tmp_path) == before
        r = _cli("verify", "--repair", str(tmp_path))
        assert r.returncode == 1 and "in use" in r.stderr and "Traceback" not in r.stderr


def test_inspect_and_verify_on_a_read_only_file_system(mounted):
    mnt = mounted("tmpfs", 8)
    dp, hp = make_pool(pages=16)
    with PageStore(mnt / "s", capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(["a", "b"], idx([0, 1])))
    r = run_cmd("mount", "-o", "remount,ro", str(mnt))
    if r.returncode:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
    r = _cli("inspect", str(mnt / "s"))
    assert r.returncode == 0 and "2 pages" in r.stdout, r.stdout + r.stderr
    r = _cli("verify", str(mnt / "s"))
    assert r.returncode == 0 and "4 objects checked, ok" in r.stdout, r.stdout + r.stderr


def test_controller_refuses_a_store_of_another_pool(tmp_path):
    """TierController(dev, host_b, store registered to host_a) acknowledged every backup and later loaded
    zeros as KV; now it is refused, as is a store that was never registered."""
    dp, hp_a = make_pool(pages=16)
    hp_b = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    with PageStore(tmp_path, capacity_bytes=1 << 30) as st:
        with pytest.raises(InvalidArgumentError, match="register_mem_pool_host"):
            TierController(dp, hp_a, st)
        st.register_mem_pool_host(hp_a)
        with pytest.raises(InvalidArgumentError, match="another host pool"):
            TierController(dp, hp_b, st)
        TierController(dp, hp_a, st).close()


def test_failed_append_keeps_deletes_possible_on_a_full_disk(mounted):
    """A failed journal append is cut back with ftruncate, which on tmpfs and ext4 also frees the blocks
    preallocated for deletes; the store must take them again at once, or a full disk that follows could
    not be drained (found in review)."""
    mnt = mounted("tmpfs", 8)
    dp, hp = make_pool(pages=64)
    with PageStore(mnt / "s", capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1([f"p{q}" for q in range(40)], idx(range(40))))
        with testing.faults("journal_write", errno=errno.EIO):
            assert st.batch_set_v1(["x"], idx([41])) == [False]
        fill_up(mnt)
        assert st.delete([f"p{q}" for q in range(40)]) == 40


def test_verify_reports_a_missing_data_file(tmp_path):
    """A class file gone (an operator's rm, a lost volume): its objects are dropped records, and verify says
    so and exits 1 without changing anything; --repair rewrites the journal."""
    dp, hp = make_pool(pages=16)
    with PageStore(tmp_path, capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert all(st.batch_set_v1(["a", "b"], idx([0, 1])))
    (ns,) = [d for d in tmp_path.iterdir() if d.name.startswith("ns-")]
    (ns / "class-8192.dat").unlink()  # the V objects
    before = _snapshot(tmp_path)
    r = _cli("verify", str(tmp_path))
    assert r.returncode == 1 and "missing data file(s): class-8192.dat" in r.stdout and "dropped" in r.stdout, r.stdout
    assert _snapshot(tmp_path) == before
    assert _cli("verify", "--repair", str(tmp_path)).returncode == 0
    r = _cli("verify", str(tmp_path))
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout
    with PageStore(tmp_path, capacity_bytes=1 << 30) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_exists(["a", "b"]) == 0
