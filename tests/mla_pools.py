"""MLA device pools filled with random bytes and the row helper the MLA pool and cluster tests share."""

import torch

from kvtier import MLADeviceKVPool

PS, L, LORA, ROPE = 4, 3, 24, 8


def filled(size=8 * PS, ps=PS, layers=L, dtype=torch.bfloat16, device="cpu", seed=0):
    dp = MLADeviceKVPool(size, ps, layers, LORA, ROPE, dtype, device)
    g = torch.Generator().manual_seed(seed)
    for t in dp.kv_buffer:
        u8 = t.view(torch.uint8)
        u8.copy_(torch.randint(0, 256, u8.shape, generator=g, dtype=torch.uint8).to(device))
    return dp


def rows(pages, ps=PS, device="cpu"):
    return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64, device=device)
