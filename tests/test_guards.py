"""Guards in front of raw-pointer paths, found by the memory-safety audit (docs/SAFETY.md): what reaches the
copy engine or a kernel must be exactly what was validated, and the kernel's launch description refuses
tensors and layer ranges it would address wrongly. CPU tests: the checks run before anything is launched."""

import numpy as np
import pytest
import torch

import kvtier
from kvtier import DeviceKVPool, host_pool_for
from kvtier.transfer import kernels


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
    _, prepared, _ = hp.prepare(dp, h, d, "direct", to_host=False)
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


def transfer_plan(hp, layers):
    side = hp._k_side
    return kvtier._native.TransferPlan(False, side.buffer._region, side.offset, side.layout, side.slots, side.page_size,
                                       side.row_bytes, layers, np.arange(4), np.arange(2, 6), 0, len(layers), True,
                                       True, side.split)


def test_transfer_plan_refuses_memory_it_cannot_trust():
    dp, hp = pools()
    base = torch.zeros(2, 2, 4, dtype=torch.float16)
    expanded = base[:1].expand(18, 2, 4)  # reports 18 rows of bytes over 1 row of memory
    with pytest.raises(kvtier.InvalidArgumentError, match="contiguous"):
        transfer_plan(hp, [expanded] * 3)
    alias = hp.k_buffer.view(torch.uint8).reshape(-1)[: 18 * 16].view(torch.float16).view(18, 2, 4)
    with pytest.raises(kvtier.InvalidArgumentError, match="overlaps the host buffer"):
        transfer_plan(hp, [alias] * 3)
    with pytest.raises(kvtier.InvalidArgumentError, match="contiguous CPU or CUDA"):
        transfer_plan(hp, [t.to("meta") for t in dp.k_buffer])
    plan = transfer_plan(hp, list(dp.k_buffer))
    with pytest.raises(kvtier.InvalidArgumentError, match="CPU tensors"):
        kvtier._native.submit_layers([plan], 0, 1, 0, 1, [], True, False, [])
    shrunk = [t.clone() for t in dp.k_buffer]
    shrunk[2].untyped_storage().resize_(16)  # the shape stays: its nbytes would span freed memory
    with pytest.raises(kvtier.InvalidArgumentError, match=r"\[2\] spans .* storage"):
        transfer_plan(hp, shrunk)


def test_a_put_never_captures_a_page_a_concurrent_get_is_writing(tmp_path):
    # one thread reads object "a" (all 1s) and "b" (all 2s) into host page 0 over and over; another stores
    # page 0 under new keys meanwhile. The binding serializes batches whose host ranges overlap, so every
    # stored copy must be one whole object, never half of each.
    import threading

    from kvtier import PageStore

    dp = DeviceKVPool(64, 16, 2, 2, 192, 128, torch.bfloat16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    st = PageStore(tmp_path, direct=False)
    st.register_mem_pool_host(hp)
    page0, page1 = torch.arange(16), torch.arange(16, 32)
    for fill, key in ((1, "a"), (2, "b")):
        hp.k_buffer.view(torch.uint8)[0].fill_(fill)
        hp.v_buffer.view(torch.uint8)[0].fill_(fill)
        assert st.batch_set_v1([key], page0) == [True]
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            for key in ("a", "b"):
                assert st.batch_get_v1([key], page0) == [True]

    t = threading.Thread(target=reader)
    t.start()
    try:
        stored = [k for k in (f"c{i}" for i in range(200)) if st.batch_set_v1([k], page0) == [True]]
    finally:
        stop.set()
        t.join()
    mixed = []
    for k in stored:
        assert st.batch_get_v1([k], page1) == [True]
        for t_ in (hp.k_buffer, hp.v_buffer):
            vals = torch.unique(t_.view(torch.uint8)[1]).tolist()
            if vals not in ([1], [2]):
                mixed.append((k, vals))
    st.close()
    assert len(stored) == 200 and not mixed, mixed[:3]


def vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@pytest.mark.parametrize("offset,nbytes", [(0, (8 << 20) + 1), (8 << 20, 1), (-1, 1), (0, -1), (1 << 62, 1 << 62)])
def test_dlpack_export_is_bounded_by_the_region(offset, nbytes):
    b = kvtier.HostBuffer(8 << 20, huge_pages="off")
    with pytest.raises(kvtier.InvalidArgumentError, match="do not fit"):
        b._region.dlpack(offset, nbytes)
    b.close()


def test_dlpack_capsules_keep_the_memory_until_dropped_consumed_or_not():
    from torch.utils.dlpack import from_dlpack

    n = 256 << 20
    before = vm_size()
    b = kvtier.HostBuffer(n, huge_pages="off", prefault_threads=0)
    unconsumed = b._region.dlpack(0, n)
    view = from_dlpack(b._region.dlpack(4096, 4096))
    b.close()  # the buffer is closed, but the capsule and the view still own the mapping
    assert vm_size() >= before + n
    view.fill_(7)
    assert int(view.sum()) == 7 * 4096
    del view
    assert vm_size() >= before + n  # the unconsumed capsule still holds it
    del unconsumed  # its destructor releases the last reference
    assert vm_size() < before + n // 2


def test_a_device_pool_with_layers_version_is_checked_again_only_when_it_changes():
    """A device pool that declares ``layers_version`` is trusted while the number holds (kvtier's own layer
    windows); a new number means new tensors, checked in full before a byte moves."""
    dp, hp = pools()
    dp.layers_version = 1
    h, d = torch.arange(4), torch.arange(2, 6)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    got = hp._check_device_pool(dp)
    assert hp._check_device_pool(dp) is got  # cached: nothing re-read
    dp.k_buffer = [torch.zeros(16, 2, 5, dtype=torch.float16) for _ in range(3)]  # a wrong head dim
    dp.layers_version = 2
    before = [t.clone() for t in dp.k_buffer + dp.v_buffer]
    with pytest.raises(kvtier.InvalidArgumentError, match="head_dim|k_buffer"):
        hp.load_to_device_per_layer(dp, h, d, 1, "direct")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, dp.k_buffer + dp.v_buffer))


def test_the_transformers_window_bumps_its_layers_version_when_it_reallocates():
    from kvtier.integrations.transformers.window import DeviceWindow

    w = DeviceWindow(4, 2, 2, 8, 8, torch.float32, torch.device("cpu"), 16, 16)
    v = w.layers_version
    assert not w.ensure(w.size)  # room already: same tensors, same number
    assert w.layers_version == v
    assert w.ensure(w.size + 1)
    assert w.layers_version == v + 1 and w.k_buffer[0] is w.k_slots[0]
