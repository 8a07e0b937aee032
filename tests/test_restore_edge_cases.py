"""The restore planner's edges (kvtier.planner, TierController.plan_restore, the transformers cache's planned
restores, the engine planners, TieredStore.locate, the metrics families, parse_size): ids that differ from a
cache's held tokens after a crop or a second generate, a tail read that would evict the plan's own host pages,
plans past the prefetch budget, head pages only a later tier holds, locate naming the tier that serves each
page, one metric series per planner, exact sizes, the right argument named, write rates measured from the
store's own counters. Each docstring says what used to go wrong."""

import contextlib
import gc
import math

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvtier
from kvtier import DeviceKVPool, PageStore, host_pool_for, page_hashes
from kvtier.config import MAX_SIZE, parse_size
from kvtier.integrations.transformers import KVTier, cache_kwarg
from kvtier.planner import PrefillModel, TierEstimate, plan_restore
from kvtier.tiers import TieredStore
from test_restore_planning import PS, greedy, guarded, llama, tokens, with_disk_at


def _fixed_prefill():
    return PrefillModel((0.0, 1e-3, 0.0, 0.0))  # 1 ms per token: no calibration at construction


def _logits(model, ids, cache, n=1):
    out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=n, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    return out.logits[0][0]


# ------------------------------------------------------------------------------------ the prompt-mismatch refusal
def test_generate_after_crop_refuses_other_ids_inside_the_held_prefix(tmp_path):
    """KvtierCache.check_generate_inputs (transformers/cache.py) checks only tokens [_checked, m) and _truncate keeps
    _checked = min(_checked, tokens) (:462): after ``crop`` the tokens still held are never checked again. A generate
    on the cropped cache with ids that differ inside the held prefix (token 5) is not refused: its first
    token's logits are computed on the other prompt's KV (they differ from recomputing by ~0.2) — exactly
    what the refusal promises never to do (README: "generate with ids that differ from them inside the
    restored prefix ... is refused")."""
    model = llama()
    a = tokens(6 * PS + 3)
    with KVTier(model, model_id="t/crop", page_size=PS, host_tokens=2048, restore="all") as tier:
        c = tier.cache(a)
        out = greedy(model, a, c)
        c.crop(-(c.get_seq_length() - 3 * PS))  # keep the first three pages of a
        b = out.clone()
        b[0, 5] = (b[0, 5] + 1) % 256 or 1  # differs inside the prefix the cache still holds
        want = _logits(model, b, DynamicCache(config=model.config))
        try:
            got = _logits(model, b, c)
        except kvtier.InvalidArgumentError:
            return  # the promised refusal
        pytest.fail(f"not refused: logits differ from recomputing by {(got - want).abs().max().item():.3f}")


def test_a_second_generate_with_other_ids_inside_the_prefix_is_refused(tmp_path):
    """Same culprit (transformers/cache.py): a second ``generate`` on a cache (is_first_iteration=True)
    re-checks nothing below _checked, and the forward pre-hook checks only while the cache is shorter than
    its prompt (transformers/cache.py). So generate(b) with b differing from the cache's tokens at
    position 5 (a multi-turn call with the wrong conversation) is silently answered from a's KV."""
    model = llama()
    a = tokens(6 * PS + 3)
    with KVTier(model, model_id="t/second", page_size=PS, host_tokens=2048, restore="all") as tier:
        c = tier.cache(a)
        out = greedy(model, a, c)
        b = torch.cat([out, tokens(5, seed=7)], 1)
        b[0, 5] = (b[0, 5] + 1) % 256 or 1
        with pytest.raises(kvtier.InvalidArgumentError, match="input_ids"):
            greedy(model, b, c, 2)


