"""A CPU device pool, a small host pool, a PageStore and a TierController over them, with the row helper the
controller and tenant tests share."""

import torch

from kvtier import DeviceKVPool, PageStore, TierController, host_pool_for

PS = 4


def setup(tmp_path, policy="write_through", host_pages=6, store=True, **kw):
    dp = DeviceKVPool(16 * PS, PS, 2, 2, 8, 6, torch.float32, "cpu")
    for t in dp.k_buffer + dp.v_buffer:
        t.copy_(torch.randn_like(t))
    per_page = PS * 2 * (8 + 6) * 2 * 4
    hp = host_pool_for(dp, host_size_gb=(host_pages - 1) * per_page / 1e9 + 1e-12, layout="page_first_direct")
    st = None
    if store:
        st = PageStore(tmp_path, capacity_bytes=1 << 26)
        st.register_mem_pool_host(hp)
    return dp, hp, st, TierController(dp, hp, st, write_policy=policy, **kw)


def rows(pages):
    return torch.tensor([p * PS + i for p in pages for i in range(PS)], dtype=torch.int64)
