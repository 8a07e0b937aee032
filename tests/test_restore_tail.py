"""A split restore's tail in flight (kvtier.integrations.transformers.restore): the tail is read into private
pages while the head is computed and used by the next forward before the read has finished. These tests break
the read after the plan was made — one page in the middle, every page of a damaged disk, a read that raises —
and check the promises: the output is recomputing's, no unverified page reaches the index or another
sequence, nothing leaks from the host pool, and a cache released or cropped before its first forward gives
every page back."""

import gc
import os

import pytest
import torch
from transformers import DynamicCache

from kvtier.integrations.transformers import KVTier, cache_kwarg
from kvtier.planner import PrefillModel
from test_restore_planning import PS, greedy, llama, stored_then_dropped, tokens, with_disk_at

PAGES = 40
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _device(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.bfloat16 if device == "cuda" else torch.float32


def _tier(model, tmp_path, name, window=2):
    # 1 ms per token and a disk that reads a token's KV in 2 ms: a split, about two thirds recomputed
    return KVTier(model, model_id=f"t/{name}", page_size=PS, host_tokens=4096, store_dir=tmp_path, window=window,
                  prefill=PrefillModel((0.0, 1e-3, 0.0, 0.0)))


def _split_disk(tier):
    with_disk_at(tier, tier.controller.page_bytes / PS / 2e-3 / 1e9)


def _fail_reads(monkeypatch, tier, bad_keys=None, *, raise_error=False):
    """The store's reads report ``bad_keys`` (all when None) failed and leave garbage in their host pages, as a
    read that failed its checksum half-way does; or raise."""
    store = tier.controller.store
    real, real_first = store.batch_get_v1, store.batch_get_layers_first
    calls = []

    def get(keys, host_indices, extra_info=None, *, first=None):
        calls.append(list(keys))
        if raise_error:
            raise OSError("disk gone")
        # (a two-pass read, as a split with every layer resident on CUDA makes: its gate opens half-way)
        ok = list(real(keys, host_indices, extra_info) if first is None else real_first(keys, host_indices, *first))
        rows = host_indices.reshape(len(keys), -1)
        for i, k in enumerate(keys):
            if bad_keys is None or k in bad_keys:
                ok[i] = False
                page = int(rows[i, 0]) // PS  # (the host pool is pages first: [page, layer, token, head, dim])
                for buf in (tier.host.k_buffer, tier.host.v_buffer):
                    buf[page].copy_(torch.randn_like(buf[page].float()).to(buf.dtype) * 100)
        return ok

    def get_first(keys, host_indices, layers, first_layers, gate=None):
        try:
            return get(keys, host_indices, first=(layers, first_layers, gate))
        finally:
            if gate is not None:
                gate.open()

    monkeypatch.setattr(store, "batch_get_v1", get)
    monkeypatch.setattr(store, "batch_get_layers_first", get_first)
    return calls


def _host_pages_in_use(tier):
    return (tier.host.size - tier.host.available_size()) // PS


def _settled(tier):
    """Every transfer, store IO and collected cache finished, and the backups' events seen complete (their
    references go)."""
    gc.collect()
    tier.synchronize()
    tier.controller.wait_idle()
    tier.controller.acquire([])


def _nothing_leaked(tier):
    """No page referenced, and the host pool's allocated pages are exactly the index's."""
    _settled(tier)
    ctrl = tier.controller
    return all(pg.refs == 0 for pg in ctrl.pages.values()) and _host_pages_in_use(tier) == len(ctrl.pages)


def _until(cond, what, limit_s=60):
    """Polls ``cond()`` until true; a hang guard (``what`` fails the test after ``limit_s``), not a timing."""
    import time

    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < limit_s, what
        time.sleep(0.01)


def _stored_split(tmp_path, device, name, window=2):
    """A tier whose store holds a 40-page prompt (not on the host) and whose disk the planner splits: (model,
    ids, tier, recomputing's greedy tokens)."""
    model = llama(device, _device(device))
    ids = tokens(PAGES * PS + 5)
    tier = _tier(model, tmp_path, name, window)
    want = greedy(model, ids, DynamicCache(config=model.config))
    stored_then_dropped(tier, model, ids)
    _split_disk(tier)
    return model, ids, tier, want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["middle", "first", "all", "raises"])