def test_a_second_generate_shorter_than_the_cache_is_one_clear_error(tmp_path):
    """_check_sequence means to refuse input_ids shorter than what the cache holds
    (``int(input_ids.shape[1]) < held``, transformers/cache.py), but the test sits inside
    ``if m > self._checked``: on a second generate (m <= _checked) it is never reached and transformers
    fails deep inside attention with "cannot reshape tensor of 0 elements" instead of kvtier's one clear
    InvalidArgumentError (the first generate does give it)."""
    model = llama()
    a = tokens(6 * PS + 3)
    with KVTier(model, model_id="t/short", page_size=PS, host_tokens=2048, restore="all") as tier:
        c = tier.cache(a)
        greedy(model, a, c)
        with pytest.raises(kvtier.InvalidArgumentError, match="input_ids"):
            greedy(model, a[:, :50], c, 2)


# ------------------------------------------------------------------------------------ carrying a plan out
def _stored_then_dropped(tier, model, ids):
    c = tier.cache(ids)
    greedy(model, ids, c, 1)
    c.release()
    tier.controller.wait_idle()
    assert tier.drop_host_copies() > 0


def test_the_tail_read_cannot_evict_the_host_pages_the_plan_counts_on(tmp_path):
    """Restorer.restore (transformers/restore.py) starts ``prefetch(keys[j:k])`` *before*
    ``acquire(keys[:h])``; prefetch protects (move_to_end, controller.py) only the keys it was given, so when the host pool
    is short of room its allocation evicts the LRU unreferenced pages — the very host pages [0, h) the plan
    counted as free (restore="all" passed them to prefetch, which is what the controller's docstring relies
    on: "the pages already on the host are touched so making room never evicts them"; plan_restore's
    docstring also says acquire first, then prefetch). The plan ("load", 4 host pages) is then carried out
    as "recompute 4 pages + load 12": time to first token is worse than predicted and the planner's TTFT
    statistics compare it with the wrong plan. The window is the IO thread taking the controller's lock
    before the caller's acquire; this test makes the IO thread win by having acquire wait for it (what a
    busy or 2-core host does on its own)."""
    model = llama()
    a, b = tokens(16 * PS + 3), tokens(14 * PS + 3, seed=2)
    with guarded(model, model_id="t/evict", page_size=PS, host_tokens=24 * PS, store_dir=tmp_path,
                 prefill=_fixed_prefill()) as tier:
        ctrl = tier.controller
        _stored_then_dropped(tier, model, a)
        with_disk_at(tier, 1e6)
        head = a[:, : 4 * PS + 1]  # a's first 4 pages back on the host (loaded from the disk), unreferenced
        c = tier.cache(head)
        greedy(model, head, c)
        c.release()
        c = tier.cache(b)  # then another prompt fills most of the pool
        greedy(model, b, c)
        c.release()
        ctrl.wait_idle()
        assert all(k in ctrl.pages for k in page_hashes(a[0, : 4 * PS].tolist(), PS))  # a's head is on the host
        orig, calls = ctrl.acquire, []

        def acquire(keys):
            if not calls:
                ctrl.wait_idle()  # the prefetch thread got the lock first
            calls.append(len(keys))
            return orig(keys)

        ctrl.acquire = acquire
        c = tier.cache(a)
        assert c.plan.kind == "load" and c.plan.host_pages == 4 and c.plan.load_to == 16
        assert c.restored_host_pages == 4 and c.recomputed_tokens == 0, (
            f"host pages taken: {c.restored_host_pages}, recomputed in the restore: {c.recomputed_tokens} tokens")


