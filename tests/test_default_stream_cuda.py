"""Direct copies issued from the default stream (a plain script, or an engine whose forward runs there): the
driver's batch API refuses the legacy NULL stream, so the engine runs them on its own stream joined to the
caller's by events. These tests check that they then use batches, and that the stream order the caller
sees is unchanged: work queued before on the default stream is seen by the copies, work queued after
sees their result. Skipped without a GPU."""

import pytest
import torch

import kvtier
from kvtier import DeviceKVPool, host_pool_for

pytestmark = pytest.mark.cuda

PS, L, H, DK, DV = 64, 8, 4, 192, 128


def make(pages=128):
    dp = DeviceKVPool(pages * PS, PS, L, H, DK, DV, torch.bfloat16, "cuda")
    for t in dp.k_buffer + dp.v_buffer:
        t.view(torch.uint8).random_(0, 256)
    return dp, host_pool_for(dp, layout="page_first_direct")


def u8(t):
    return t.contiguous().view(torch.uint8)


def default():
    return torch.cuda.stream(torch.cuda.default_stream())


@pytest.mark.parametrize("thread", [False, True])
def test_backup_from_the_default_stream_sees_earlier_work_and_uses_batches(thread):
    """A fill queued on the default stream behind a long sleep must be what the backup copies."""
    dp, hp = make()
    n = 96
    # CPU indices: CUDA ones are copied to the host first, which would wait for the stream and hide a race
    h, d = hp.alloc(n * PS), torch.arange(PS, (n + 1) * PS)

    def run():
        for it in range(3):
            with default():
                torch.cuda._sleep(20_000_000)  # the fill below lands late: a copy that does not wait reads old bytes
                for t in dp.k_buffer + dp.v_buffer:
                    t.view(torch.uint8).fill_(17 + it)
                hp.backup_from_device_all_layer(dp, h, d, "direct")
            torch.cuda.synchronize()
            for side in (hp.k_buffer, hp.v_buffer):
                assert bool((side[h.view(-1, PS)[:, 0] // PS].view(torch.uint8) == 17 + it).all()), it

    if thread:  # a per-thread default stream is another stream in every thread: its own detour
        import threading

        errs = []

        def target():
            try:
                run()
                errs.append(None)
            except BaseException as e:  # noqa: BLE001 - reported below
                errs.append(e)

        th = threading.Thread(target=target)
        th.start()
        th.join()
        assert errs == [None], errs
    else:
        run()
    if kvtier._native.cuda_batch_supported():
        copies, batch_calls = hp.engine.last_submit
        assert batch_calls > 0 and copies > 0, hp.engine.last_submit


def test_per_layer_load_on_the_default_stream_is_seen_by_later_work():
    """Each layer loaded from the default stream, then read back on the default stream at once: the reads
    must see the loaded bytes (the join orders them after the copies)."""
    dp, hp = make()
    n = 96
    h, d = hp.alloc(n * PS), torch.arange(PS, (n + 1) * PS)
    for side in (hp.k_buffer, hp.v_buffer):
        side.view(torch.uint8).random_(0, 256)
    want_k = [hp.k_buffer[h.view(-1, PS)[:, 0].cpu() // PS][:, layer].clone() for layer in range(L)]
    for it in range(3):
        for t in dp.k_buffer + dp.v_buffer:
            t.zero_()
        got = []
        with default():
            for layer in range(L):
                hp.load_to_device_per_layer(dp, h, d, layer, "direct")
                got.append(dp.k_buffer[layer][d].clone())  # queued right behind the load, same stream
        torch.cuda.synchronize()
        for layer in range(L):
            assert torch.equal(u8(got[layer].cpu()), u8(want_k[layer].reshape(got[layer].shape))), (it, layer)
    if kvtier._native.cuda_batch_supported():
        assert hp.engine.last_submit[1] > 0, hp.engine.last_submit


def test_warm_per_layer_loads_on_the_default_stream_wait_for_earlier_work(monkeypatch):
    """Repeated per-layer loads of one index set from the default stream (one native call each: fork to the
    detour, copies, join, mark) run after the work queued before them: a read of the destination queued
    behind a long sleep still sees the old bytes; a read queued after sees the new ones."""
    calls = []
    real = kvtier._native.submit_layers_detour

    def counted(*args):
        calls.append(args[2] - args[1])
        return real(*args)

    monkeypatch.setattr(kvtier._native, "submit_layers_detour", counted)
    dp, hp = make()
    n = 96
    h, d = hp.alloc(n * PS), torch.arange(PS, (n + 1) * PS)
    for side in (hp.k_buffer, hp.v_buffer):
        side.view(torch.uint8).random_(0, 256)
    want_k = [hp.k_buffer[h.view(-1, PS)[:, 0].cpu() // PS][:, layer].clone() for layer in range(L)]
    for it in range(3):
        for t in dp.k_buffer + dp.v_buffer:
            t.zero_()
        before, after = [], []
        with default():
            for layer in range(L):
                torch.cuda._sleep(2_000_000)  # the read below runs late: copies that do not wait overwrite first
                before.append(dp.k_buffer[layer][d].clone())
                hp.load_to_device_per_layer(dp, h, d, layer, "direct")
                after.append(dp.k_buffer[layer][d].clone())
        torch.cuda.synchronize()
        for layer in range(L):
            assert not u8(before[layer]).any(), (it, layer)
            assert torch.equal(u8(after[layer].cpu()), u8(want_k[layer].reshape(after[layer].shape))), (it, layer)
    if kvtier._native.cuda_batch_supported():
        assert len(calls) >= 2 * L and set(calls) == {1}, calls  # the warm loads took the one-call detour
