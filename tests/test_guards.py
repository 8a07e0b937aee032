"""Guards in front of raw-pointer paths, found by the memory-safety audit (docs/SAFETY.md): what reaches the
copy engine or a kernel must be exactly what was validated, and the kernel's launch description refuses
tensors and layer ranges it would address wrongly. CPU tests: the checks run before anything is launched."""

import numpy as np
import pytest
import torch

import kvtier
from kvtier import DeviceKVPool, host_pool_for, kernels


def pools(layout="page_first_direct"):
    dp = DeviceKVPool(16, 2, 3, 2, 4, 6, torch.float16, "cpu")
    for t in dp.k_buffer + dp.v_buffer:
        t.view(torch.uint8).random_(0, 256)
    return dp, host_pool_for(dp, layout=layout)


def test_indices_changed_behind_torchs_back_are_validated_again():
    dp, hp = pools()
    h, d = torch.arange(4), torch.arange(2, 6)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")  # validated and cached
    v = h._version
    h.numpy()[0] = 10**9  # a write torch does not see: the version stays the same
    assert h._version == v
    before = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    with pytest.raises(kvtier.InvalidArgumentError, match="host_indices"):
        hp.load_to_device_per_layer(dp, h, d, 1, "direct")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, dp.k_buffer + dp.v_buffer))


def test_validated_indices_are_a_private_copy():
    dp, hp = pools()
    h, d = torch.arange(4), torch.arange(2, 6)
    _, _, prepared = hp._prepare(dp, h, d, "direct", to_host=False)
    h.numpy()[:] = 7
    assert prepared.host.tolist() == [0, 1, 2, 3]


def rows_kwargs(dp, hp, **over):
    kw = dict(host=hp.k_buffer, layout=hp.layout, slots=hp.size, layers=hp.layer_num, page_size=hp.page_size,
              row_bytes=hp.head_num * hp.head_dim * 2, device_layers=list(dp.k_buffer),
              host_idx=torch.arange(4), dev_idx=torch.arange(2, 6), to_host=False, blocks=4, num_warps=4)
    kw.update(over)
    return kw


def test_kernel_launch_description_refuses_non_contiguous_tensors():
    dp, hp = pools("page_first")
    layers = list(dp.k_buffer)
    layers[1] = torch.empty(2 * layers[1].shape[0], *layers[1].shape[1:], dtype=layers[1].dtype)[::2]
    assert not layers[1].is_contiguous()
    with pytest.raises(kvtier.InvalidArgumentError, match=r"device_layers\[1\]"):
        kernels.prepare_rows(**rows_kwargs(dp, hp, device_layers=layers))
    with pytest.raises(kvtier.InvalidArgumentError, match="host"):
        kernels.prepare_rows(**rows_kwargs(dp, hp, host=hp.k_buffer.transpose(0, 1)))


def test_kernel_launch_description_refuses_a_host_too_small_or_a_layer_count_mismatch():
    dp, hp = pools("page_first")
    with pytest.raises(kvtier.InvalidArgumentError, match="host"):
        kernels.prepare_rows(**rows_kwargs(dp, hp, host=hp.k_buffer[: hp.size // 2]))
    with pytest.raises(kvtier.InvalidArgumentError, match="device_layers"):
        kernels.prepare_rows(**rows_kwargs(dp, hp, device_layers=list(dp.k_buffer)[:2]))


@pytest.mark.parametrize("begin,end", [(0, 4), (3, 4), (-1, 1)])
def test_kernel_layer_range_must_lie_within_the_transfer(begin, end):
    dp, hp = pools("page_first")
    launch = kernels.prepare_rows(**rows_kwargs(dp, hp))
    with pytest.raises(kvtier.InvalidArgumentError, match="layer_end"):
        kernels.run_rows([launch], begin, end, per_layer=False)
