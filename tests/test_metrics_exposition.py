"""The whole Prometheus exposition of kvtier.metrics over one of each source, held to a stored copy
(tests/data/metrics_exposition.txt): a TierController whose store is a chain of two disk tiers, a disk store
of its own, the same chain again, and an SGLang backend with two extra v2 pools. Every family, its help
text, its labels and their order, and every value that does not depend on the clock or the file system
(those are shown as ``X``). ``KVTIER_WRITE_GOLDEN=1`` writes the copy instead of comparing."""

import os
import re

import pytest
import torch

pytest.importorskip("sglang")  # an SGLang backend is one of the sources (in vLLM's environment: skipped)
pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402
from sglang_pools import config, hybrid, idx, keys_for  # noqa: E402

from kvtier import DeviceKVPool, PageStore, TierController, host_pool_for, page_hashes  # noqa: E402
from kvtier.integrations.sglang import KvtierStorage  # noqa: E402
from kvtier.metrics import KvtierCollector  # noqa: E402
from kvtier.tiers import TieredStore  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(__file__), "data", "metrics_exposition.txt")
PS = 4
#: samples whose values come from the clock or the file system
VARYING = re.compile(r"^kvtier_(store_batch_seconds_(bucket|sum)|tier_measured_gbps|store_(data|journal)_held_bytes"
                     r"|store_decode_gbps_per_thread)\b")


def masked(text):
    out = []
    for line in text.splitlines():
        if not line.startswith("#") and VARYING.match(line):
            line = line.rsplit(" ", 1)[0] + " X"
        out.append(line)
    return "\n".join(out) + "\n"


def test_exposition_of_every_source_is_unchanged(tmp_path):
    dp = DeviceKVPool(16 * PS, PS, 2, 2, 8, 6, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    for t in dp.k_buffer + dp.v_buffer:
        t.copy_(torch.randn(t.shape, generator=g))
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    disk = PageStore(tmp_path / "disk", model_name="m", capacity_bytes=1 << 26, probe_bytes=0)
    remote = PageStore(tmp_path / "remote", model_name="m", capacity_bytes=1 << 26, probe_bytes=0)
    own = PageStore(tmp_path / "own", model_name="own", capacity_bytes=1 << 26, probe_bytes=0)
    for s in (disk, remote, own):
        s.register_mem_pool_host(hp)
    chain = TieredStore([("disk", disk), ("remote", remote)])
    c = TierController(dp, hp, chain, write_policy="write_through")
    be = KvtierStorage(config(tmp_path / "be"))
    try:
        keys = page_hashes(list(range(3 * PS)), PS)
        c.backup(torch.arange(PS, 4 * PS), keys)
        c.wait_idle()
        assert c.match(keys + page_hashes(list(range(100, 100 + PS)), PS)) == (3, 0)
        disk.delete(keys[:1])  # the chain serves it from its second tier, and fills the first
        assert chain.batch_get_v1(keys, torch.arange(8 * PS, 11 * PS)) == [True] * 3
        assert own.batch_set_v1(keys[:2], torch.arange(PS, 3 * PS)) == [True, True]
        assert own.batch_get_v1([keys[0], "f" * 64], torch.arange(8 * PS, 10 * PS)) == [True, False]

        kv, swa, mamba = hybrid()
        be.register_mem_pool_host(kv)
        for name, p in ((PoolName.KV, kv), (PoolName.SWA, swa), (PoolName.MAMBA, mamba)):
            be.register_mem_host_pool_v2(p, name)
        be.on_host_pools_registered()
        bkeys = keys_for(4)
        assert be.batch_set_v1(bkeys, idx([0, 1, 2, 3])) == [True] * 4
        assert be.batch_get_v1(bkeys[:2], idx([4, 5])) == [True, True]
        assert be.batch_set_v2([PoolTransfer(PoolName.SWA, host_indices=idx([2, 3]), keys=bkeys[2:]),
                                PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([5]), keys=bkeys[3:])]) \
            == {PoolName.SWA: [True, True], PoolName.MAMBA: [True]}
        assert be.batch_exists(bkeys + keys_for(1, salt=9)) == 4

        reg = CollectorRegistry()
        reg.register(KvtierCollector(controller=c, stores=[own, chain, be]))
        text = masked(generate_latest(reg).decode())
    finally:
        be.close()
        c.close()
        chain.close()
        own.close()
    if os.environ.get("KVTIER_WRITE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(text)
    with open(GOLDEN) as f:
        want = f.read()
    assert text == want