def test_a_plan_loads_no_more_than_one_prefetch_brings_in(tmp_path):
    """plan_restore (planner.py, called at controller.py) knows nothing of the controller's prefetch
    budget (half the host pool, controller.py): it plans a 30-page load, Restorer.restore's single prefetch brings
    in 21, the other 9 are recomputed by generate. PlannerStats.record (planner.py) still counts 30
    pages as loaded from the disk (exported as kvtier_restore_tokens{source="disk"}) and the observed time to
    first token is compared with the prediction of the 30-page plan."""
    model = llama()
    ids = tokens(30 * PS + 3)
    with guarded(model, model_id="t/budget", page_size=PS, host_tokens=40 * PS, store_dir=tmp_path,
                 prefill=_fixed_prefill()) as tier:
        _stored_then_dropped(tier, model, ids)
        with_disk_at(tier, 1e6)
        c = tier.cache(ids)
        assert c.plan.kind == "load" and 0 < c.plan.loaded_pages <= tier.controller.prefetch_budget < 30
        assert torch.equal(greedy(model, ids, c), greedy(model, ids, DynamicCache(config=model.config)))
        st = tier.controller.planner_stats.as_dict()
        assert c.restored_store_pages == c.plan.loaded_pages and st["tokens_loaded"]["disk"] == c.restored_tokens, (
            f"planned {c.plan.loaded_pages} pages, restored {c.restored_store_pages}; stats say "
            f"{st['tokens_loaded']['disk'] // PS} pages loaded")


def test_split_head_pages_only_a_later_tier_holds_reach_the_durable_tier(tmp_path):
    """Restorer.restore flags the head's pages ``stored`` because *some* tier of the chain holds them
    (transformers/restore.py, from TieredStore.locate), and TierController.adopt (controller.py)
    then never writes them anywhere. With a TieredStore the chain's own rule is that only the first, durable
    tier counts as stored (a later tier — Mooncake — may drop them: tiers/chain.py module docs), and a load
    would have filled them into the disk. After a split restore of a prefix that only the cluster tier
    holds, the 24 recomputed head pages never reach the local disk (its leading run stays 0) although the
    host had them: when the cluster tier lets go, the whole prefix is recomputed."""
    model = llama()
    ids = tokens(40 * PS + 5)
    keys = page_hashes(ids[0, : 40 * PS].tolist(), PS)
    with guarded(model, model_id="t/chain", page_size=PS, host_tokens=4096, store_dir=tmp_path / "disk",
                 prefill=_fixed_prefill()) as tier:
        ctrl = tier.controller
        remote = PageStore(tmp_path / "remote", model_name=tier.model_name, probe_bytes=0)
        remote.register_mem_pool_host(tier.host)
        ctrl.store = tier.store = TieredStore([("disk", tier.page_store), ("remote", remote)])
        _stored_then_dropped(tier, model, ids)
        tier.page_store.delete(keys)  # the prefix is in the cluster tier only (another node stored it)
        assert remote.batch_exists(keys) == 40 and tier.page_store.batch_exists(keys) == 0
        real = ctrl.measured

        def measured():
            out = real()
            out["remote"] = TierEstimate("remote", read_GBps=ctrl.page_bytes / PS / 2e-3 / 1e9, source="probe")
            return out

        ctrl.measured = measured
        c = tier.cache(ids)
        assert c.plan.kind == "split" and c.plan.recompute_to > 0
        greedy(model, ids, c)
        c.release()
        ctrl.wait_idle()
        on_disk = sum(tier.page_store.exists(k) for k in keys)
        assert on_disk == 40, f"only {on_disk} of 40 pages on the durable tier (head of {c.plan.recompute_to} missing)"


def test_a_head_forward_interrupted_leaves_nothing_behind(tmp_path):
    """A Ctrl-C inside the split's head forward (before its pages are complete): the exception reaches the
    caller, the tail prefetch is waited for, and once the half-built cache is gone the host pool holds only
    the prefetched (unreferenced, verified) tail pages; a later restore gives recompute's tokens."""
    model = llama()
    ids = tokens(40 * PS + 5)
    with guarded(model, model_id="t/intr", page_size=PS, host_tokens=4096, store_dir=tmp_path,
                 prefill=_fixed_prefill()) as tier:
        ctrl = tier.controller
        _stored_then_dropped(tier, model, ids)
        with_disk_at(tier, ctrl.page_bytes / PS / 2e-3 / 1e9)

        def boom(module, args):
            raise KeyboardInterrupt

        hook = model.model.layers[1].mlp.register_forward_pre_hook(boom)
        with pytest.raises(KeyboardInterrupt):
            tier.cache(ids)
        hook.remove()
        gc.collect()
        ctrl.wait_idle()
        assert all(p.refs == 0 for p in ctrl.pages.values())
        assert tier.host.available_size() == tier.host.size - len(ctrl.pages) * PS
        c = tier.cache(ids)
        assert torch.equal(greedy(model, ids, c, 3), greedy(model, ids, DynamicCache(config=model.config), 3))


