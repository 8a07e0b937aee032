"""SGLang's own host pools built on the CPU (MHA, asymmetric, MLA, Mamba state) and the backend config the
SGLang conformance tests share."""

import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName
from sglang.srt.mem_cache.pool_host import PoolEntry
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost, MHATokenToKVPoolHost

PS, L, H = 4, 3, 2


def config(path, *, tp_rank=0, tp_size=1, mla=False, layout="page_first_direct", metrics=False, **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=(layout == "page_first"),
        model_name="XiaomiMiMo/MiMo-V2-Flash",
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                      "class_name": "KvtierStorage", "interface_v1": 1, "path": str(path),
                      # the planner is off here (these tests pin the mechanics; test_engine_planning.py covers it)
                      "restore_planner": False, **extra},
    )


def sglang_pool(layout, dk=192, dv=128, pages=8, dtype=torch.bfloat16, seed=0):
    """SGLang's own host pool built on the CPU the way its unit tests do (no CUDA, no allocator)."""
    asym = dk != dv
    cls = AsymmetricMHATokenToKVPoolHost if asym else MHATokenToKVPoolHost
    pool = cls.__new__(cls)
    pool.page_size, pool.layer_num, pool.head_num, pool.head_dim, pool.v_head_dim = PS, L, H, dk, dv
    pool.dtype, pool.layout, pool.page_num, pool.size = dtype, layout, pages, pages * PS
    shape = {"page_first": lambda d: (pages * PS, L, H, d), "page_first_direct": lambda d: (pages, L, PS, H, d)}[layout]
    g = torch.Generator().manual_seed(seed)

    def rand(s):
        return torch.randint(0, 256, (torch.Size(s).numel() * 2,), generator=g, dtype=torch.uint8).view(dtype).view(s)

    pool.kv_buffer = (rand(shape(dk)), rand(shape(dv))) if asym else rand((2, *shape(dk)))
    return pool


def page_bytes(pool, page):
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page * PS, (page + 1) * PS))
    out = []
    for t, ptr, n in ((pool.k_buffer, ptrs[0], sizes[0]), (pool.v_buffer, ptrs[1], sizes[1])):
        base = t.data_ptr() if not isinstance(pool.kv_buffer, torch.Tensor) else pool.kv_buffer.data_ptr()
        flat = (t if not isinstance(pool.kv_buffer, torch.Tensor) else pool.kv_buffer).view(torch.uint8).reshape(-1)
        out.append(flat[ptr - base : ptr - base + n].clone())
    return out


def idx(pages):
    return torch.tensor([p * PS + i for p in pages for i in range(PS)], dtype=torch.int64)


def sglang_mla_pool(layout, pages=8, lora=64, rope=16, dtype=torch.bfloat16, seed=0):
    """SGLang's own MLA host pool, built on the CPU (as sglang_pool does for MHA): one latent+rope row per
    token and layer, one object per page for zero-copy storage."""
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    pool = MLATokenToKVPoolHost.__new__(MLATokenToKVPoolHost)
    d = lora + rope
    pool.page_size, pool.layer_num, pool.kv_lora_rank, pool.qk_rope_head_dim = PS, L, lora, rope
    pool.kv_cache_dim, pool.dtype, pool.layout = d, dtype, layout
    pool.page_num, pool.size, pool.dcp_size = pages, pages * PS, 1  # logical_page_size follows (a property)
    shape = {"page_first": (pages * PS, L, 1, d), "page_first_direct": (pages, L, PS, 1, d)}[layout]
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer = torch.randint(0, 256, (torch.Size(shape).numel() * 2,), generator=g,
                                   dtype=torch.uint8).view(dtype).view(shape)
    return pool


def mamba_pool(seed=0, slots=8):
    """SGLang's own Mamba state host pool, on the CPU: a temporal state and one conv state per slot."""
    info = MambaStateBufferInfo(temporal=torch.zeros(2, slots + 1, 4, 8),
                                conv=(torch.zeros(2, slots + 1, 3, 16, dtype=torch.bfloat16),))
    pool = MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, device="cpu", layout="page_first")
    g = torch.Generator().manual_seed(seed)
    for t in pool.get_hybrid_pool_buffer():
        u8 = t.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, generator=g, dtype=torch.uint8))
    return pool


def hybrid(seed=0):
    """The anchor (MiMo-like asymmetric full-attention KV), an SWA KV pool and a Mamba state pool."""
    return sglang_pool("page_first_direct", seed=seed), sglang_pool("page_first_direct", 128, 128, seed=seed + 1), \
        mamba_pool(seed + 2)


def group(kv, swa, mamba):
    for p in (kv, swa):  # what SGLang's constructor would have set on pools built without it
        p.device, p.can_use_write_back_jit = "cpu", False
    return HostPoolGroup([
        PoolEntry(PoolName.KV, kv, None, lambda i: i, is_primary_index_anchor=True),
        PoolEntry(PoolName.SWA, swa, None, lambda i: i),
        PoolEntry(PoolName.MAMBA, mamba, None, lambda i: i),
    ])


def snapshot(*pools):
    out = []
    for p in pools:
        ts = p.get_hybrid_pool_buffer() if hasattr(p, "get_hybrid_pool_buffer") else [p.kv_buffer]
        for t in ts:
            for x in (t if isinstance(t, (list, tuple)) else [t]):
                out.append(x.view(torch.uint8).clone())
    return out


def keys_for(n, salt=0):
    return [f"{salt:08x}{i:056x}" for i in range(n)]
