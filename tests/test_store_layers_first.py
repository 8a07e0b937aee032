"""PageStore.batch_get_layers_first and TierController.read_into(first_layers=...): pages read in two passes (a
split restore's first layers reach the GPU while the rest is read). Bit-exact like batch_get_v1, the gate open
on every path (a gate left shut would hold a CUDA stream forever), damage in either half a miss, bad arguments
refused before a byte moves, a sealed store in one pass."""

import pytest
import torch

from kvtier import DeviceKVPool, InvalidArgumentError, PageStore, _native
from kvtier.controller import TierController
from kvtier.tenants import Keyring
from store_pools import PS, make_pool, page_bytes, pages_idx

LAYERS = 4


def stored(tmp_path, **kw):
    hp = make_pool(layers=LAYERS)
    keys = [f"{i:064x}" for i in range(5)]
    want = [page_bytes(hp, p) for p in range(5)]
    st = PageStore(tmp_path, capacity_bytes=1 << 30, model_name="layers-first", **kw)
    st.register_mem_pool_host(hp)
    assert st.batch_set_v1(keys, pages_idx(range(5))) == [True] * 5
    return hp, st, keys, want


@pytest.mark.parametrize("first", [1, 2, 3])
def test_two_passes_read_the_same_bytes_and_open_the_gate(tmp_path, first):
    hp, st, keys, want = stored(tmp_path)
    with st:
        gate = _native.HostGate()
        assert st.batch_get_layers_first(keys[::-1], pages_idx(range(10, 15)), LAYERS, first, gate) == [True] * 5
        assert gate.is_open
        for i, p in enumerate(range(10, 15)):
            k, v = page_bytes(hp, p)
            assert torch.equal(k, want[4 - i][0]) and torch.equal(v, want[4 - i][1])
        assert st.get_stats()["corrupt_reads"] == 0


@pytest.mark.parametrize("where", ["first layer", "last layer"])
def test_damage_in_either_half_is_a_miss(tmp_path, where):
    hp, st, keys, _ = stored(tmp_path)
    with st:
        k_len = page_bytes(hp, 0)[0].numel()
        at = 10 if where == "first layer" else k_len - 10
        for f in tmp_path.glob(f"*/class-{k_len}.dat"):
            with open(f, "r+b") as fh:  # every K object (its size class's file), at the same offset
                size = fh.seek(0, 2)
                for slot in range(size // k_len):
                    fh.seek(slot * k_len + at)
                    fh.write(b"\xa5" * 4)
        gate = _native.HostGate()
        ok = st.batch_get_layers_first(keys, pages_idx(range(10, 15)), LAYERS, 2, gate)
        assert gate.is_open and ok == [False] * 5, ok
        assert st.get_stats()["corrupt_reads"] >= 5


def test_bad_arguments_are_refused_and_still_open_the_gate(tmp_path):
    hp, st, keys, _ = stored(tmp_path)
    with st:
        before = [page_bytes(hp, p) for p in range(10, 15)]
        for layers, first in ((LAYERS, 0), (LAYERS, LAYERS), (0, 1)):
            gate = _native.HostGate()
            with pytest.raises(InvalidArgumentError, match="first_layers"):
                st.batch_get_layers_first(keys, pages_idx(range(10, 15)), layers, first, gate)
            assert gate.is_open
        gate = _native.HostGate()
        with pytest.raises(InvalidArgumentError, match="host_indices"):
            st.batch_get_layers_first(keys, pages_idx(range(14, 19)), LAYERS, 1, gate)  # past the pool
        assert gate.is_open
        after = [page_bytes(hp, p) for p in range(10, 15)]
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after))
        # a layer count other than the pool's: one pass (there is no layer boundary to open the gate at)
        gate = _native.HostGate()
        assert st.batch_get_layers_first(keys, pages_idx(range(10, 15)), 7, 3, gate) == [True] * 5
        assert gate.is_open


def test_a_sealed_store_reads_in_one_pass(tmp_path):
    hp, st, keys, want = stored(tmp_path / "s", keyring=Keyring.init(tmp_path / "keys"))
    with st:
        gate = _native.HostGate()
        assert st.batch_get_layers_first(keys, pages_idx(range(10, 15)), LAYERS, 2, gate) == [True] * 5
        assert gate.is_open
        k, v = page_bytes(hp, 10)
        assert torch.equal(k, want[0][0]) and torch.equal(v, want[0][1])


def test_read_into_with_first_layers_opens_the_gate_and_reads_exactly(tmp_path):
    hp, st, keys, want = stored(tmp_path)
    with st:
        ctrl = TierController(DeviceKVPool(16 * PS, PS, LAYERS, 2, 192, 128, torch.bfloat16, "cpu"), hp, st)
        starts = ctrl.allocate(5)
        gate = _native.HostGate()
        assert ctrl.read_into(keys, starts, first_layers=2, gate=gate).result() == 5 and gate.is_open
        for i, s in enumerate(starts):
            k, v = page_bytes(hp, s // hp.page_size)
            assert torch.equal(k, want[i][0]) and torch.equal(v, want[i][1])
        # a read that raises (a key the store cannot hold) still opens it: the future's result is 0 pages
        gate = _native.HostGate()
        assert ctrl.read_into(["../bad"] * 5, starts, first_layers=2, gate=gate).result() == 0 and gate.is_open
        ctrl.free(starts)


def test_a_pool_not_laid_out_by_layer_reads_in_one_pass(tmp_path):
    """A ``page_first`` pool keeps a page's tokens first: half its bytes are half the tokens of every layer, not
    the first layers, so it must not open the gate half-way (it reads in one pass, then opens it)."""
    hp = make_pool("page_first", layers=LAYERS)
    keys = [f"{i:064x}" for i in range(3)]
    want = [page_bytes(hp, p) for p in range(3)]
    with PageStore(tmp_path, capacity_bytes=1 << 30, model_name="layers-first-pf") as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(keys, pages_idx(range(3))) == [True] * 3
        seen = []
        real = st._batch
        st._batch = lambda *a: (seen.append(len(a)), real(*a))[1]  # (which path: 3 args one pass, 4 two)
        gate = _native.HostGate()
        assert st.batch_get_layers_first(keys, pages_idx(range(5, 8)), LAYERS, 2, gate) == [True] * 3
        assert gate.is_open and seen == [3]
        k, v = page_bytes(hp, 5)
        assert torch.equal(k, want[0][0]) and torch.equal(v, want[0][1])
