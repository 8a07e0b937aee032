"""Where SGLang's store lives by default (a cache directory on disk, not the system temp directory), the warning
for a store on tmpfs, and SGLang's `capacity_bytes` as the budget of the whole directory (every rank)."""

from __future__ import annotations

import os

import pytest
from sglang_pools import config, idx, sglang_pool

from kvtier import _native
from kvtier._paths import default_store_dir, fs_type, volatile_warning
from kvtier.integrations.sglang import KvtierStorage


def test_default_store_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_store_dir("hicache") == str(tmp_path / "xdg" / "kvtier" / "hicache")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # invalid per the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_store_dir("hicache") == str(tmp_path / "home" / ".cache" / "kvtier" / "hicache")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_store_dir("x") == str(tmp_path / "home" / ".cache" / "kvtier" / "x")


def test_fs_type_takes_the_longest_mount_holding_the_path(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "30 22 0:25 / /dev/shm rw,nosuid shared:2 - tmpfs tmpfs rw\n"
        f"31 22 0:26 / {tmp_path}/with\\040space rw shared:3 - ramfs none rw\n"
        f"32 22 0:27 / {tmp_path}/over rw shared:4 - tmpfs tmpfs rw\n"
        f"33 32 0:28 / {tmp_path}/over rw shared:5 - xfs /dev/vdb rw\n"  # mounted over the tmpfs
        "garbage line\n"
    )
    for d in ("with space", "over", "overt"):
        (tmp_path / d).mkdir()
    assert fs_type("/dev/shm/kvtier/not/yet/made", str(info)) == "tmpfs"
    assert fs_type(tmp_path / "with space" / "store", str(info)) == "ramfs"
    assert fs_type(tmp_path / "over" / "store", str(info)) == "xfs"
    assert fs_type(tmp_path / "overt", str(info)) == "ext4"  # a prefix of a name is not a parent
    assert fs_type("/", str(tmp_path / "missing")) is None
    note = volatile_warning("/dev/shm/kv", "path", str(info))
    assert note is not None and "tmpfs" in note and "lost at every reboot" in note and ".cache/kvtier" in note
    assert volatile_warning(tmp_path / "overt", "path", str(info)) is None


def test_sglang_warns_when_its_store_is_on_tmpfs(mounted):
    mnt = mounted("tmpfs", 16)
    with pytest.warns(RuntimeWarning, match="is on tmpfs"):
        be = KvtierStorage(config(mnt / "kv"))
    be.close()


def test_sglang_default_path_and_one_budget_for_every_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    budget = 256 << 10  # a page is 20 KiB here (K 9 KiB in 12 KiB, V 6 KiB in 8 KiB): about 12 pages in all

    def rank(r):
        cfg = config(None, tp_rank=r, tp_size=2, capacity_bytes=budget)
        del cfg.extra_config["path"]  # the default
        be = KvtierStorage(cfg)
        be.register_mem_pool_host(sglang_pool("page_first_direct", pages=16, seed=r))
        return be

    r0, r1 = rank(0), rank(1)
    root = str(tmp_path / "cache" / "kvtier" / "hicache")
    assert r0.store.path == root and r1.store.path == root
    keys = [[f"{r}{i:063x}" for i in range(16)] for r in range(2)]

    def on_disk():
        return sum(e["disk_bytes"] for e in _native.store_namespaces(root)[1])

    for b in range(4):  # rank 0 alone: evicts its own pages to fit
        assert r0.batch_set_v1(keys[0][4 * b:4 * b + 4], idx(range(4 * b, 4 * b + 4))) == [True] * 4
    assert on_disk() <= budget + 2 * (64 << 10)
    assert not any(r1.batch_set_v1(keys[1][:4], idx(range(4))))  # the budget is rank 0's: rank 1 waits
    assert r0.batch_set_v1(keys[0][:1], idx([0])) == [True]  # ... and rank 0 makes room, down to half
    assert all(r1.batch_set_v1(keys[1][:4], idx(range(4))))
    assert r0.batch_exists(keys[0][:1]) == 1 and r1.batch_exists(keys[1][:4]) == 4
    got, listed = _native.store_namespaces(root)
    assert got == budget and len(listed) == 2
    assert on_disk() <= budget + 2 * (64 << 10), on_disk()
    for be in (r0, r1):
        be.close()
    assert os.path.isdir(root)
