"""Host pools with random bytes and page helpers, shared by the PageStore, security and tenant tests."""

import torch

from kvtier import DeviceKVPool, host_pool_for

PS = 4


def make_pool(layout="page_first_direct", dk=192, dv=128, layers=3, heads=2, pages=16, dtype=torch.bfloat16, seed=0):
    dp = DeviceKVPool(pages * PS, PS, layers, heads, dk, dv, dtype, "cpu")
    hp = host_pool_for(dp, layout=layout, host_to_device_ratio=1.0)
    g = torch.Generator().manual_seed(seed)
    for t in (hp.k_buffer, hp.v_buffer):
        u = t.view(torch.uint8)
        u.copy_(torch.randint(0, 256, u.shape, generator=g, dtype=torch.uint8))
    return hp


def page_bytes(hp, page):
    """(K bytes, V bytes) of one host page, through get_page_buffer_meta's addresses."""
    idx = torch.arange(page * PS, (page + 1) * PS)
    ptrs, sizes = hp.get_page_buffer_meta(idx)
    out = []
    for t, ptr, n in ((hp.k_buffer, ptrs[0], sizes[0]), (hp.v_buffer, ptrs[1], sizes[1])):
        off = ptr - t.data_ptr()
        out.append(t.view(torch.uint8).reshape(-1)[off : off + n].clone())
    return out


def pages_idx(pages):
    return torch.tensor([p * PS + i for p in pages for i in range(PS)], dtype=torch.int64)
