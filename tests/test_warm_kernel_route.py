"""Which calls of the kernel route's warm per-layer load (``TransferEngine.load_layer`` with
``kernels.WarmLaunches``) take the one-native-call path, checked without a GPU: the stream handle, the
device and the native launch are stubs, so each test sees the decision and not the copy (the bytes are
checked on a GPU by tests/test_route_cuda.py).

The short path skips the wait for the index upload and the Python mark: it is right only on a stream whose
mark this index set's previous load recorded, after a full call there made the stream wait for the upload."""

from types import SimpleNamespace

import pytest
import torch

from kvtier.transfer import TransferEngine, engine as engine_mod, kernels


class Prepared:
    """Counts the waits for the index upload a call makes (``Prepared.gpu``)."""

    def __init__(self):
        self.waits = 0

    def gpu(self, dev):
        self.waits += 1


@pytest.fixture
def rig(monkeypatch):
    eng = TransferEngine()
    state = SimpleNamespace(handle=7, device=0, calls=[], copies=[])
    monkeypatch.setattr(engine_mod, "raw_stream", lambda index: state.handle)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state.device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: SimpleNamespace(cuda_stream=state.handle))
    monkeypatch.setattr(engine_mod._native, "launch_layers", lambda *a: state.calls.append(a))
    monkeypatch.setattr(eng.streams, "side_streams",
                        lambda dev, want: [SimpleNamespace(cuda_stream=1000 + state.handle + i) for i in range(want)])

    def mark(index, handle, stream, refs):  # InFlight.mark's bookkeeping, with a stub event
        eng.inflight.marks[(index, handle)] = [None, refs, 5000 + handle]

    monkeypatch.setattr(eng.inflight, "mark", mark)
    monkeypatch.setattr(eng, "copy", lambda *a, **k: state.copies.append((a, k)))
    # a stand-in for a device tensor: load_layer reads only its device
    state.pairs = ((None, [SimpleNamespace(device=torch.device("cuda", 0))]),)
    return eng, state


def warm_set(layers=4):
    """One index set's warm launches and the refs every load of it passes."""
    warm = kernels.WarmLaunches([("launch", 0)], 2, [SimpleNamespace(layers=layers)])
    return warm, Prepared(), (("region",), warm)


def load(eng, state, ws, layer=1):
    warm, prepared, refs = ws
    eng.load_layer(state.pairs, prepared, layer, "kernel", "kernel", warm, refs)


def test_second_load_on_a_stream_is_one_call_that_re_records_the_mark(rig):
    eng, state = rig
    ws = warm_set()
    load(eng, state, ws, 1)
    assert ws[1].waits == 1 and len(state.calls[-1]) == 7  # full call: upload waited for, mark from Python
    load(eng, state, ws, 2)
    assert ws[1].waits == 1
    assert state.calls[-1] == (0, 7, [1007], ws[0].natives, 2, 3, [], 5007)


def test_another_stream_takes_the_full_call_first(rig):
    eng, state = rig
    ws = warm_set()
    load(eng, state, ws)
    load(eng, state, ws)
    state.handle = 9  # the caller moved to another stream: it has not waited for the index upload
    load(eng, state, ws)
    assert ws[1].waits == 2 and len(state.calls[-1]) == 7 and state.calls[-1][2] == [1009]
    load(eng, state, ws)
    assert ws[1].waits == 2 and state.calls[-1][-1] == 5009
    state.handle = 7  # back: its mark is still this index set's
    load(eng, state, ws)
    assert ws[1].waits == 2 and state.calls[-1][-1] == 5007


def test_another_index_set_between_two_loads_takes_the_full_call(rig):
    eng, state = rig
    a, b = warm_set(), warm_set()
    load(eng, state, a)
    load(eng, state, b)  # b's own first call on this stream
    assert b[1].waits == 1
    load(eng, state, a)  # the stream's mark is b's now: a's refs must be marked again
    assert a[1].waits == 2 and len(state.calls[-1]) == 7
    load(eng, state, a)
    assert a[1].waits == 2 and state.calls[-1][-1] == 5007


def test_another_current_device_takes_the_copy_path(rig):
    eng, state = rig
    ws = warm_set()
    load(eng, state, ws)
    state.device = 1  # the pool's device is not the current one: copy switches to it
    load(eng, state, ws)
    assert len(state.calls) == 1 and len(state.copies) == 1


def test_side_streams_per_caller_stream_are_bounded(rig):
    eng, state = rig
    ws = warm_set()
    for handle in range(20, 40):
        state.handle = handle
        load(eng, state, ws)
    assert 0 < len(ws[0].sides) <= 8 and 39 in ws[0].sides
