"""A new tier is one class and one registration (docs/ARCHITECTURE.md, "A new tier"): an in-memory object store,
built on kvtier.tiers.objects (its pages as named objects, an integrity record per page, the check of a read)
and registered in kvtier.tier.TIERS, is taken by SGLang's storage backend and by the transformers KVTier as a
tier spec with no other change; pages come back byte for byte, a damaged object is a miss, and an unknown name
is refused before anything is opened."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kvtier import InvalidArgumentError, Tier, _native
from kvtier.namespace import Ranks
from kvtier.page_layout import host_buffers, page_layout
from kvtier.planner import TierEstimate, TierMeter
from kvtier.tenants import check_keys, scope_keys
from kvtier.tier import TIERS, TierContext, TierEntry, build_tier, check_tier_spec
from kvtier.tiers.objects.pages import PageObjects
from kvtier.tiers.objects.records import TOO_SMALL, check_read, record_bytes

#: the object stores of the test, by bucket (a "cluster" every tier of one bucket shares)
BUCKETS: dict[str, dict[str, bytes]] = {}


class MemoryTier:
    """Pages as objects in a dict: what an object-store tier does, without the store."""

    name = "memory"
    lookups_may_block = False

    def __init__(self, context: TierContext, *, bucket: str = "default") -> None:
        self.context, self.objects = context, BUCKETS.setdefault(bucket, {})
        self.page_bytes = 0
        self._pool: Any = None
        self._objs: PageObjects | None = None
        self._views: list[tuple[int, torch.Tensor]] = []
        self.ranges = _native.HostRanges()
        self.meter = TierMeter(self.name)
        self.stats = {"hits": 0, "misses": 0, "corrupt": 0, "stale": 0}

    @property
    def pool(self) -> Any:
        return self._pool

    def register_mem_pool_host(self, pool: Any) -> None:
        page_num = int(getattr(pool, "page_num", None) or pool.size // pool.page_size)
        buffers = host_buffers(pool)
        if buffers:
            for b in buffers:
                self.ranges.register_region(b.region)
            self._views = [(b.ptr, b.as_tensor(torch.uint8, (b.nbytes,))) for b in buffers]
        else:
            kv = pool.kv_buffer
            for t in (list(kv) if isinstance(kv, (tuple, list)) else [kv]):
                self.ranges.register_tensor(t)
                self._views.append((t.data_ptr(), t.view(torch.uint8).reshape(-1)))
        ctx = self.context
        self._objs = PageObjects(pool, page_layout(pool, page_num), page_num, prefix="mem", key_tag=None,
                                 model_name=ctx.model_name or "default", ranks=(ctx.ranks or Ranks()).table(),
                                 kv_cache_dtype=ctx.kv_cache_dtype, sealed=None, scheme="test-memory-v1",
                                 seal_scheme="test-memory-seal-v1")
        self._pool, self.page_bytes = pool, self._objs.page_bytes

    def _bytes(self, ptr: int, n: int) -> torch.Tensor:
        """The pool's bytes at ``ptr`` as a slice of a view of its buffers (never a raw address)."""
        for base, view in self._views:
            if base <= ptr and ptr + n <= base + view.numel():
                return view[ptr - base: ptr - base + n]
        raise AssertionError("an address outside the pool")

    def _batch(self, keys: Sequence[str], host_indices: torch.Tensor, read: bool) -> tuple[Any, ...]:
        assert self._objs is not None
        m, keys = self._objs, scope_keys(self.context.tenant, check_keys(keys))
        names, ptrs, sizes = m.objects(keys, m.pages(keys, host_indices))
        self.ranges.check(ptrs, sizes, read, "host_indices")
        return m, keys, names, ptrs, sizes

    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        m, keys, names, ptrs, sizes = self._batch(keys, host_indices, False)
        crcs, k = self.ranges.crc32c(names, ptrs, sizes), len(m.sides)
        for name, ptr, n in zip(names, ptrs, sizes):
            self.objects[name] = self._bytes(ptr, n).numpy().tobytes()
        for i, key in enumerate(keys):  # the record after the data
            objs = range(i * k, (i + 1) * k)
            self.objects[f"{m.base(key)}_kvtier"] = record_bytes(m.fp, [(sizes[j], crcs[j]) for j in objs])
        self.meter.observe("write", len(keys) * self.page_bytes, 1e-6)
        return [True] * len(keys)

    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        m, keys, names, ptrs, sizes = self._batch(keys, host_indices, True)
        rview, res = np.zeros(len(keys) * m.slot, dtype=np.uint8), []
        for i, key in enumerate(keys):
            rec = self.objects.get(f"{m.base(key)}_kvtier")
            if rec is not None and len(rec) <= m.rec_bytes:
                rview[i * m.slot: i * m.slot + len(rec)] = np.frombuffer(rec, dtype=np.uint8)
            res.append(-1 if rec is None else TOO_SMALL if len(rec) > m.rec_bytes else len(rec))
        for name, ptr, n in zip(names, ptrs, sizes):
            data = self.objects.get(name)
            if data is not None and len(data) <= n:
                self._bytes(ptr, len(data)).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            res.append(-1 if data is None else TOO_SMALL if len(data) > n else len(data))
        served, _, bad, stale = check_read(m, len(keys), res, rview, keys, names, ptrs, sizes, self.ranges, None, False)
        self.stats["hits"] += len(served)
        self.stats["misses"] += len(keys) - len(served)
        self.stats["corrupt"] += len(bad)
        self.stats["stale"] += stale
        self.meter.observe("read", len(served) * self.page_bytes, 1e-6)
        return [i in set(served) for i in range(len(keys))]

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        assert self._objs is not None
        m, n = self._objs, 0
        for key in scope_keys(self.context.tenant, check_keys(keys)):
            if not all(x in self.objects for x in [f"{m.base(key)}_kvtier", *m.data_keys(key)]):
                break
            n += 1
        self.meter.observe_lookup(n, len(keys))
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def locate(self, keys: Sequence[str]) -> list[tuple[str, int]]:
        n = self.batch_exists(keys)
        return [(self.name, n)] if n else []

    def measured(self) -> dict[str, TierEstimate]:
        return {self.name: self.meter.estimate()}

    def delete(self, keys: Sequence[str]) -> int:
        assert self._objs is not None
        m, n = self._objs, 0
        for key in scope_keys(self.context.tenant, check_keys(keys)):
            n += self.objects.pop(f"{m.base(key)}_kvtier", None) is not None
            for name in m.data_keys(key):
                self.objects.pop(name, None)
        return n

    def erase_tenant(self, salt: str | None = None, *, tag: str | None = None) -> int:
        return 0

    def clear(self) -> None:
        self.objects.clear()

    def get_stats(self) -> dict[str, Any]:
        return dict(self.stats)

    def close(self) -> None:
        self._views = []