@pytest.mark.parametrize("window", [2, 3])  # 3: every layer resident (the head stays on the device)
def test_a_tail_page_that_fails_after_the_plan_gives_recomputings_tokens(tmp_path, monkeypatch, device, where, window):
    model, ids, tier, want = _stored_split(tmp_path, device, f"tail-{where}", window)
    with tier:
        ctrl = tier.controller
        plan_keys = []
        real_read = ctrl.read_into

        def read_into(page_keys, starts, **kw):
            plan_keys.extend(page_keys)
            return real_read(page_keys, starts, **kw)

        monkeypatch.setattr(ctrl, "read_into", read_into)
        class Chooser:  # the tail's keys are known once the restore asks for them
            def __contains__(self, key):
                i = plan_keys.index(key)
                return i == len(plan_keys) // 2 if where == "middle" else i == 0

        _fail_reads(monkeypatch, tier, None if where == "all" else Chooser(), raise_error=where == "raises")
        c = tier.cache(ids)
        p = c.plan
        assert p.kind == "split" and len(plan_keys) == p.load_to - p.recompute_to > 2, p
        got = greedy(model, ids, c)
        assert torch.equal(got, want), f"{where}: {got} != {want}"
        # the verified pages before the failed one are in the index (from it on, the recomputed ones are)
        failed = {"middle": len(plan_keys) // 2, "first": 0, "all": 0, "raises": 0}[where]
        assert all(k in ctrl.pages for k in plan_keys[:failed])
        tier.synchronize()
        ctrl.wait_idle()
        # what the index holds now is what recomputing makes: a restore from the host alone gives recompute's tokens
        monkeypatch.undo()
        c.release()
        d = tier.cache(ids)
        assert torch.equal(greedy(model, ids, d), want)
        d.release()
        assert _nothing_leaked(tier), "a tail page leaked from the host pool"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [2, 3])
