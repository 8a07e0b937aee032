"""The Triton kernel backend (run on the CPU through Triton's interpreter), the LayerLoader and
backup_async on CPU device pools. The same paths run on the GPU in test_transfer_cuda.py."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kvtier
from kvtier import DeviceKVPool, LayerLoader, backup_async, host_pool_for

pytest.importorskip("triton")

KERNEL_CHECK = textwrap.dedent(
    """
    import itertools, torch
    from kvtier.transfer import kernels
    L, S, PS, H = 3, 16, 4, 2
    for dtype, D, layout, (tile, prefetch) in itertools.product(
        (torch.float16, torch.float32, torch.uint8), (6, 5), ("layer_first", "page_first", "page_first_direct"),
        ((4096, True), (8, True), (8, False)),  # one tile per program, and many tiles with and without prefetch
    ):
        shape = {"layer_first": (L, S, H, D), "page_first": (S, L, H, D), "page_first_direct": (S // PS, L, PS, H, D)}[layout]
        host = torch.randint(1, 100, shape).to(dtype)
        dev = [torch.zeros(20, H, D, dtype=dtype) for _ in range(L)]
        h = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15]); d = torch.tensor([10, 11, 12, 13, 0, 1, 2, 3])
        row = H * D * host.element_size()
        def rows(t, l):
            return t[l][h] if layout == "layer_first" else t[h, l] if layout == "page_first" else t[h // PS, l, h % PS]
        kw = dict(layout=layout, slots=S, layers=L, page_size=PS, row_bytes=row, device_layers=dev, host_idx=h, dev_idx=d,
                  tile_words=tile, prefetch=prefetch)
        kernels.launch_rows(host=host, layer_begin=0, layer_end=L, to_host=False, blocks=3, num_warps=4, **kw)
        for l in range(L):
            assert torch.equal(dev[l][d], rows(host, l)), (dtype, D, layout, tile, prefetch, l)
            mask = torch.ones(20, dtype=torch.bool); mask[d] = False
            assert not dev[l][mask].any()
        back = torch.zeros_like(host)
        kernels.launch_rows(host=back, layer_begin=1, layer_end=2, to_host=True, blocks=2, num_warps=4, **kw)
        assert torch.equal(rows(back, 1), dev[1][d])
        assert int(torch.count_nonzero(back)) == int(torch.count_nonzero(dev[1][d]))
    print("kernel ok")
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the real kernel runs in the CUDA tests on this machine")
def test_triton_kernel_in_interpreter():
    """The kernel backend's address arithmetic for every layout, dtype width and odd row sizes, executed by
    Triton's interpreter on the CPU (CI has no GPU)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kernel ok" in r.stdout


def test_layer_loader_and_backup_on_cpu_pools():
    dp = DeviceKVPool(32, 4, 3, 2, 8, 6, torch.float32, "cpu")
    for t in dp.k_buffer + dp.v_buffer:
        t.copy_(torch.randn_like(t))
    ref = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    hp = host_pool_for(dp, layout="page_first_direct")
    h, d = hp.alloc(16), torch.arange(4, 20)
    assert backup_async(hp, dp, h, d, "direct") is None  # CPU: synchronous
    for t in dp.k_buffer + dp.v_buffer:
        t.zero_()
    loader = LayerLoader(hp, dp, "direct")
    load = loader.load(h, d)
    for layer in range(3):
        load.wait(layer)
        assert torch.equal(dp.k_buffer[layer][d], ref[layer][d])
        assert torch.equal(dp.v_buffer[layer][d], ref[3 + layer][d])
    assert load.done()
    with pytest.raises(ValueError, match="event_sets"):
        LayerLoader(hp, dp, event_sets=0)


def test_validated_indices_are_reused_only_while_unchanged():
    dp = DeviceKVPool(32, 4, 2, 1, 8, 6, torch.float32, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct")
    h, d = hp.alloc(8), torch.arange(4, 12)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    d[0] = 999  # in-place change: the cached validation must not be trusted any more
    with pytest.raises(ValueError, match="out of range"):
        hp.load_to_device_per_layer(dp, h, d, 1, "direct")
    with pytest.raises(kvtier.InvalidArgumentError):
        hp.load_to_device_per_layer(dp, h, d, 1, "direct")