@pytest.fixture
def memory_tier(monkeypatch):
    """The one registration a new tier needs: its name in kvtier.tier.TIERS (the options a spec may give)."""
    monkeypatch.setitem(TIERS, "memory", TierEntry(MemoryTier, frozenset({"bucket"})))
    BUCKETS.clear()
    yield BUCKETS
    BUCKETS.clear()


def test_the_memory_tier_has_the_interfaces_signatures_and_builds_by_name(memory_tier):
    for name in (n for n in dir(Tier) if not n.startswith("_") and n not in ("page_bytes", "pool", "name")):
        want = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(Tier, name)).parameters.values()]
        got = [(p.name, p.kind, p.default) for p in inspect.signature(getattr(MemoryTier, name)).parameters.values()]
        assert got == want, name
    t = build_tier({"memory": {"bucket": "b"}}, TierContext(model_name="m"), tenant="t1")
    assert isinstance(t, MemoryTier) and isinstance(t, Tier) and t.context == TierContext(model_name="m", tenant="t1")
    assert check_tier_spec("memory") == ("memory", {})
    with pytest.raises(InvalidArgumentError, match=r"invalid argument `tiers`: unknown key\(s\) \['bukket'\]"):
        check_tier_spec({"memory": {"bukket": "b"}}, "tiers")
    with pytest.raises(InvalidArgumentError, match="unknown tier 'nosuch'; registered tiers: disk, (.*, )?memory, (.*, )?mooncake"):
        check_tier_spec("nosuch", "tiers")


def _sglang():
    pytest.importorskip("sglang")
    from kvtier.integrations.sglang import KvtierStorage
    from sglang_pools import config, idx, page_bytes, sglang_pool

    return KvtierStorage, config, idx, page_bytes, sglang_pool


