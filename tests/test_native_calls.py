"""Page batches and staging copies made off the main thread run on a native thread and are waited for in
CPython's frames (kvtier.native_calls): the same answers, bytes and errors as on the main thread."""

import os
import threading

import numpy as np
import pytest
import torch

from kvtier import PageStore, native_calls
from kvtier._errors import InvalidArgumentError
from store_pools import PS, make_pool, page_bytes, pages_idx


def on_a_thread(f):
    box = {}

    def run():
        try:
            box["v"] = f()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            box["e"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive()
    if "e" in box:
        raise box["e"]
    return box["v"]


def test_a_page_batch_off_the_main_thread_answers_as_on_it(tmp_path):
    hp = make_pool()
    with PageStore(tmp_path, model_name="m") as st:
        st.register_mem_pool_host(hp)
        keys = [f"k{i}" for i in range(4)]
        want = [page_bytes(hp, p) for p in range(4)]
        assert on_a_thread(lambda: st.batch_set_v1(keys, pages_idx(range(4)))) == [True] * 4
        assert on_a_thread(lambda: st.batch_get_v1(keys + ["missing"], pages_idx(range(8, 13)))) == [True] * 4 + [False]
        for p in range(4):
            got = page_bytes(hp, 8 + p)
            assert torch.equal(got[0], want[p][0]) and torch.equal(got[1], want[p][1])
        assert st.batch_get_v1(keys, pages_idx(range(4, 8))) == [True] * 4  # (the main thread's own path)
        bad = torch.tensor([10_000 + i for i in range(PS)], dtype=torch.int64)
        with pytest.raises(InvalidArgumentError, match="host_indices"):
            on_a_thread(lambda: st.batch_get_v1(keys[:1], bad))
        with pytest.raises(InvalidArgumentError, match="host_indices"):
            st.batch_get_v1(keys[:1], bad)


def test_a_pending_call_answers_once_and_only_when_it_has_returned(tmp_path):
    hp = make_pool()
    with PageStore(tmp_path, model_name="m") as st:
        st.register_mem_pool_host(hp)
        native = st.native_store()
        keys = ["a", "b"]
        p = native.submit_pages(True, keys, np.arange(2 * PS, dtype=np.int64))
        assert os.read(p.fileno(), 8) == (1).to_bytes(8, "little") and p.done()
        assert p.result() == [True, True]
        with pytest.raises(InvalidArgumentError, match="result"):
            p.result()  # (once)
        with pytest.raises(InvalidArgumentError, match="first_layers"):
            native.submit_pages(True, keys, np.arange(2 * PS, dtype=np.int64), 3, 1)  # a write is one pass
        with pytest.raises(InvalidArgumentError, match="host_indices"):
            native.submit_pages(False, keys, np.zeros((2, PS), dtype=np.int64))  # refused before it starts
        assert native_calls.page_batch(native, False, keys, np.arange(4 * PS, 6 * PS, dtype=np.int64), None, False) \
            == [True, True]


def test_an_exception_raised_into_a_waiting_thread_comes_after_the_call_and_never_hangs(tmp_path):
    """An asynchronous exception delivered to a thread waiting for a native call is raised once the call has
    returned (its pages are the call's until then), and a second read of the spent eventfd never blocks it."""
    import ctypes
    import time

    from kvtier.testing import clear_faults, inject_fault

    hp = make_pool()
    with PageStore(tmp_path, model_name="m") as st:
        st.register_mem_pool_host(hp)
        keys = [f"k{i}" for i in range(2)]
        assert st.batch_set_v1(keys, pages_idx(range(2))) == [True, True]
        inject_fault("data_read", "delay", delay_ms=300)
        box = {}

        def run():
            try:
                box["v"] = st.batch_get_v1(keys, pages_idx(range(2, 4)))
            except BaseException as e:  # noqa: BLE001 (handed to the test)
                box["e"] = e

        try:
            t = threading.Thread(target=run)
            t.start()
            time.sleep(0.1)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(KeyError))
            t.join(30)
        finally:
            clear_faults()
        assert not t.is_alive(), "the thread still waits"
        assert isinstance(box.get("e"), KeyError)


def test_index_tensors_are_viewed_in_place_and_kept_alive():
    t = torch.arange(8, dtype=torch.int64)
    a = native_calls.indices(t[2:6])
    assert a.tolist() == [2, 3, 4, 5]
    del t
    assert a.tolist() == [2, 3, 4, 5]  # (the view holds its tensor)
    assert native_calls.indices(torch.arange(8, dtype=torch.int64)[::2]).tolist() == [0, 2, 4, 6]  # (a copy)
    assert native_calls.indices(torch.zeros(0, dtype=torch.int64)).size == 0
