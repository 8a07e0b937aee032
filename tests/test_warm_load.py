"""The per-layer load's warm path (kvtier.transfer.indices.WarmLoad): a repeated call reuses the previous call's checks only
while every object it checked is unchanged. Each test changes one thing between two per-layer calls and
checks that the second call sees it (new data lands where the new arguments say, or a clear error)."""

import pytest
import torch

import kvtier
from kvtier._errors import ClosedError, InvalidArgumentError

PS = 4


def pools():
    dp = kvtier.DeviceKVPool(16 * PS, PS, 3, 2, 8, 4, torch.bfloat16, "cpu")
    hp = kvtier.host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=2.0)
    return dp, hp


def fill(hp, h):
    for layer in range(hp.layer_num):
        for buf in (hp.k_buffer, hp.v_buffer):
            pages = h[::PS] // PS
            buf[pages, layer] = torch.randn(buf[pages, layer].shape).to(buf.dtype)


def expect(hp, dp, h, d, layer):
    for side, dev in ((hp.k_buffer, dp.k_buffer), (hp.v_buffer, dp.v_buffer)):
        want = side[h[::PS] // PS, layer].reshape(-1, *side.shape[-2:])
        got = dev[layer][d].reshape(want.shape)
        assert torch.equal(got, want)


def test_repeated_layers_land_exactly():
    dp, hp = pools()
    h, d = hp.alloc(2 * PS), torch.arange(PS, 3 * PS)
    fill(hp, h)
    for layer in range(hp.layer_num):
        hp.load_to_device_per_layer(dp, h, d, layer, "direct")
        expect(hp, dp, h, d, layer)
    assert hp._warm is not None and hp._warm.host is h


def test_replaced_layer_tensor_is_seen():
    dp, hp = pools()
    h, d = hp.alloc(2 * PS), torch.arange(PS, 3 * PS)
    fill(hp, h)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    new = torch.zeros_like(dp.k_buffer[1])
    dp.k_buffer[1] = new  # same list, new tensor for layer 1
    hp.load_to_device_per_layer(dp, h, d, 1, "direct")
    assert dp.k_buffer[1] is new
    expect(hp, dp, h, d, 1)
    bad = torch.zeros(dp.k_buffer[2].shape[0], 2, 5, dtype=torch.bfloat16)
    dp.k_buffer[2] = bad  # a wrong shape must be refused, not copied into
    with pytest.raises(InvalidArgumentError, match="k_buffer"):
        hp.load_to_device_per_layer(dp, h, d, 2, "direct")


def test_indices_rewritten_in_place_are_seen():
    dp, hp = pools()
    h, d = hp.alloc(2 * PS), torch.arange(PS, 3 * PS)
    fill(hp, h)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    d.numpy()[:] = torch.arange(8 * PS, 10 * PS).numpy()  # no version bump: the contents check sees it
    hp.load_to_device_per_layer(dp, h, d, 1, "direct")
    expect(hp, dp, h, d, 1)
    d.numpy()[0] = 10**6  # out of range: refused, not copied
    with pytest.raises(InvalidArgumentError):
        hp.load_to_device_per_layer(dp, h, d, 2, "direct")


def test_bad_layer_and_closed_pool_after_warm_call():
    dp, hp = pools()
    h, d = hp.alloc(PS), torch.arange(PS)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    for bad in (-1, 3, True, 1.0):
        with pytest.raises(InvalidArgumentError, match="layer_id"):
            hp.load_to_device_per_layer(dp, h, d, bad, "direct")
    hp.close()
    with pytest.raises(ClosedError):
        hp.load_to_device_per_layer(dp, h, d, 1, "direct")


def test_other_device_pool_or_backend_takes_the_full_path():
    dp, hp = pools()
    h, d = hp.alloc(PS), torch.arange(PS)
    fill(hp, h)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    other = kvtier.DeviceKVPool(16 * PS, PS, 3, 2, 8, 8, torch.bfloat16, "cpu")  # V dim differs
    with pytest.raises(InvalidArgumentError, match="v_head_dim"):
        hp.load_to_device_per_layer(other, h, d, 1, "direct")
    with pytest.raises(InvalidArgumentError):
        hp.load_to_device_per_layer(dp, h, d, 1, "kernel")  # page_first_direct is not a kernel layout


def test_index_tensor_given_new_storage_is_seen():
    """`t.data = other` changes neither the object nor its version: the address and length checks see it."""
    dp, hp = pools()
    h, d = hp.alloc(2 * PS), torch.arange(PS, 3 * PS)
    fill(hp, h)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    d.data = torch.arange(6 * PS, 7 * PS)  # shorter, elsewhere
    with pytest.raises(InvalidArgumentError):  # one device page for two host pages: refused
        hp.load_to_device_per_layer(dp, h, d, 1, "direct")
    d.data = torch.arange(10 * PS, 12 * PS)
    hp.load_to_device_per_layer(dp, h, d, 1, "direct")
    expect(hp, dp, h, d, 1)


def test_layer_tensor_changed_in_place_is_checked_again():
    """`set_` keeps a tensor's object and address: the shape in the cache keys makes the pool check it again
    instead of copying past the smaller tensor (review finding)."""
    dp, hp = pools()
    h, d = hp.alloc(2 * PS), torch.arange(12 * PS, 14 * PS)
    fill(hp, h)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    t = dp.k_buffer[1]
    t.set_(t.untyped_storage(), 0, (5 * PS, 2, 8))  # same object, same address, fewer rows
    with pytest.raises(InvalidArgumentError, match="k_buffer"):
        hp._check_device_pool(dp)
    with pytest.raises(InvalidArgumentError, match="k_buffer"):
        hp.load_to_device_per_layer(dp, h, d, 1, "direct")
    with pytest.raises(InvalidArgumentError, match="k_buffer"):
        hp.backup_from_device_all_layer(dp, h, d, "direct")


def test_cached_indices_are_validated_for_a_route_that_needs_it(monkeypatch):
    """Indices cached by a planned call whose planning failed must not reach a route that trusts them."""
    dp, hp = pools()
    h = hp.alloc(PS)
    bad = torch.arange(10**6, 10**6 + PS)
    with pytest.raises(InvalidArgumentError):
        hp.backup_from_device_all_layer(dp, h, bad, "direct")  # CPU pool: the planner refuses it
    monkeypatch.setattr(hp.engine, "route", lambda *a, **k: "kernel")  # as a CUDA pool's small chunks
    with pytest.raises(InvalidArgumentError, match="device_indices"):
        hp.prepare(dp, h, bad, "direct", True)


def test_concurrent_transfers_share_the_index_cache():
    import threading

    dp, hp = pools()
    pairs = [(hp.alloc(PS), torch.arange(i * PS, (i + 1) * PS)) for i in range(1, 8)]
    errors = []

    def work(seed):
        try:
            for i in range(1500):  # more index sets than the cache keeps: threads evict each other's entries
                h, d = pairs[(seed * 7 + i * (seed + 1)) % len(pairs)]
                hp.backup_from_device_all_layer(dp, h, d, "direct")
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


@pytest.mark.parametrize("size", [0, 64])
def test_device_storage_shrunk_in_place_is_refused(size):
    """A storage resized in place (untyped_storage().resize_, as memory savers do) keeps its tensor's shape:
    neither a cold call, nor a warm one after it, nor a cached plan may copy past the storage's end
    (independent review finding; it segfaulted before)."""
    dp, hp = pools()
    h, d = hp.alloc(2 * PS), torch.arange(12 * PS, 14 * PS)  # the last rows of each layer
    fill(hp, h)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")  # warm for layer 1, plans cached
    hp.backup_from_device_all_layer(dp, h, d, "direct")
    dp.k_buffer[1].untyped_storage().resize_(size)
    for call in (lambda: hp.load_to_device_per_layer(dp, h, d, 1, "direct"),  # warm before: its layer changed
                 lambda: hp.backup_from_device_all_layer(dp, h, d, "direct"),  # cached index set and plans
                 lambda: hp.load_to_device_per_layer(dp, h.clone(), d.clone(), 1, "direct")):  # cold
        with pytest.raises(InvalidArgumentError, match=r"k_buffer\[1\].*storage"):
            call()
    # a layer whose memory is intact may still be loaded: its copies touch only that layer
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    expect(hp, dp, h, d, 0)


def test_plan_cache_of_one_index_set_is_bounded():
    """One index set used with ever new device tensors keeps the latest plans only (review finding)."""
    dps = [kvtier.DeviceKVPool(16 * PS, PS, 3, 2, 8, 4, torch.bfloat16, "cpu") for _ in range(2)]
    hp = kvtier.host_pool_for(dps[0], layout="page_first_direct", host_to_device_ratio=2.0)
    h, d = hp.alloc(PS), torch.arange(PS)
    for i in range(40):
        hp.backup_from_device_all_layer(dps[i % 2], h, d, "direct")
    (_, p), = hp._prepared.values()
    assert 0 < len(p.plans) <= 8


def test_empty_layer_range_per_layer_is_a_no_op():
    dp, hp = pools()
    h, d = hp.alloc(PS), torch.arange(PS)
    pairs, p, route = hp.prepare(dp, h, d, "direct", False, True)
    before = [t.clone() for t in dp.k_buffer]
    assert hp.engine.copy(pairs, p, 1, 1, to_host=False, per_layer=True, route=route) is None
    assert all(torch.equal(a, b) for a, b in zip(before, dp.k_buffer))


@pytest.mark.parametrize("op", ["load_per_layer", "backup_all", "backup_per_layer"])
def test_index_tensors_made_under_inference_mode(op):
    """Index tensors made under ``torch.inference_mode()`` (engines run their loop in it) have no version
    counter: they are accepted (a RuntimeError from torch before), and an in-place rewrite of one between
    two per-layer calls is still seen (CPU tensors are recognised by their contents)."""
    dp, hp = pools()
    with torch.inference_mode():
        h, d = hp.alloc(2 * PS), torch.arange(PS, 3 * PS)
    assert h.is_inference() and d.is_inference()
    fill(hp, h)
    if op == "load_per_layer":
        for layer in range(hp.layer_num):
            hp.load_to_device_per_layer(dp, h, d, layer, "direct")
            expect(hp, dp, h, d, layer)
        with torch.inference_mode():
            d.copy_(torch.arange(8 * PS, 10 * PS))  # torch counts no write of an inference tensor
        for layer in range(hp.layer_num):
            hp.load_to_device_per_layer(dp, h, d, layer, "direct")
            expect(hp, dp, h, d, layer)
    else:
        for t in dp.k_buffer + dp.v_buffer:
            t.copy_(torch.randn(t.shape).to(t.dtype))
        if op == "backup_all":
            hp.backup_from_device_all_layer(dp, h, d, "direct")
        else:
            for layer in range(hp.layer_num):
                hp.backup_from_device_per_layer(dp, h, d, layer, "direct")
        for layer in range(hp.layer_num):
            expect(hp, dp, h, d, layer)


@pytest.mark.parametrize("setting", ["blocks", "num_warps", "tile_words", "prefetch", "lanes", "kernel_below",
                                     "set_native"])
def test_changed_engine_setting_takes_the_full_path(setting):
    """A warm load keeps the launches and the route its first call made: after a setting they are made from
    changes, the next call makes them again. (Review finding: the kernel block sweep of the transfer bench
    measured its first setting's launches for every setting, 37.6 % flat from 4 to 32 blocks.) A new pool,
    whose engine starts from the defaults, changes nothing for this one."""
    from kvtier.transfer import kernels

    dp, hp = pools()
    h, d = hp.alloc(2 * PS), torch.arange(PS, 3 * PS)
    fill(hp, h)
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    w = hp._warm
    kvtier.host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=2.0).close()
    hp.load_to_device_per_layer(dp, h, d, 1, "direct")
    assert hp._warm is w, "the warm load was not reused"
    if setting == "set_native":
        kernels.set_native(True)  # the same value: still a setting made, launches are made again
    else:
        setattr(hp.engine, setting, getattr(hp.engine, setting))
    hp.load_to_device_per_layer(dp, h, d, 2, "direct")
    assert hp._warm is not w, f"{setting} changed and the warm load was reused"
    expect(hp, dp, h, d, 2)
    w = hp._warm
    hp.load_to_device_per_layer(dp, h, d, 0, "direct")
    assert hp._warm is w
    expect(hp, dp, h, d, 0)


def test_engine_refuses_a_warm_kernel_layer_outside_its_launches():
    """The native launch cannot check a kernel's layer against its offset table and host layout: the engine's
    warm kernel load refuses one outside the launches' layers before anything reaches the device, whoever
    calls it (the pool's warm path checks it against the pool's layers first)."""
    from types import SimpleNamespace

    from kvtier.transfer import TransferEngine, kernels

    warm = kernels.WarmLaunches([], 1, [SimpleNamespace(layers=3), SimpleNamespace(layers=4)])
    assert warm.layers == 3
    pairs = ((None, [torch.zeros(1)]),)
    for layer in (-1, 3, 4):
        with pytest.raises(InvalidArgumentError, match="layer"):
            TransferEngine().load_layer(pairs, None, layer, "kernel", "kernel", warm, ())
