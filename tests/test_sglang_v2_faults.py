"""The v2 pool stores (hybrid models' extra pools) as an adversary meets them: an IO error at every journal
and data call, a full disk, and kill -9 of the writing process. An acknowledged page is never lost and a
page never comes back with wrong bytes; failures are False results, never exceptions."""

import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang_pools import config, idx, sglang_pool
from sglang_pools import mamba_pool

from kvtier import _native, testing
from kvtier.integrations.sglang import KvtierStorage


def fill(pool, seed):
    g = torch.Generator().manual_seed(seed)
    for t in pool.get_hybrid_pool_buffer():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g, dtype=torch.uint8))


def slot_bytes(pool, slot):
    return [t[slot].view(torch.uint8).clone() for t in pool.get_hybrid_pool_buffer()]


@pytest.mark.parametrize("point", [p for p in _native.fault_points() if p not in ("probe", "data_read")])
def test_an_io_error_at_each_point_loses_no_acknowledged_page(tmp_path, point):
    be = KvtierStorage(config(tmp_path))
    be.register_mem_pool_host(sglang_pool("page_first_direct"))
    m = mamba_pool(seed=1)
    be.register_mem_host_pool_v2(m, PoolName.MAMBA)
    want = {s: slot_bytes(m, s) for s in range(8)}
    keys = [f"{i:064x}" for i in range(8)]
    first = be.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([0, 1, 2, 3]), keys=keys[:4])])
    assert first[PoolName.MAMBA] == [True] * 4
    with testing.faults(point, "error", errno=errno.EIO, times=None):
        got = be.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([4, 5, 6, 7]), keys=keys[4:])])
    acked = keys[:4] + [k for k, ok in zip(keys[4:], got[PoolName.MAMBA]) if ok]
    be.close()
    # reopen (recovery runs) and read every key into other slots: acknowledged ones exact, the rest misses
    be = KvtierStorage(config(tmp_path))
    be.register_mem_pool_host(sglang_pool("page_first_direct"))
    m2 = mamba_pool(seed=9)
    be.register_mem_host_pool_v2(m2, PoolName.MAMBA)
    for i, k in enumerate(keys):
        ok = be.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([8 + i]), keys=[k])])[PoolName.MAMBA]
        if k in acked:
            assert ok == [True], f"acknowledged page {i} lost after a {point} error"
        if ok == [True]:
            assert all(torch.equal(a, b) for a, b in zip(slot_bytes(m2, 8 + i), want[i])), f"page {i}: wrong bytes"
    be.close()


def test_a_full_disk_is_false_results_and_keeps_what_was_stored(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        with pytest.warns(RuntimeWarning, match="is on tmpfs"):  # (a small disk that fills: tmpfs is the tool)
            be = KvtierStorage(config(mnt, capacity_bytes=1 << 40, direct=False))
        be.register_mem_pool_host(sglang_pool("page_first_direct"))
        swa = sglang_pool("page_first_direct", 128, 128, pages=64, seed=3)
        be.register_mem_host_pool_v2(swa, PoolName.SWA)
        acked = []
        for b in range(16):  # 12 KiB a page: the 2 MiB disk fills part of the way through
            keys = [f"{b:04x}{i:060x}" for i in range(4)]
            ok = be.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=idx(range(4)), keys=keys)])[PoolName.SWA]
            acked += [k for k, o in zip(keys, ok) if o]
        assert 0 < len(acked) < 64, "the disk should have filled"
        want = swa.kv_buffer.view(torch.uint8)[:, :4].clone()
        swa.kv_buffer.zero_()
        for b in range(16):
            keys = [f"{b:04x}{i:060x}" for i in range(4)]
            for i, k in enumerate(keys):
                ok = be.batch_get_v2([PoolTransfer(PoolName.SWA, host_indices=idx([i]), keys=[k])])[PoolName.SWA]
                assert ok == [k in acked]
                if ok == [True]:
                    assert torch.equal(swa.kv_buffer.view(torch.uint8)[:, i], want[:, i])
        be.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


CHILD = textwrap.dedent(
    """
    import sys, torch, zlib
    sys.path.insert(0, sys.argv[3])
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang_pools import config, sglang_pool
    from sglang_pools import mamba_pool
    from kvtier.integrations.sglang import KvtierStorage
    from pathlib import Path
    be = KvtierStorage(config(Path(sys.argv[1])))
    be.register_mem_pool_host(sglang_pool("page_first_direct"))
    m = mamba_pool(seed=int(sys.argv[2]))
    be.register_mem_host_pool_v2(m, PoolName.MAMBA)
    n = 0
    while True:
        slot = n % 8
        key = f"{sys.argv[2]}-{n}"
        for t in m.get_hybrid_pool_buffer():   # the page's bytes are a function of its key
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            t[slot].view(torch.uint8).copy_(torch.randint(0, 256, t[slot].view(torch.uint8).shape, generator=g, dtype=torch.uint8))
        ok = be.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=[key])])
        if ok[PoolName.MAMBA] == [True]:
            print(key, flush=True)
        n += 1
    """
)


def test_kill_9_while_storing_v2_pages_loses_nothing_acknowledged(tmp_path):
    rng = random.Random(7)
    acked = []
    for it in range(4):
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(it), os.path.dirname(__file__)],
                             stdout=subprocess.PIPE, text=True)
        deadline = time.time() + 4 + rng.random() * 2
        got = []
        while time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            got.append(line.strip())
            if len(got) > 3 and rng.random() < 0.05:
                break
        p.send_signal(signal.SIGKILL)
        got += [x for x in p.communicate()[0].split() if x]
        assert got, f"iteration {it}: the child acknowledged nothing"
        acked += got
    be = KvtierStorage(config(tmp_path))
    be.register_mem_pool_host(sglang_pool("page_first_direct"))
    m = mamba_pool(seed=99)
    be.register_mem_host_pool_v2(m, PoolName.MAMBA)
    ref = mamba_pool(seed=98)
    for key in acked:
        assert be.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([0]), keys=[key])])[PoolName.MAMBA] == [True], key
        for t, r in zip(m.get_hybrid_pool_buffer(), ref.get_hybrid_pool_buffer()):
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            r[0].view(torch.uint8).copy_(torch.randint(0, 256, r[0].view(torch.uint8).shape, generator=g, dtype=torch.uint8))
            assert torch.equal(t[0].view(torch.uint8), r[0].view(torch.uint8)), f"{key}: wrong bytes after kill -9"
    be.close()