@pytest.mark.parametrize("deadline", ["auto", None])  # through staging pages, or zero copy
def test_sglang_takes_a_registered_tier_by_its_spec(memory_tier, tmp_path, deadline):
    KvtierStorage, config, idx, page_bytes, sglang_pool = _sglang()
    src = sglang_pool("page_first_direct", seed=5)
    spec = ["disk", {"memory": {"bucket": "cluster"}}]
    deadlines = {"read_deadline_s": deadline, "write_deadline_s": None if deadline is None else 2.0}
    w = KvtierStorage(config(tmp_path / "a", tiers=spec, **deadlines))
    w.register_mem_pool_host(src)
    assert w.batch_set_v1(["p0", "p1", "p2"], idx([0, 1, 2])) == [True] * 3
    assert len(memory_tier["cluster"]) == 3 * 3  # K, V and the record of each page
    w.close()
    # another node: an empty disk, the same store behind it
    dst = sglang_pool("page_first_direct", seed=6)
    r = KvtierStorage(config(tmp_path / "b", tiers=spec, **deadlines))
    r.register_mem_pool_host(dst)
    assert r.batch_exists(["p0", "p1", "p2", "p3"]) == 3
    assert r.batch_get_v1(["p0", "p1", "p2"], idx([5, 6, 7])) == [True] * 3
    for a, b in zip((0, 1, 2), (5, 6, 7)):
        assert all(torch.equal(x, y) for x, y in zip(page_bytes(src, a), page_bytes(dst, b)))
    st = r.kvtier_stats()
    assert st["memory"]["hits"] == 3 and st["memory"]["store"]["hits"] == 3
    # a damaged object is a miss, never wrong bytes
    name = next(n for n in memory_tier["cluster"] if "p1" in n and n.endswith("_k"))
    memory_tier["cluster"][name] = bytes(len(memory_tier["cluster"][name]))
    r.store.clear()
    assert r.batch_get_v1(["p1"], idx([4])) == [False]
    r.close()


def test_sglang_refuses_an_unknown_tier_before_anything_opens(memory_tier, tmp_path):
    KvtierStorage, config, *_ = _sglang()
    for tiers, match in ((["disk", "nosuch"], "registered tiers: disk, (.*, )?memory, (.*, )?mooncake"),
                         (["disk", {"memory": {"size": 1}}], r"unknown key\(s\) \['size'\]"),
                         (["disk", "memory", "memory"], "each tier once"), (["memory"], "first is \"disk\"")):
        with pytest.raises(InvalidArgumentError, match=match):
            KvtierStorage(config(tmp_path, tiers=tiers))
    assert not any(tmp_path.iterdir())


def test_transformers_takes_a_registered_tier_by_its_spec(memory_tier, tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtier.integrations.transformers import KVTier, cache_kwarg

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()
    ids = torch.randint(0, 128, (1, 35), generator=torch.Generator().manual_seed(1))

    def run(tier: Any) -> tuple[Any, Any]:
        out = model.generate(ids, **{cache_kwarg(model): tier.cache(ids)}, max_new_tokens=3, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        return out.sequences, torch.stack(out.logits)

    kw = dict(model_id="test/registry", page_size=8, host_tokens=256, restore="all", tiers=[{"memory": {}}])
    with pytest.raises(InvalidArgumentError, match="invalid argument `tiers`: unknown tier 'nosuch'"):
        KVTier(model, store_dir=tmp_path / "x", **{**kw, "tiers": ["nosuch"]})
    with pytest.raises(InvalidArgumentError, match="`tiers` or its shorthand `cluster`"):
        KVTier(model, store_dir=tmp_path / "x", cluster="127.0.0.1:1", **kw)
    assert not any(tmp_path.iterdir())
    with KVTier(model, store_dir=tmp_path / "a", **kw) as tier:
        want = run(tier)
        tier.controller.wait_idle()
    assert len(memory_tier["default"]) == 3 * ((35 + 2) // 8)  # K, V and the record of each full page
    with KVTier(model, store_dir=tmp_path / "b", **kw) as tier:  # an empty disk: the pages come from memory
        cache = tier.cache(ids)
        assert cache.restored_store_pages == 4 and tier.store.get_stats()["memory"]["hits"] == 4
        got = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=3, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        assert torch.equal(got.sequences, want[0])