def test_the_forward_after_a_split_loads_only_what_its_slots_lack(tmp_path, monkeypatch, device, window):
    """A slot that still holds its layer's head (every layer resident: window 3 of 3 layers) gets only the
    tail's pages; a slot another layer used since (window 2) gets the whole prefix again. Either way the
    tokens are recomputing's."""
    model, ids, tier, want = _stored_split(tmp_path, device, f"tail-slots-{window}", window)
    with tier:
        st, loads, streams = tier._state, [], set()
        real = st.transfer

        def transfer(win, layer_idx, host, dev, *, to_host, tail=False):
            if not to_host:
                loads.append((layer_idx, int(dev[0]) // PS - 1, len(dev) // PS))  # (layer, first page, pages)
                streams.add(tail)
            return real(win, layer_idx, host, dev, to_host=to_host, tail=tail)

        real_all = st.transfer_layers

        def transfer_layers(win, host, dev, *, to_host):  # (every layer in one call: each layer's load counted)
            if not to_host:
                loads.extend((layer, int(dev[0]) // PS - 1, len(dev) // PS) for layer in range(st.layers))
                streams.add(False)
            return real_all(win, host, dev, to_host=to_host)

        monkeypatch.setattr(st, "transfer", transfer)
        monkeypatch.setattr(st, "transfer_layers", transfer_layers)
        c = tier.cache(ids)
        p = c.plan
        assert p.kind == "split" and p.host_pages == 0 and p.load_to == PAGES, p
        j, k = p.recompute_to, p.load_to
        assert torch.equal(greedy(model, ids, c), want)
        if window == 3:  # the tail's pages, once per layer; nothing else, decode steps included
            assert sorted(loads) == [(layer, j, k - j) for layer in range(3)]
            # on CUDA on the tail stream (each waits for the read alone, not behind the head's backups)
            assert streams == {device == "cuda"}
        else:  # slot 0 got layer 0's head back after layer 2's (the tail only), layer 1 has slot 1 to itself (the
            # tail only), layer 2 shares slot 0 (the whole prefix again)
            assert (0, j, k - j) in loads and (1, j, k - j) in loads and (2, 0, k) in loads
        c.release()
        assert _nothing_leaked(tier)


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_tail_gives_the_same_logits_whatever_the_forward_asks_for(tmp_path, monkeypatch, device):
    """The forward that used the failed page is computed again; its output keeps the shape the caller asked
    for (every position's logits, a tuple instead of a ModelOutput) and recomputing's values."""
    dtype = _device(device)
    model = llama(device, dtype)
    ids = tokens(PAGES * PS + 5).to(device)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=True, past_key_values=DynamicCache(config=model.config)).logits
    with _tier(model, tmp_path, "tail-shape") as tier:
        stored_then_dropped(tier, model, ids.cpu())
        _split_disk(tier)
        _fail_reads(monkeypatch, tier)
        c = tier.cache(ids)
        held = c.get_seq_length()
        assert c.plan.kind == "split" and held == PAGES * PS
        with torch.no_grad():
            out = model(input_ids=ids[:, held:], use_cache=True, return_dict=False, **{cache_kwarg(model): c})
        assert isinstance(out, tuple) and out[0].shape == (1, ids.shape[1] - held, want.shape[-1])
        # float32 on the CPU: a forward cut in two rounds apart from one over the whole sequence (torch 2.15's
        # kernels: up to 4e-7 with no tier at all); unverified KV would be off by orders of magnitude more
        tol = 1e-5 if device == "cpu" else 0.3
        assert (out[0].float() - want[:, held:].float()).abs().max().item() <= tol
        assert c.get_seq_length() == ids.shape[1] and c.restored_tokens < PAGES * PS
        assert tier.stats.restored_store_pages == c.restored_store_pages


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["release", "crop", "garbage"])
def test_a_cache_dropped_before_its_first_forward_gives_every_tail_page_back(tmp_path, monkeypatch, device, how):
    model, ids, tier, want = _stored_split(tmp_path, device, f"tail-{how}")
    with tier:
        ctrl = tier.controller
        before = _host_pages_in_use(tier)
        _fail_reads(monkeypatch, tier, None)
        c = tier.cache(ids)
        assert c.plan.kind == "split"
        if how == "release":
            c.release()
        elif how == "crop":
            c.crop(-PS)  # cut inside the tail: the failed pages go first, then the crop
            assert c.get_seq_length() == c.plan.recompute_to * PS
            assert torch.equal(greedy(model, ids, c), want)
            c.release()
        else:
            del c
        assert _nothing_leaked(tier) and len(ctrl.pages) >= before


def test_a_load_plan_on_a_damaged_disk_recomputes(tmp_path):
    """A real fault: every data file overwritten after the plan's lookup (the index says the pages are there,
    their checksums say they are not). The whole prefix is computed; nothing of the damaged bytes is kept."""
    model = llama()
    ids = tokens(30 * PS + 3)
    with KVTier(model, model_id="t/damaged", page_size=PS, host_tokens=4096, store_dir=tmp_path,
                prefill=PrefillModel((0.0, 1e-3, 0.0, 0.0))) as tier:
        want = greedy(model, ids, DynamicCache(config=model.config))
        stored_then_dropped(tier, model, ids)
        with_disk_at(tier, 1e6)
        for d, _, files in os.walk(tmp_path):
            for f in files:
                if f.endswith(".dat"):
                    path = os.path.join(d, f)
                    with open(path, "r+b") as fh:
                        fh.write(os.urandom(os.path.getsize(path)))
        c = tier.cache(ids)
        assert c.plan.kind == "load"
        assert torch.equal(greedy(model, ids, c), want)
        assert c.restored_tokens == 0 and tier.controller.stats.prefetch_misses >= 1


# one of 12 runs on the H200 once hung here (window 2, CUDA; not reproduced since, in 4 rounds of every deadline
# and stall test on the H200): a hang fails, with every thread's stack, instead of holding the run
@pytest.mark.timeout(300, method="thread")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [2, 3])
def test_a_tail_read_from_a_stalled_disk_gives_recomputings_tokens(tmp_path, device, window):
    """The disk stops answering once the split was planned: the tail's read misses its deadline, the forward
    queued behind it (on CUDA, behind gates on the device) goes on and is computed again from the tail, the
    tokens are recomputing's; the tail's private pages stay fenced until the read returns, then nothing leaks."""
    import threading

    from kvtier.testing import clear_faults, inject_fault

    model, ids, tier, want = _stored_split(tmp_path, device, f"tail-stall-{window}", window)
    with tier:
        ctrl = tier.controller
        ctrl.restore_deadline = 0.3
        inject_fault("data_read", "stall", times=None)
        box = {}
        try:
            def run():
                c = tier.cache(ids)
                box["plan"], box["got"] = c.plan, greedy(model, ids, c)
                c.release()

            t = threading.Thread(target=run, daemon=True)
            t.start()
            t.join(120)
            assert not t.is_alive(), "the request hung behind the stalled disk"
            assert box["plan"].kind == "split", box["plan"]
            assert torch.equal(box["got"], want)
            assert ctrl.deadline_stats()["deadline_misses"]["read"] >= 1
        finally:
            clear_faults()
        _until(lambda: not ctrl.deadline_stats()["stuck_calls"], "the stalled read never returned")
        assert ctrl.deadline_stats()["fenced_pages"] == 0 and not ctrl.planning._fenced and not ctrl.planning._free_after
        assert _nothing_leaked(tier), "a tail page leaked from the host pool"



def test_a_collected_caches_release_never_waits_on_the_collecting_thread(tmp_path):
    """A dropped cache's finalizer runs wherever a garbage collection does: on any thread, inside any lock. Its
    release waits for a read still writing into its pages, and a read past its deadline is answered under the
    controller's lock: run inline inside that lock, the two waited on each other for ever. The release now runs
    on a thread of its own, and the tier's synchronize waits for it."""
    import concurrent.futures
    import threading

    from kvtier.integrations.transformers.window import PageTable, release_table

    with KVTier(llama(), model_id="t/collected", page_size=PS, host_tokens=1024, store_dir=tmp_path) as tier:
        ctrl, st = tier.controller, tier._state
        before = _host_pages_in_use(tier)
        table = PageTable()
        table.starts, table.keys = ctrl.allocate(2), [None, None]
        table.reading = concurrent.futures.Future()

        def answer_under_the_lock():  # (what a read's deadline does: kvtier.deadlines, on_give_up)
            with ctrl.lock:
                table.reading.set_result(0)

        def collect_inside_the_lock():
            with ctrl.lock:
                threading.Thread(target=answer_under_the_lock, daemon=True).start()
                release_table(st, table)

        t = threading.Thread(target=collect_inside_the_lock, daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "the release waited on the collecting thread, inside the controller's lock"
        tier.synchronize()
        assert table.reading.done() and not table.starts
        assert _host_pages_in_use(tier) == before, "the collected table's pages were not given back"


@pytest.mark.cuda
@pytest.mark.timeout(120, method="thread")
def test_a_cache_collected_inside_the_controllers_lock_with_its_tail_stalled_never_deadlocks(tmp_path):
    """On CUDA a split's cache comes back before its tail's read ends (its loads wait behind a gate): dropped and
    collected inside the controller's lock while the disk is stalled, its release must not wait there."""
    import threading

    from kvtier.testing import clear_faults, inject_fault

    model, ids, tier, want = _stored_split(tmp_path, "cuda", "collected-in-lock")
    with tier:
        ctrl = tier.controller
        ctrl.restore_deadline = 3.0  # (the read is still pending when the cache is dropped)
        inject_fault("data_read", "stall", times=None)
        try:
            box = {"c": tier.cache(ids)}
            assert box["c"].plan.kind == "split" and not box["c"].table.reading.done()

            def collect_inside_the_lock():
                with ctrl.lock:
                    del box["c"]
                    gc.collect()

            t = threading.Thread(target=collect_inside_the_lock, daemon=True)
            t.start()
            t.join(30)
            assert not t.is_alive(), "the collected cache's release waited inside the controller's lock"
            _until(lambda: ctrl.deadline_stats()["deadline_misses"]["read"] >= 1, "the read's deadline never answered")
        finally:
            clear_faults()
        _until(lambda: not ctrl.deadline_stats()["stuck_calls"], "the stalled read never returned")
        assert _nothing_leaked(tier), "a page of the collected cache leaked from the host pool"
        assert torch.equal(greedy(model, ids, tier.cache(ids)), want)


def test_a_process_ending_with_a_live_cache_and_an_open_tier_exits_cleanly(tmp_path):
    """A cache kept alive by a reference cycle and a KVTier never closed, at interpreter exit: nothing is released
    on a thread that the interpreter's finalization would find inside torch (the process aborted, status 134)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_restore_planning import PS, llama
        from kvtier.integrations.transformers import KVTier
        tier = KVTier(llama(), model_id="t/exit", page_size=PS, host_tokens=1024, store_dir={str(tmp_path)!r})
        c = tier.cache(list(range(3 * PS)))
        c._grow(2 * PS)
        c.me = c  # (a cycle: collected at exit, if at all)
        del c
        print("exiting", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "exiting" in r.stdout, (r.returncode, r.stderr[-2000:])
