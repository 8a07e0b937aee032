"""Deciding every restore with measurements (kvtier.planner, TierController.plan_restore, the transformers
cache's planned restores): the plan is never predicted slower than recomputing; a fast tier is loaded, a slow
one recomputed, a balanced one split (head recomputed while the tail loads); the split's output is recompute's
and its loaded pages are the stored bytes; a prompt that differs inside a restored prefix is refused."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier._errors import InvalidArgumentError
from kvtier.planner import PlannerStats, PrefillModel, TierEstimate, TierMeter, plan_restore

KB = 1 << 10


# ---------------------------------------------------------------------------------------------- the planner
def model(per_token=30e-6, attn=1e-9, fixed=2e-3, ctx=0.0):
    return PrefillModel((fixed, per_token, attn, ctx))


def disk(gbps, latency=0.0):
    return {"disk": TierEstimate("disk", read_GBps=gbps, read_latency_s=latency, source="probe")}


def plan(gbps, can_split=True, host=0, pages=128, prompt=None, **kw):
    ps = 64
    return plan_restore(prompt_tokens=prompt or pages * ps + 64, page_tokens=ps, page_bytes=ps * 128 * KB,
                        host_pages=host, store_segments=[("disk", pages - host)], tiers=disk(gbps),
                        prefill=kw.pop("prefill", model()), can_split=can_split, **kw)


def test_a_free_load_is_not_stopped_short_by_a_flat_or_noisy_model():
    """A model whose per-token terms are lost in the noise (a small model on a CPU: only the fixed cost and
    the attention of a first forward over no cache stand out) predicts the same forward whatever is loaded; a
    nearly free disk must then still be read to the end, not stopped after one page because each page costs
    the read a few nanoseconds more (what the planner did, and the test of the transformers cache's fast disk
    caught now and then)."""
    flat = PrefillModel((0.01, 0.0, 0.0, 0.0, 1e-10, 0.0))  # recompute pays n^2 attention with no cache
    p = plan(1e6, prefill=flat)
    assert p.kind == "load" and p.loaded_pages == 128, p.as_dict()
    # cached context costing more than new tokens (a noisy fit): loading more must not look slower
    odd = PrefillModel((0.01, 1e-7, 0.0, 5e-6, 1e-10, 0.0))
    p = plan(1e6, prefill=odd)
    assert p.kind == "recompute" or p.loaded_pages == 128, p.as_dict()


def test_a_fast_tier_is_loaded_a_slow_one_recomputed():
    fast, slow = plan(500.0), plan(0.05)
    assert fast.kind == "load" and fast.load == [("disk", 128)] and fast.recomputed_tokens == 64
    assert fast.predicted_s < fast.recompute_s
    assert slow.kind == "recompute" and slow.reused_pages == 0 and slow.predicted_s == slow.recompute_s
    # a tier at 0.3 GB/s is 14x slower per token than this prefill: at most a short tail is read beside it
    third = plan(0.3)
    assert third.loaded_pages <= 12 and third.predicted_s > 0.9 * third.recompute_s


def test_a_balanced_tier_is_split_where_head_and_tail_finish_together():
    p = plan(1.8)  # the H200's disk: ~73 us/token read against ~31 us/token of prefill
    assert p.kind == "split" and 0 < p.recompute_to < p.load_to == 128
    pm = model()
    head = pm.seconds(p.recompute_to * 64, 0)
    tail = disk(1.8)["disk"].read_s(p.loaded_pages * 64 * 128 * KB)
    assert abs(head - tail) < 0.02 * max(head, tail) + pm.seconds(64, 0)  # one page of either side
    assert p.predicted_s < 0.8 * p.recompute_s
    # an engine that cannot split gets all or nothing of the load, never a head
    q = plan(1.8, can_split=False)
    assert q.recompute_to == q.host_pages == 0 and q.kind in ("load", "recompute")


def test_host_pages_come_first_and_the_last_token_is_always_computed():
    p = plan(50.0, host=40)
    assert p.host_pages == 40 and p.load == [("disk", 88)]
    exact = plan(50.0, pages=4, prompt=4 * 64)  # the prompt ends on a page boundary: its last page is computed
    assert exact.load_to == 3 and exact.recomputed_tokens == 64


def test_without_a_prefill_model_every_cached_page_is_taken():
    p = plan_restore(prompt_tokens=1000, page_tokens=64, page_bytes=1 << 20, host_pages=2,
                     store_segments=[("disk", 5)], tiers=disk(0.001), prefill=PrefillModel())
    assert p.kind == "load" and p.load_to == 7 and p.predicted_s is None


def test_an_unmeasured_tier_is_explored():
    p = plan_restore(prompt_tokens=8256, page_tokens=64, page_bytes=64 * 128 * KB, host_pages=0,
                     store_segments=[("mooncake", 128)], tiers={"mooncake": TierEstimate("mooncake")}, prefill=model())
    assert p.kind == "load" and p.load == [("mooncake", 128)]


def test_a_slow_tier_late_in_the_run_is_cut_off():
    segs = [("disk", 64), ("mooncake", 64)]
    tiers = {"disk": TierEstimate("disk", read_GBps=40.0), "mooncake": TierEstimate("mooncake", read_GBps=0.05)}
    p = plan_restore(prompt_tokens=128 * 64 + 64, page_tokens=64, page_bytes=64 * 128 * KB, host_pages=0,
                     store_segments=segs, tiers=tiers, prefill=model(), can_split=False)
    assert p.kind == "load" and p.load == [("disk", 64)]


@settings(max_examples=300, deadline=None)
@given(gbps=st.floats(0.01, 100.0), latency=st.floats(0.0, 0.05), host=st.integers(0, 40), pages=st.integers(0, 300),
       extra=st.integers(1, 5000), per_token=st.floats(1e-7, 1e-3), attn=st.floats(0.0, 1e-8),
       fixed=st.floats(0.0, 0.05), ctx=st.floats(0.0, 1e-5), split=st.booleans(), overlap=st.booleans(),
       trail=st.booleans())
def test_no_plan_is_predicted_slower_than_recomputing(gbps, latency, host, pages, extra, per_token, attn, fixed, ctx, split,
                                                      overlap, trail):
    ps = 16
    pm = model(per_token, attn, fixed, ctx)
    total = host + pages
    p = plan_restore(prompt_tokens=total * ps + extra, page_tokens=ps, page_bytes=ps * 64 * KB, host_pages=host,
                     store_segments=[("disk", pages)], tiers=disk(gbps, latency), prefill=pm, can_split=split,
                     overlap=overlap, trail=trail)
    assert p.predicted_s <= p.recompute_s + 1e-12
    assert 0 <= p.host_pages <= p.recompute_to <= p.load_to <= total
    assert sum(n for _, n in p.load) == p.loaded_pages
    assert split or p.recompute_to == p.host_pages
    assert p.recomputed_tokens + p.reused_pages * ps == p.prompt_tokens
    # the prediction is the model's own arithmetic for the chosen pages
    h, j, k = p.host_pages, p.recompute_to, p.load_to
    if p.kind in ("load", "split"):  # with overlap, the rest's host time (the fixed term) hides behind the IO
        read = disk(gbps, latency)["disk"].read_s((k - j) * ps * 64 * KB)
        rest = pm.seconds(p.prompt_tokens - k * ps, k * ps)
        a = fixed if overlap and rest - fixed <= fixed else 0.0  # the rest's host time, when it bounds the rest
        head = pm.seconds((j - h) * ps, h * ps)
        if p.kind == "split" and trail and a > 0:  # the rest trails the head: free after it, not after the read
            want = max(head, read + rest - a, 2 * a)
        else:
            want = max(head, read, 2 * a if p.kind == "split" else a) + rest - a
        assert math.isclose(p.predicted_s, want, rel_tol=1e-9)
    elif p.kind == "host":
        assert math.isclose(p.predicted_s, pm.seconds(p.prompt_tokens - h * ps, h * ps), rel_tol=1e-9)


def test_bad_arguments_name_themselves():
    for kw, name in ((dict(prompt_tokens=0), "prompt_tokens"), (dict(page_tokens=-1), "page_tokens"),
                     (dict(host_pages=-2), "host_pages"), (dict(page_bytes=True), "page_bytes")):
        args = {**dict(prompt_tokens=100, page_tokens=16, page_bytes=4096, host_pages=0), **kw}
        with pytest.raises(ValueError, match=f"`{name}`"):
            plan_restore(**args)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        PrefillModel.fixed(0, name="prefill_tokens_per_s")
    with pytest.raises(ValueError, match="coefficients"):
        PrefillModel((1.0, -1.0, 0.0, 0.0))


# ---------------------------------------------------------------------------------------------- the estimates
def test_prefill_model_recovers_its_terms():
    true = (3e-3, 25e-6, 2e-9, 1e-6)
    pm = PrefillModel()
    assert pm.seconds(100, 0) is None and pm.coefficients() is None
    for n, ctx in ((128, 0), (512, 0), (2048, 0), (4096, 0), (128, 4096), (64, 8192), (1024, 2048)):
        pm.observe(n, ctx, PrefillModel(true).seconds(n, ctx))
    for n, ctx in ((8192, 0), (256, 16384), (3000, 3000)):
        assert math.isclose(pm.seconds(n, ctx), PrefillModel(true).seconds(n, ctx), rel_tol=1e-6)
    fixed = PrefillModel.fixed(1000.0)
    fixed.observe(10, 0, 99.0)  # a fixed model ignores observations
    assert fixed.seconds(500, 100) == pytest.approx(0.5) and not fixed.learned


def test_tier_meter_fits_rate_and_latency():
    m = TierMeter("disk")
    assert m.estimate().source == "none" and m.estimate().read_s(1) == math.inf
    m.seed(read_GBps=2.0, write_GBps=1.0)
    e = m.estimate()
    assert e.source == "probe" and e.read_GBps == 2.0 and e.write_GBps == 1.0
    for nbytes in (1 << 20, 4 << 20, 16 << 20, 64 << 20):
        m.observe("read", nbytes, 0.001 + nbytes / 5e9)
    m.observe("read", 0, 1.0)  # a batch of misses says nothing about speed
    e = m.estimate()
    assert e.source == "measured" and e.read_GBps == pytest.approx(5.0, rel=1e-6)
    assert e.read_latency_s == pytest.approx(0.001, rel=1e-6) and e.write_GBps == 1.0
    m.observe_lookup(3, 4)
    m.observe_lookup(0, 4)
    assert m.estimate().hit_rate == pytest.approx(3 / 8)


def test_planner_stats_count_every_decision():
    stats = PlannerStats()
    p = plan(1.8)
    stats.record(p)
    stats.record(plan(0.05))
    stats.observe(p, p.predicted_s * 1.1)
    d = stats.as_dict()
    assert d["plans"] == {"split": 1, "recompute": 1}
    assert d["tokens_loaded"] == {"disk": p.loaded_pages * 64}
    assert d["tokens_recomputed"] == p.recomputed_tokens + 128 * 64 + 64
    assert d["observed"] == 1
    assert stats.median_error() == pytest.approx(abs(1 / 1.1 - 1), rel=1e-6)


def test_a_plan_slower_than_predicted_is_counted_kept_and_logged(caplog):
    """A plan whose time to first token came out more than 10 % over its prediction: counted by kind, kept
    with its plan among the recent ones, logged; one within the margin is none of these."""
    stats = PlannerStats()
    split, recompute = plan(1.8), plan(0.05)
    with caplog.at_level("WARNING", logger="kvtier.planner"):
        stats.observe(split, split.predicted_s * 1.09)  # within the margin
        stats.observe(recompute, recompute.predicted_s * 0.8)  # faster
        assert stats.as_dict()["slow_plans"] == {} and not caplog.records
        stats.observe(split, split.predicted_s * 1.5)
    d = stats.as_dict()
    assert d["slow_plans"] == {"split": 1} and d["observed"] == 3
    (kept,) = d["recent_slow_plans"]
    assert kept["kind"] == "split" and kept["observed_s"] == pytest.approx(split.predicted_s * 1.5)
    assert kept["load_to"] == split.load_to
    (rec,) = caplog.records
    assert "split restore" in rec.getMessage() and "50% over" in rec.getMessage()
    for _ in range(200):  # logged: the first 10, then every 100th; counted and kept: all (the last 16)
        stats.observe(split, split.predicted_s * 2)
    assert stats.as_dict()["slow_plans"] == {"split": 201} and len(stats.as_dict()["recent_slow_plans"]) == 16
    assert len(caplog.records) == 10 + 2


def test_a_rest_queued_before_the_read_ends_hides_its_host_time():
    """With overlap (the engine queues the rest's forward while the head computes or the read runs), a split
    or load whose rest is bound by its host time (the fixed per-forward term) is predicted that term sooner —
    never below the head or the read — and a balanced disk that was not worth splitting becomes worth it; a
    rest bound by the device is predicted as before (measured on the H200: a 5K-token rest after a load ran
    as the model without the credit predicted)."""
    pm = model(per_token=31e-6, fixed=45e-3)
    plain, early = plan(1.5, prefill=pm), plan(1.5, prefill=pm, overlap=True)
    assert early.candidates["split"] == pytest.approx(plain.candidates["split"] - 45e-3)
    assert early.candidates["recompute"] == plain.candidates["recompute"]
    assert early.kind == "split" and early.predicted_s < 0.9 * early.recompute_s
    assert plan(1.5, prefill=model(per_token=31e-6, fixed=0.0), overlap=True).candidates["split"] == \
        plan(1.5, prefill=model(per_token=31e-6, fixed=0.0)).candidates["split"]
    # a rest bound by the device (many new tokens after the prefix) hides nothing: its prediction is unchanged
    long_rest = dict(prefill=pm, prompt=128 * 64 + 8192)
    assert plan(1.5, overlap=True, **long_rest).candidates["split"] == plan(1.5, **long_rest).candidates["split"]


def test_a_rest_that_trails_the_head_is_split_so_the_read_ends_first():
    """With ``trail`` (the rest's forward follows the head layer by layer: kvtier's transformers cache with
    every layer resident) a host-bound rest costs nothing after a head that ends last, and its device part
    after a read that ends last: the head is chosen so the read ends first, by the margin, the tail reads
    through the last cached page (a trailing rest never computes cached pages), and a rest bound by the device
    trails nothing."""
    pm = model(per_token=31e-6, fixed=45e-3)
    trailing = plan(1.8, prefill=pm, overlap=True, trail=True)
    assert trailing.kind == "split" and trailing.load_to == 128
    ps, pb = 64, 64 * 128 * KB
    head = pm.seconds((trailing.recompute_to) * ps, 0)
    read = disk(1.8)["disk"].read_s(trailing.loaded_pages * pb)
    rest = pm.seconds(64, 128 * ps)
    assert head >= read * 1.10 + rest - 45e-3 - 4 * ps * 31e-6  # (within one step of the 4-page grid)
    assert trailing.predicted_s == pytest.approx(max(head, read + rest - 45e-3, 2 * 45e-3))
    # one step less of head would leave the read ending later than the margin allows
    shorter = pm.seconds((trailing.recompute_to - 4) * ps, 0)
    assert shorter < disk(1.8)["disk"].read_s((trailing.loaded_pages + 4) * pb) * 1.10 + rest - 45e-3


def _score(p, margin=0.02, split_margin=0.10):
    """The planner's objective: each kind's best predicted time over (1 - its margin), the lowest."""
    c = p.candidates
    return min(c["recompute"], c.get("host", math.inf), c.get("load", math.inf) / (1 - margin),
               c.get("split", math.inf) / (1 - split_margin))


@settings(max_examples=40, deadline=None)
@given(gbps=st.floats(0.02, 20.0), per_token=st.floats(5e-6, 100e-6), fixed=st.floats(0.0, 60e-3),
       ctx=st.floats(0.0, 2e-8), latency=st.floats(0.0, 5e-3), host=st.integers(0, 5), overlap=st.booleans(),
       trail=st.booleans())
def test_one_more_cached_page_never_makes_the_best_plan_worse(gbps, per_token, fixed, ctx, latency, host, overlap,
                                                               trail):
    """The same request with one more of its pages cached, for an engine that loads a leading part of what is
    cached (SGLang, vLLM: no split): every plan of the fewer pages is still possible, so the planner's best
    never gets worse; the plan it returns is the best it scored, and never predicted slower than recomputing."""
    pm = PrefillModel((fixed, per_token, 1e-9, ctx))
    prev = math.inf
    for pages in range(host + 1, 41):
        p = plan_restore(prompt_tokens=48 * 64 + 40, page_tokens=64, page_bytes=64 * 128 * KB, host_pages=host,
                         store_segments=[("disk", pages - host)], tiers=disk(gbps, latency), prefill=pm,
                         overlap=overlap, trail=trail, can_split=False)
        s = _score(p)
        assert s <= prev * (1 + 1e-9), (pages, p.as_dict())
        assert p.predicted_s <= p.recompute_s * (1 + 1e-9)
        kind_score = {"load": p.candidates.get("load", 0) / 0.98, "split": p.predicted_s / 0.9}.get(p.kind, p.predicted_s)
        assert kind_score == pytest.approx(s), p.as_dict()
        assert p.load_to <= pages and p.host_pages <= p.recompute_to <= p.load_to
        prev = s


@settings(max_examples=40, deadline=None)
@given(gbps=st.floats(0.02, 20.0), slow=st.floats(0.02, 2.0), per_token=st.floats(5e-6, 100e-6),
       fixed=st.floats(0.0, 60e-3), ctx=st.floats(0.0, 2e-8), latency=st.floats(0.0, 5e-3), host=st.integers(0, 5),
       overlap=st.booleans(), learned=st.booleans())
def test_one_more_cached_page_never_makes_a_split_plan_worse(gbps, slow, per_token, fixed, ctx, latency, host, overlap,
                                                              learned):
    """The same with splits (kvtier's transformers cache, not trailing): a split's tail may end at any cached
    page, so the best score never rises as pages are added — the last ones on a slower tier included — and the
    plan returned is the one of that score, reading only cached pages."""
    pm = PrefillModel((fixed, per_token, 1e-9, ctx))
    if learned:  # a fitted model with its local corrections (observed forwards near some shapes)
        pm = PrefillModel()
        for n, c in [(3000, 0), (1500, 1500), (64, 2900), (640, 2000), (2048, 512)]:
            pm.observe(n, c, fixed + per_token * n + 1e-9 * n * c + ctx * c + (0.002 if c > 1000 else 0.0))
    tiers = {**disk(gbps, latency), "cluster": TierEstimate("cluster", read_GBps=slow, read_latency_s=latency)}
    prev = math.inf
    for pages in range(host + 1, 41):
        segs = [("disk", min(pages, 30) - host), ("cluster", max(0, pages - 30))]  # the last pages on a slower tier
        p = plan_restore(prompt_tokens=48 * 64 + 40, page_tokens=64, page_bytes=64 * 128 * KB, host_pages=host,
                         store_segments=segs, tiers=tiers, prefill=pm, overlap=overlap, trail=False)
        assert p.score is not None and p.score <= prev * (1 + 1e-9), (pages, p.as_dict())
        assert p.score == pytest.approx(_score(p)) and p.predicted_s <= p.recompute_s * (1 + 1e-9)
        assert p.load_to <= pages and p.host_pages <= p.recompute_to <= p.load_to
        prev = p.score


def test_a_split_may_leave_slow_cached_pages_to_the_rest():
    """Pages on a fast disk, then a few on a very slow tier: the split's tail stops before the slow pages
    (the rest's forward computes them) instead of the whole split being given up for recomputing."""
    pm = PrefillModel((2e-3, 40e-6, 1e-9, 0.0))
    tiers = {**disk(1.0), "cluster": TierEstimate("cluster", read_GBps=0.05, read_latency_s=5e-3)}
    fast = plan_restore(prompt_tokens=48 * 64 + 40, page_tokens=64, page_bytes=64 * 128 * KB, host_pages=0,
                        store_segments=[("disk", 31)], tiers=tiers, prefill=pm)
    more = plan_restore(prompt_tokens=48 * 64 + 40, page_tokens=64, page_bytes=64 * 128 * KB, host_pages=0,
                        store_segments=[("disk", 31), ("cluster", 4)], tiers=tiers, prefill=pm)
    assert fast.kind == "split" and fast.load_to == 31
    assert more.kind == "split" and more.load_to == 31 and more.load == [("disk", 31 - more.recompute_to)]
    assert more.score <= fast.score * (1 + 1e-9)
    # a trailing split (its rest computes no cached page) reads through the slow pages: the split is lost to
    # recomputing, the one case where a cached page more raises the winning score
    trailing = plan_restore(prompt_tokens=48 * 64 + 40, page_tokens=64, page_bytes=64 * 128 * KB, host_pages=0,
                            store_segments=[("disk", 31), ("cluster", 4)], tiers=tiers, prefill=pm, overlap=True,
                            trail=True)
    assert trailing.kind == "recompute" and trailing.candidates["split"] > 3 * more.candidates["split"]
    assert trailing.score > more.score


@pytest.mark.parametrize("rate,latency", [(-2.0, 0.0), (math.nan, 0.0), (-math.inf, 0.0), (math.inf, 0.0),
                                          (1.0, -1e-3), (1.0, math.nan), ("1", 0.0), (True, 0.0)])
def test_a_tier_figure_that_is_no_figure_is_refused_by_name(rate, latency):
    bad = {"disk": TierEstimate("disk", read_GBps=rate, read_latency_s=latency, source="probe")}
    with pytest.raises(InvalidArgumentError, match="`tiers`.*'disk'"):
        plan_restore(prompt_tokens=30 * 64, page_tokens=64, page_bytes=64 * 128 * KB, host_pages=0,
                     store_segments=[("disk", 29)], tiers=bad, prefill=model())
    # 0 GB/s is the documented "nothing known yet": planned, as a free read that measures the tier
    ok = plan_restore(prompt_tokens=30 * 64, page_tokens=64, page_bytes=64 * 128 * KB, host_pages=0,
                      store_segments=[("disk", 29)], tiers=disk(0.0), prefill=model())
    assert ok.kind == "load"


# ---------------------------------------------------------------------------------------------- the transformers cache
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvtier  # noqa: E402
from kvtier.integrations.transformers import KVTier, cache_kwarg  # noqa: E402

PS = 16


def llama(device="cpu", dtype=torch.float32, layers=3):
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def tokens(n, seed=1):
    return torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, n=4):
    return model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=n, do_sample=False, pad_token_id=0)


def stored_then_dropped(tier, model, ids):
    """Serve ``ids`` once (its pages go to the host pool and the store), then drop the host copies: the next
    restore of that prefix can only come from the disk. Returns the host KV (every layer) it computed."""
    c = tier.cache(ids)
    greedy(model, ids, c, 1)
    kv = [c.host_kv(layer, (ids.shape[1] - 1) // PS * PS) for layer in range(tier.layers)]
    c.release()
    tier.controller.wait_idle()
    assert tier.drop_host_copies() > 0
    return kv


#: The deadlines of the restores and write-throughs whose execution these tests check: a hang guard, not the
#: defaults ("auto": from 0.5 s; writes: 2 s) that a loaded machine can make a read or a write miss (a read
#: past its deadline is recomputed, a write given up is never stored: other counts than the plan's)
GUARD_S = 60.0


def guarded(model, **kw):
    """A KVTier whose store reads and writes have :data:`GUARD_S` for deadlines."""
    tier = KVTier(model, restore_deadline=GUARD_S, **kw)
    tier.controller.write_deadline_s = GUARD_S
    return tier


def with_disk_at(tier, gbps):
    """The planner sees the disk at ``gbps`` (its measurements replaced, for a decision that does not depend on
    this machine's disk)."""
    real = tier.controller.measured

    def measured():
        out = real()
        out["disk"] = TierEstimate("disk", read_GBps=gbps, source="probe")
        return out

    tier.controller.measured = measured


def test_a_learned_tier_calibrates_without_counting(tmp_path):
    with KVTier(llama(), model_id="t/cal", page_size=PS, host_tokens=4096, store_dir=tmp_path) as tier:
        assert tier.controller.prefill.learned and tier.controller.prefill.coefficients() is not None
        assert tier.stats.caches == 0 and tier.stats.computed_tokens == 0 and tier.controller.stats.backed_up_pages == 0
        assert tier.controller.measured()["disk"].source == "probe" and tier.host.available_size() == tier.host.size


def test_calibration_forwards_never_reallocate_their_window(tmp_path, monkeypatch):
    """The calibration's caches are made for prompts longer than their first forward: their device windows are
    made for the whole prompt, so the timed forwards on a context never reallocate the slots and reload the layers
    (a reallocation inside a timed forward would teach the prefill model its cost)."""
    from kvtier.integrations.transformers.window import DeviceWindow

    made, allocs = [], []
    init, alloc = DeviceWindow.__init__, DeviceWindow._alloc
    monkeypatch.setattr(DeviceWindow, "__init__", lambda self, *a: (made.append(1), init(self, *a))[1])
    monkeypatch.setattr(DeviceWindow, "_alloc", lambda self, tokens: (allocs.append(tokens), alloc(self, tokens))[1])
    with KVTier(llama(), model_id="t/cal-window", page_size=PS, host_tokens=4096, store_dir=tmp_path) as tier:
        tier.calibrate([8 * PS, 32 * PS])
        assert made and len(allocs) == len(made)  # one allocation per window: none grew


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_split_restore_recomputes_the_head_while_the_tail_loads(tmp_path, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = llama(device, dtype)
    ids = tokens(40 * PS + 5)
    # a prefill of 1 ms per token and a disk that reads a token's KV in 2 ms: the head (about two thirds) is
    # recomputed while the tail loads (the decision is fixed; the execution is what this test checks)
    with guarded(model, model_id="t/split", page_size=PS, host_tokens=4096, store_dir=tmp_path,
                 prefill=PrefillModel((0.0, 1e-3, 0.0, 0.0))) as tier:
        want = greedy(model, ids, DynamicCache(config=model.config))
        kv = stored_then_dropped(tier, model, ids)
        written = tier.page_store.get_stats()["bytes_written"]
        with_disk_at(tier, tier.controller.page_bytes / PS / 2e-3 / 1e9)
        c = tier.cache(ids)
        p = c.plan
        assert p.kind == "split" and 24 <= p.recompute_to <= 30 and p.load_to == 40, p
        assert c.recomputed_tokens == p.recompute_to * PS and c.restored_store_pages == 40 - p.recompute_to
        assert c.restored_tokens == c.restored_store_pages * PS and c.get_seq_length() == 40 * PS
        # the loaded tail is the stored bytes, every layer
        for layer in range(tier.layers):
            k, v = c.host_kv(layer, 40 * PS)
            lo = p.recompute_to * PS
            assert torch.equal(k[:, :, lo:], kv[layer][0][:, :, lo:]) and torch.equal(v[:, :, lo:], kv[layer][1][:, :, lo:])
        got = greedy(model, ids, c)
        assert torch.equal(got, want)  # the same tokens as recomputing everything
        tier.controller.wait_idle()
        # the head's pages were already stored: not written again
        assert tier.page_store.get_stats()["bytes_written"] == written
        tier.synchronize()
        st = tier.controller.planner_stats.as_dict()
        assert st["plans"]["split"] == 1 and st["observed"] >= 1 and st["tokens_loaded"]["disk"] == (40 - p.recompute_to) * PS


def test_slow_and_fast_disks_are_recomputed_and_loaded(tmp_path):
    model = llama()
    ids = tokens(30 * PS + 3)
    # a fixed prefill of 1 ms per token (a learned one is timed on this machine: a loaded one can fit it so
    # that the load looks no faster; test_a_learned_tier_calibrates_without_counting covers the calibration)
    with guarded(model, model_id="t/speeds", page_size=PS, host_tokens=4096, store_dir=tmp_path,
                 prefill=PrefillModel((0.0, 1e-3, 0.0, 0.0))) as tier:
        want = greedy(model, ids, DynamicCache(config=model.config))
        stored_then_dropped(tier, model, ids)
        with_disk_at(tier, 1e-6)
        slow = tier.cache(ids)
        assert slow.plan.kind == "recompute" and slow.restored_tokens == 0 and slow.get_seq_length() == 0
        assert torch.equal(greedy(model, ids, slow), want)
        slow.release()
        tier.controller.wait_idle()
        tier.drop_host_copies()
        with_disk_at(tier, 1e6)
        fast = tier.cache(ids)
        assert fast.plan.kind == "load" and fast.restored_store_pages == 30, str(fast.plan.as_dict())
        assert torch.equal(greedy(model, ids, fast), want)


def test_a_prompt_that_differs_inside_the_restored_prefix_is_refused(tmp_path):
    """KVTier.cache(a) restores a's prefix; generate(b) feeds only b's tokens after it, so without a check b
    would be answered from a's KV (the README promises a refusal)."""
    model = llama()
    a = tokens(6 * PS + 3)
    b = a.clone()
    b[0, 5] = (b[0, 5] + 1) % 256 or 1  # one token differs, inside the first page
    with KVTier(model, model_id="t/mismatch", page_size=PS, host_tokens=2048, restore="all") as tier:
        greedy(model, a, tier.cache(a), 1)
        c = tier.cache(a)
        assert c.restored_tokens == 6 * PS
        with pytest.raises(kvtier.InvalidArgumentError, match="input_ids"):
            greedy(model, b, c)
        c2 = tier.cache(a)  # the same ids pass, and a continuation of them too
        out = greedy(model, a, c2)
        assert torch.equal(greedy(model, out, c2, 2)[:, : out.shape[1]], out)
        with pytest.raises(kvtier.InvalidArgumentError, match="input_ids"):
            with torch.no_grad():
                model(b[:, :PS], **{cache_kwarg(model): tier.cache(a)})  # a direct forward of other tokens is refused too
        with pytest.raises(kvtier.InvalidArgumentError, match="restore"):
            KVTier(model, model_id="x", restore="some")
        with pytest.raises(kvtier.InvalidArgumentError, match="prefill"):
            KVTier(model, model_id="x", prefill="fast")


def test_the_restore_mode_can_be_switched_between_requests(tmp_path):
    """``KVTier.restore`` is read by every cache(): a disk the planner finds too slow is recomputed under
    "plan", and every page is loaded under "all" once the mode is switched on the same tier; a bad mode is
    refused by name and leaves the mode as it was."""
    model = llama()
    ids = tokens(12 * PS + 3)
    with guarded(model, model_id="t/switch", page_size=PS, host_tokens=4096, store_dir=tmp_path,
                 prefill=PrefillModel.fixed(1e9, name="prefill")) as tier:
        stored_then_dropped(tier, model, ids)
        with_disk_at(tier, 1e-6)  # far slower than the (near free) prefill: the planner recomputes
        assert tier.restore == "plan"
        c = tier.cache(ids)
        assert c.plan is not None and c.plan.kind == "recompute" and c.restored_tokens == 0
        c.release()
        tier.controller.wait_idle()
        tier.drop_host_copies()
        tier.restore = "all"
        c = tier.cache(ids)
        assert c.plan is None and c.restored_store_pages == 12 and c.restored_tokens == 12 * PS
        c.release()
        with pytest.raises(kvtier.InvalidArgumentError, match="restore"):
            tier.restore = "some"
        assert tier.restore == "all"
