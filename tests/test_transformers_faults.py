"""The transformers tier under the faults an operator meets: a store on a full disk, a second process on the
same store, and kill -9 of a writer. Whatever fails, a restored prompt gives exactly what recomputation gives,
and a page acknowledged as stored (the tier idle after its writes) is restored after a crash."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import functools

import pytest
import torch
from conftest import fill_up
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvtier import KvtierError
from kvtier.integrations.transformers import KVTier as _KVTier, cache_kwarg

# These tests pin the restore mechanics (which pages come back, from where): every cached page is taken
# (restore="all"), so no decision depends on timing; tests/test_restore_planning.py covers the planner.
KVTier = functools.partial(_KVTier, restore="all")  # noqa: E402

PS = 8
CFG = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=128)


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CFG)).eval()


def prompt(n, seed):
    return torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def gen(model, ids, cache):
    out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=4, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def exact(model, ids, cache):
    """Bit-equal to transformers reusing the same prefix KV (a cropped DynamicCache: a suffix computed after a
    prefix gives other last bits than one prefilled with it), and the same tokens as recomputing."""
    got = gen(model, ids, cache)
    ref = DynamicCache(config=model.config)
    if cache.restored_tokens:
        with torch.no_grad():
            model(ids, **{cache_kwarg(model): ref})
        ref.crop(cache.restored_tokens - ids.shape[1])
    want, fresh = gen(model, ids, ref), gen(model, ids, DynamicCache(config=model.config))
    return torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[0], fresh[0])


def test_a_full_disk_costs_reuse_not_correctness(mounted):
    mnt = mounted("tmpfs", 2)
    m = llama()
    prompts = [prompt(41, s) for s in range(6)]
    with KVTier(m, model_id="t", page_size=PS, host_tokens=160, store_dir=mnt) as tier:
        gen(m, prompts[0], tier.cache(prompts[0]))
        tier.controller.wait_idle()
        fill_up(mnt)  # every later write fails with ENOSPC
        for ids in prompts[1:]:
            assert exact(m, ids, tier.cache(ids))
        tier.controller.wait_idle()
        assert tier.page_store.get_stats()["write_failures"] > 0
        tier.drop_host_copies()
        restored = 0
        for ids in prompts:  # from the store where it holds the pages, recomputed where it could not write them
            c = tier.cache(ids)
            restored += c.restored_tokens
            assert exact(m, ids, c)
        assert restored >= 40  # the first prompt's pages were written before the disk filled
        os.unlink(mnt / "filler")  # room again: a new prompt's pages are stored
        fresh = prompt(41, 99)
        gen(m, fresh, tier.cache(fresh))
        tier.controller.wait_idle()
        tier.drop_host_copies()
        c = tier.cache(fresh)
        assert c.restored_store_pages == 5
        assert exact(m, fresh, c)


def test_a_second_process_on_the_same_store_is_refused_clearly(tmp_path):
    m = llama()
    with KVTier(m, model_id="t", page_size=PS, host_tokens=160, store_dir=tmp_path):
        with pytest.raises(KvtierError, match="already open for writing"):
            KVTier(m, model_id="t", page_size=PS, host_tokens=160, store_dir=tmp_path)


WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_transformers_faults import llama, prompt, gen
    from kvtier.integrations.transformers import KVTier
    m = llama()
    tier = KVTier(m, model_id="t", restore="all", page_size={ps}, host_tokens=4096, store_dir={root!r})
    for s in range(1000):
        ids = prompt(41, s)
        gen(m, ids, tier.cache(ids))
        tier.controller.wait_idle()  # every page of this prompt is durable: acknowledged
        print(s, flush=True)
""")


@pytest.mark.parametrize("after_s", [1.5, 3.0])
def test_kill_9_loses_no_acknowledged_page(tmp_path, after_s):
    code = WRITER.format(tests=os.path.dirname(__file__), ps=PS, root=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    acked = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        acked.append(int(line))
        if len(acked) == 1:
            start = time.monotonic()
        if len(acked) > 1 and time.monotonic() - start > after_s:
            break
    p.send_signal(signal.SIGKILL)
    p.wait(10)
    p.stdout.close()
    assert acked, "the writer acknowledged nothing"
    m = llama()
    with KVTier(m, model_id="t", page_size=PS, host_tokens=4096, store_dir=tmp_path) as tier:
        for s in acked:
            ids = prompt(41, s)
            c = tier.cache(ids)
            assert c.restored_store_pages == 5, f"prompt {s} was acknowledged but not restored"
            assert exact(m, ids, c)
        nxt = prompt(41, acked[-1] + 1)  # the prompt in flight at the kill: whatever was kept is exact
        assert exact(m, nxt, tier.cache(nxt))
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("restore", ["all", "plan"])
def test_a_stalled_disk_costs_a_recompute_not_a_hang(tmp_path, restore):
    """The disk stops answering mid-service (every read blocks until the stall is cleared): requests whose
    pages are on the disk come back within the restore deadline, recomputed, exact; once the disk answers, the
    reads that were fenced return and later requests are served from the disk again."""
    import threading

    from kvtier.testing import clear_faults, inject_fault

    m = llama()
    ids = [prompt(41, s) for s in range(3)]
    # a slow prefill (so the plan loads from the disk) and a short deadline (so the stall is seen at once)
    with _KVTier(m, model_id="t", page_size=PS, host_tokens=160, store_dir=tmp_path, restore=restore,
                 prefill=50.0, calibrate=False, restore_deadline=0.3) as tier:
        for x in ids:
            gen(m, x, tier.cache(x))
        tier.controller.wait_idle()
        tier.drop_host_copies()
        inject_fault("data_read", "stall", times=None)
        try:
            box = {}
            t = threading.Thread(target=lambda: box.update(ok=[exact(m, x, tier.cache(x)) for x in ids[:2]]),
                                 daemon=True)
            t.start()
            t.join(60)
            assert not t.is_alive(), "a request hung behind the stalled disk"
            assert box["ok"] == [True, True]
            ds = tier.controller.deadline_stats()
            assert ds["deadline_misses"]["read"] >= 1
        finally:
            clear_faults()
        t0 = time.monotonic()
        while tier.controller.deadline_stats()["fenced_pages"]:
            assert time.monotonic() - t0 < 60, "fenced pages never reclaimed"
            time.sleep(0.01)
        tier.drop_host_copies()
        time.sleep(tier.controller.tier_io.breaker.base_cooldown_s)  # the breaker lets a probe through
        c = tier.cache(ids[2])
        assert exact(m, ids[2], c)
        assert c.restored_tokens > 0 and tier.controller.tier_io.breaker.state == "closed"