# ------------------------------------------------------------------------------------ TieredStore.locate
def _pool():
    ps = 4
    dp = DeviceKVPool(16 * ps, ps, 2, 2, 8, 6, torch.float32, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    for t in (hp.k_buffer, hp.v_buffer):
        t.copy_(torch.randn_like(t))
    return hp


@contextlib.contextmanager
def _disk_and_remote(tmp_path):
    """Two page stores over one host pool, chained disk -> remote."""
    hp = _pool()
    with PageStore(tmp_path / "d", model_name="m", probe_bytes=0) as disk, \
            PageStore(tmp_path / "r", model_name="m", probe_bytes=0) as remote:
        disk.register_mem_pool_host(hp)
        remote.register_mem_pool_host(hp)
        yield disk, remote, TieredStore([("disk", disk), ("remote", remote)])


def test_tiered_locate_names_the_tier_batch_get_reads_from(tmp_path):
    """TieredStore.locate (tiers/chain.py) promises "each page from the first (fastest) tier that has
    it, as batch_get_v1 would read it"; it used to take the first tier with a *leading run* at each position
    and credit that tier with the whole run. The disk missing only page 0 (a corrupt page it dropped) makes
    locate report all 4 pages as the cluster tier's, while batch_get_v1 reads 3 of them from the disk: the
    planner prices disk pages at the remote tier's speed (recomputing what the disk would serve fast, or the
    reverse)."""
    keys = [f"{i:064x}" for i in range(4)]
    idx = torch.arange(4 * 4)
    with _disk_and_remote(tmp_path) as (disk, remote, chain):
        assert remote.batch_set_v1(keys, idx) == [True] * 4
        assert disk.batch_set_v1(keys[1:], idx[4:]) == [True] * 3
        where = chain.locate(keys)
        assert chain.batch_get_v1(keys, torch.arange(8 * 4, 12 * 4)) == [True] * 4
        st = chain.get_stats()
        read = {"disk": st["disk"]["hits"], "remote": st["remote"]["hits"]}
        assert read == {"disk": 3, "remote": 1}
        assert where == [("remote", 1), ("disk", 3)], where


def test_tiered_locate_total_is_batch_exists_with_deleted_keys(tmp_path):
    """locate's total equals batch_exists, with a key deleted through the chain (a later tier still holding
    it is not counted), and with runs that alternate between tiers."""
    keys = [f"{i:064x}" for i in range(6)]
    idx = torch.arange(6 * 4)
    with _disk_and_remote(tmp_path) as (disk, remote, chain):
        remote.batch_set_v1(keys, idx)
        disk.batch_set_v1([keys[0], keys[2]], torch.cat([idx[:4], idx[8:12]]))
        assert sum(n for _, n in chain.locate(keys)) == chain.batch_exists(keys) == 6
        disk.delete([keys[3]])
        chain._deleted[keys[3]] = None  # what chain.delete leaves when the later tier refuses to let go
        assert sum(n for _, n in chain.locate(keys)) == chain.batch_exists(keys) == 3


# ------------------------------------------------------------------------------------ metrics
def test_planner_metric_families_have_one_series_per_planner(tmp_path):
    """The planner families of kvtier.metrics (_planner_families) add every source's counters under the same label
    set (kind / source / which / tier+direction, no store label), although the collector takes "any number of"
    SGLang backends (the store families carry a ``store`` label for this). Two backends give two samples of
    kvtier_restore_tokens_total{source="recomputed"} (and of every plan kind and tier rate) in one
    exposition: Prometheus rejects the duplicates of the scrape, and they do not add up."""
    pytest.importorskip("sglang")  # two SGLang backends (in vLLM's environment: skipped)
    from prometheus_client import CollectorRegistry, generate_latest
    from sglang_pools import config, sglang_pool

    from kvtier.integrations.sglang import KvtierStorage
    from kvtier.metrics import KvtierCollector

    backends = []
    for name in ("a", "b"):
        be = KvtierStorage(config(tmp_path / name, restore_planner=True))
        be.register_mem_pool_host(sglang_pool("page_first_direct"))
        be.batch_exists([f"{i:064x}" for i in range(3)])
        backends.append(be)
    reg = CollectorRegistry()
    reg.register(KvtierCollector(stores=backends))
    lines = [ln.rsplit(" ", 1)[0] for ln in generate_latest(reg).decode().splitlines() if ln and not ln.startswith("#")]
    planner = [ln for ln in lines if ln.startswith(("kvtier_restore_", "kvtier_tier_measured"))]
    dup = sorted({ln for ln in planner if planner.count(ln) > 1})
    for be in backends:
        be.close()
    assert not dup, dup


# ------------------------------------------------------------------------------------ arguments
def test_parse_size_keeps_every_digit():
    """parse_size (config.py) parses every string through float(): an integer string past 2**53 comes
    back as another number ("9007199254740993" -> 9007199254740992), and MAX_SIZE itself, accepted as an int,
    is refused as a string (it rounds up to 2**63)."""
    assert parse_size("x", "9007199254740993") == 9007199254740993
    assert parse_size("x", str(MAX_SIZE)) == MAX_SIZE


def test_a_bad_prefill_names_kvtiers_own_argument():
    """KVTier(prefill=0) / TierController(prefill=-1.0) go through PrefillModel.fixed (planner.py), whose
    error names `prefill_tokens_per_s` — SGLang's/vLLM's option, not an argument of KVTier or TierController
    (their argument is `prefill`); the repo's own test only matches the substring "prefill"."""
    model = llama()
    with pytest.raises(kvtier.InvalidArgumentError, match=r"`prefill`"):
        KVTier(model, model_id="x", prefill=0)


# ------------------------------------------------------------------------------------ the planner's arithmetic
def test_planner_invariants_on_odd_inputs():
    """Segments with zero pages, tiers missing from the estimates (free: explored), can_split=False, a prompt
    that fits in one page, host pages past the limit, degenerate prefill observations (all identical, a
    single one, context-only): plans stay ordered, never predicted slower than recomputing, and finite."""
    pms = []
    for obs in ([(100, 0, 0.01)] * 5, [(100, 0, 0.01)], [(64, 1000, 0.01), (128, 2000, 0.02)]):
        pm = PrefillModel()
        for o in obs:
            pm.observe(*o)
        pms.append(pm)
    pms.append(PrefillModel.fixed(1e4, overhead_s=0.01))
    cases = [dict(prompt_tokens=1000, host_pages=10, store_segments=[("disk", 0), ("x", 20), ("disk", 30)]),
             dict(prompt_tokens=16, host_pages=3, store_segments=[("disk", 5)]),
             dict(prompt_tokens=17, host_pages=5, store_segments=[("disk", 5)]),
             dict(prompt_tokens=5000, host_pages=0, store_segments=[("disk", 300)])]
    for pm in pms:
        for kw in cases:
            for split in (True, False):
                p = plan_restore(page_tokens=16, page_bytes=1 << 20, tiers={"disk": TierEstimate("disk", read_GBps=1.0)},
                                 prefill=pm, can_split=split, **kw)
                assert 0 <= p.host_pages <= p.recompute_to <= p.load_to <= (kw["prompt_tokens"] - 1) // 16
                assert p.predicted_s <= p.recompute_s and math.isfinite(p.predicted_s)
                assert split or p.recompute_to == p.host_pages
                assert sum(n for _, n in p.load) == p.loaded_pages
    assert np.all(np.isfinite(pms[0].predict(np.array([0, 1, 10**6]), np.array([0, 10**6, 5]))))
    with pytest.raises(kvtier.InvalidArgumentError):
        PrefillModel((1.0, float("nan"), 0.0, 0.0))
    with pytest.raises(kvtier.InvalidArgumentError):
        plan_restore(prompt_tokens=100, page_tokens=16, page_bytes=4096, host_pages=0, store_segments=[("d", -1)])


def test_vllm_lookup_without_positions():
    """vLLM's planned lookup with req_context None, or one without the key's position: a fast tier HITs, a tier
    slower than the default engine MISSes (counted), and nothing raises."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from kvtier.integrations import vllm as kv

    tier = SimpleNamespace(planner=kv.EnginePlanner(True, None), tokens_per_row=256, row_bytes=256 * 131072,
                           counters={"planned_misses": 0})
    tier._count = lambda name: tier.counters.__setitem__(name, tier.counters[name] + 1)
    ctx = SimpleNamespace(get_offload_key_position=lambda key: None)
    for gbps, want in ((1000.0, True), (0.01, False)):
        store = SimpleNamespace(measured=lambda g=gbps: {"disk": TierEstimate("disk", read_GBps=g)})
        for rc in (None, ctx):
            assert kv.KvtierTier._worth_loading(tier, store, b"k", rc) is want
    assert tier.counters["planned_misses"] == 2


# ------------------------------------------------------------------------------------ the tiers' meters
def test_rewrites_of_stored_pages_do_not_inflate_the_measured_write_rate(tmp_path):
    """PageStore._batch (store.py) feeds the meter ``sum(ok) * page_bytes`` for every batch, but a key
    already stored is acknowledged True without any IO (docs/STORE.md "Reserve"): five re-puts of 64 stored
    pages write 0 bytes (bytes_written unchanged) yet count 5 x 64 pages "written" in microseconds, so the
    measured write GB/s (exported as kvtier_tier_measured_gbps{direction="write"}) jumps several-fold over what
    the disk did. (SGLang and the write-through controller routinely re-put stored pages.)"""
    ps = 4
    dp = DeviceKVPool(64 * ps, ps, 2, 2, 64, 64, torch.float32, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)
    keys = [f"{i:064x}" for i in range(64)]
    with PageStore(tmp_path, model_name="m", probe_bytes=0) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(keys, torch.arange(64 * ps)) == [True] * 64
        first, written = st.measured()["disk"], st.get_stats()["bytes_written"]
        assert first.source == "measured" and first.samples == 0  # the write was metered (no probe, no read)
        for _ in range(5):
            assert st.batch_set_v1(keys, torch.arange(64 * ps)) == [True] * 64
        assert st.get_stats()["bytes_written"] == written  # nothing was written again ...
        after = st.measured()["disk"]  # ... so the meter saw no write: the same sample, the same rate
        assert after.write_GBps == first.write_GBps and after.write_latency_s == first.write_latency_s


def test_a_split_cache_refuses_other_ids_inside_its_recomputed_head(tmp_path):
    """After a split restore, generate with ids that differ inside the recomputed head (token 5) or inside the
    loaded tail is refused on the first call (the head's tokens are tracked in _fed like any forward's)."""
    model = llama()
    ids = tokens(40 * PS + 5)
    with guarded(model, model_id="t/splitref", page_size=PS, host_tokens=4096, store_dir=tmp_path,
                 prefill=_fixed_prefill()) as tier:
        _stored_then_dropped(tier, model, ids)
        with_disk_at(tier, tier.controller.page_bytes / PS / 2e-3 / 1e9)
        for pos in (5, 39 * PS):
            c = tier.cache(ids)
            assert c.plan.kind == "split" and c.plan.recompute_to * PS > 5
            b = ids.clone()
            b[0, pos] = (b[0, pos] + 1) % 256 or 1
            with pytest.raises(kvtier.InvalidArgumentError, match="input_ids"):
                greedy(model, b, c)
            c.release()
            tier.controller.wait_idle()
            tier.drop_host_copies()  # the next restore comes from the disk again
