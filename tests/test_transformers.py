"""kvtier as a transformers cache (kvtier.integrations.transformers), on tiny random-weight models on the CPU:
the same tokens and logits as transformers' default cache, bit for bit; prefixes restored from the host
pool and from the store (counters prove it) with outputs still equal; windows of 1 and 2 layers; a
different model, config or dtype misses; bad configuration is one clear error."""

import errno

import functools

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import kvtier  # noqa: E402
from kvtier import testing  # noqa: E402
from kvtier.integrations.transformers import KVTier as _KVTier, KvtierCache, cache_kwarg  # noqa: E402

# These tests pin the restore mechanics (which pages come back, from where): every cached page is taken
# (restore="all"), so no decision depends on timing; tests/test_restore_planning.py covers the planner.
KVTier = functools.partial(_KVTier, restore="all")  # noqa: E402

PS = 8
TINY = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)


def llama(dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **kw})).to(dtype).eval()


@pytest.fixture(scope="module")
def model():
    return llama()


def prompt(n, seed=1, vocab=128):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def gen(model, ids, cache, n=5):
    out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def default(model):
    return DynamicCache(config=model.config)


def reused(model, first, second, tokens, n=5):
    """What transformers gives when it reuses the first ``tokens`` of ``first``'s KV for ``second`` (a
    DynamicCache of ``first``, cropped): the bit-exact reference for a restored prefix. (Recomputing ``second``
    from scratch gives the same tokens, but its logits may differ in the last bits: the prefix's KV is then
    computed in another chunk of rows.)"""
    ref = default(model)
    with torch.no_grad():
        model(first, **{cache_kwarg(model): ref})
    ref.crop(tokens - first.shape[1])
    return gen(model, second, ref, n)


@pytest.mark.parametrize("window", [1, 2, 3])
def test_generate_equals_the_default_cache_bit_for_bit(model, window):
    ids = prompt(37)
    with KVTier(model, model_id="test/llama", page_size=PS, window=window, host_tokens=512) as tier:
        cache = tier.cache(ids)
        assert isinstance(cache, DynamicCache) and cache.restored_tokens == 0
        got = gen(model, ids, cache)
        assert same(got, gen(model, ids, default(model)))
        # the window: `window` slots on the device, every layer's load prefetched (none waited for)
        assert len(cache._window.k_slots) == window and len({id(t) for t in cache._window.k_buffer}) == window
        assert tier.stats.on_demand_loads == 0
        # after the prefill layer 0 is loaded for the next step, then each of the 4 decode steps loads the
        # layers (the last step, for a step that never comes) that share their slot (w=2: layer 1 has slot 1
        # to itself); none with every layer resident
        assert tier.stats.layer_loads == {1: 1 + 4 * 3, 2: 1 + 4 * 2, 3: 0}[window]
        assert tier.stats.adopted_pages == (37 + 4) // PS  # the full pages of what the model was fed


def test_model_forward_and_the_deprecated_kwarg(model):
    ids = prompt(30)
    with KVTier(model, model_id="test/llama", page_size=PS, window=1, host_tokens=512) as tier:
        cache, ref = tier.cache(ids), default(model)
        with torch.no_grad():
            for chunk in (ids[:, :11], ids[:, 11:24], ids[:, 24:]):
                a = model(chunk, past_key_values=cache).logits
                b = model(chunk, **{cache_kwarg(model): ref}).logits
                assert torch.equal(a, b)
        assert cache.get_seq_length() == 30


def test_second_call_restores_the_shared_prefix_from_the_host(model):
    p1 = prompt(37)
    p2 = torch.cat([p1[:, :30], prompt(9, seed=2)], 1)
    with KVTier(model, model_id="test/llama", page_size=PS, window=2, host_tokens=512) as tier:
        gen(model, p1, tier.cache(p1))
        computed = tier.stats.computed_tokens
        cache = tier.cache(p2)
        assert cache.restored_tokens == 24 and cache.restored_host_pages == 3 and cache.restored_store_pages == 0
        got = gen(model, p2, cache)
        assert tier.stats.computed_tokens - computed == 39 - 24 + 4  # only the rest of the prompt was computed
        assert tier.stats.on_demand_loads == 0
        # the same as transformers reusing the same prefix KV (a DynamicCache of p1, cropped) ...
        ref = default(model)
        with torch.no_grad():
            model(p1, **{cache_kwarg(model): ref})
        ref.crop(24 - 37)
        assert same(got, gen(model, p2, ref))
        # ... and the same tokens as recomputing everything
        assert torch.equal(got[0], gen(model, p2, default(model))[0])


def test_restore_from_the_store_and_from_a_new_process(model, tmp_path):
    p1 = prompt(45)
    p2 = torch.cat([p1[:, :40], prompt(5, seed=3)], 1)
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512, store_dir=tmp_path) as tier:
        want = gen(model, p1, tier.cache(p1))
        tier.controller.wait_idle()
        assert tier.drop_host_copies() > 0
        cache = tier.cache(p1)
        assert cache.restored_store_pages == 5 and cache.restored_host_pages == 0
        got = gen(model, p1, cache)
        assert same(got, reused(model, p1, p1, 40)) and torch.equal(got[0], want[0])
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512, store_dir=tmp_path) as tier:
        cache = tier.cache(p2)
        assert cache.restored_store_pages == 5  # 40 tokens: five full pages of p1
        assert same(gen(model, p2, cache), reused(model, p1, p2, 40))


def test_a_failed_or_damaged_store_page_is_a_miss(model, tmp_path):
    p1 = prompt(33)
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512, store_dir=tmp_path) as tier:
        want = gen(model, p1, tier.cache(p1))
        tier.controller.wait_idle()
        tier.drop_host_copies()
        testing.clear_faults()
        try:
            testing.inject_fault("data_read", "error", errno=errno.EIO, times=None)
            cache = tier.cache(p1)
        finally:
            testing.clear_faults()
        assert cache.restored_tokens == 0 and tier.controller.stats.prefetch_misses > 0
        assert same(gen(model, p1, cache), want)  # recomputed: exactly the first call
    # a torn write: the page's checksum fails on the read, so it is recomputed
    with KVTier(model, model_id="test/llama-torn", page_size=PS, host_tokens=512, store_dir=tmp_path) as tier:
        try:
            testing.inject_fault("data_write", "torn", times=None)
            gen(model, p1, tier.cache(p1))
            tier.controller.wait_idle()
        finally:
            testing.clear_faults()
        tier.drop_host_copies()
        cache = tier.cache(p1)
        assert cache.restored_tokens == 0 and tier.page_store.get_stats()["corrupt_reads"] > 0
        assert same(gen(model, p1, cache), want)


def test_another_model_config_dtype_or_id_misses(model, tmp_path):
    p1 = prompt(33)
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512, store_dir=tmp_path) as tier:
        gen(model, p1, tier.cache(p1))
    assert_restores = []
    for other, mid in ((model, "test/llama"), (llama(rope_theta=5000.0), "test/llama"), (llama(torch.bfloat16), "test/llama"),
                       (llama(num_hidden_layers=2), "test/llama"), (model, "test/other-weights")):
        with KVTier(other, model_id=mid, page_size=PS, host_tokens=512, store_dir=tmp_path) as tier:
            assert_restores.append(tier.cache(p1).restored_tokens)
    assert assert_restores == [32, 0, 0, 0, 0]
    with KVTier(model, model_id="test/llama", page_size=16, host_tokens=512, store_dir=tmp_path) as tier:
        assert tier.cache(p1).restored_tokens == 0  # another page size: another namespace


ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    # MLA: transformers caches DeepSeek-V3's compressed latent (K: kv_lora_rank) and rope key (V: qk_rope_head_dim)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1)),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_other_architectures(arch):
    conf, cls, kw = ARCHS[arch]
    torch.manual_seed(0)
    m = getattr(transformers, cls)(getattr(transformers, conf)(**{**TINY, "num_hidden_layers": 2, **kw})).eval()
    p1 = prompt(29)
    p2 = torch.cat([p1[:, :20], prompt(6, seed=4)], 1)
    with KVTier(m, model_id=f"test/{arch}", page_size=PS, window=1, host_tokens=512) as tier:
        if arch == "deepseek_v3":
            assert (tier.heads, tier.k_dim, tier.v_dim) == (1, 32, 8)  # asymmetric: latent and rope key
        assert same(gen(m, p1, tier.cache(p1), 3), gen(m, p1, DynamicCache(config=m.config), 3))
        cache = tier.cache(p2)
        assert cache.restored_tokens == 16
        ref = DynamicCache(config=m.config)
        with torch.no_grad():
            m(p1, **{cache_kwarg(m): ref})
        ref.crop(16 - 29)
        assert same(gen(m, p2, cache, 3), gen(m, p2, ref, 3))


def test_crop_into_a_shared_page_copies_it(model):
    p1 = prompt(33)
    with KVTier(model, model_id="test/llama", page_size=PS, window=2, host_tokens=512) as tier:
        gen(model, p1, tier.cache(p1))
        cache = tier.cache(p1)
        assert cache.restored_tokens == 32
        cache.crop(-5)  # 27 tokens: page 3 is shared and gets written again
        assert cache.table.keys[3] is None and cache.table.keys[2] is not None
        ref = default(model)
        with torch.no_grad():
            model(p1, **{cache_kwarg(model): ref})
        ref.crop(27 - 33)
        assert same(gen(model, p1, cache), gen(model, p1, ref))
        # the shared page itself was not modified: a fresh restore still matches
        again = tier.cache(p1)
        assert again.restored_tokens == 32
        assert same(gen(model, p1, again), reused(model, p1, p1, 32))


def test_tokens_the_hook_did_not_see_are_never_persisted(model):
    ids = prompt(20)
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512) as tier:
        cache = tier.cache(ids)
        with torch.no_grad():
            model(inputs_embeds=model.get_input_embeddings()(ids), **{cache_kwarg(model): cache})
        assert tier.stats.unverified_sequences == 1 and tier.stats.adopted_pages == 0
        assert tier.cache(ids).restored_tokens == 0


def test_bad_configuration_is_one_clear_error(model, tmp_path):
    cases = [
        (dict(model_id="x", page_size=0), "page_size"),
        (dict(model_id="x", window=0), "window"),
        (dict(model_id="x", window=4), "window"),
        (dict(model_id="x", window="all"), "window"),
        (dict(model_id="x", window=True), "window"),
        (dict(model_id="x", window=2.0), "window"),
        (dict(model_id="x", page_size=16, host_tokens=20), "host_tokens"),
        (dict(), "model_id"),
        (dict(model_id=""), "model_id"),
        (dict(model_id="x", store_dir=3), "store_dir"),
        (dict(model_id="x", cluster="127.0.0.1:50051"), "cluster"),
        (dict(model_id="x", store_dir=".", store_capacity_bytes=0), "store_capacity_bytes"),
        (dict(model_id="x", pin_memory="yes"), "pin_memory"),
    ]
    for kw, name in cases:
        with pytest.raises(kvtier.InvalidArgumentError, match=f"`{name}`"):
            KVTier(model, **kw)
    with pytest.raises(kvtier.InvalidArgumentError, match="`model`"):
        KVTier(object(), model_id="x")
    sliding = transformers.MistralForCausalLM(transformers.MistralConfig(**{**TINY, "sliding_window": 8}))
    with pytest.raises(kvtier.InvalidArgumentError, match="full attention"):
        KVTier(sliding, model_id="x")
    with KVTier(model, model_id="x", page_size=PS, host_tokens=64) as tier:
        for bad in ([], "abc", torch.zeros(2, 5, dtype=torch.long), [1.5]):
            with pytest.raises(kvtier.InvalidArgumentError, match="token_ids"):
                tier.cache(bad)
        with pytest.raises(kvtier.InvalidArgumentError, match="key_states"):
            model.generate(prompt(9).repeat(2, 1), **{cache_kwarg(model): tier.cache(prompt(9))}, max_new_tokens=1, do_sample=False,
                           pad_token_id=0)
        with pytest.raises(kvtier.KvtierError, match="host_tokens"):
            gen(model, prompt(120), tier.cache(prompt(120)), 1)  # 120 tokens in a pool of about 64
    with pytest.raises(kvtier.ClosedError):
        tier.cache(prompt(9))


def test_host_pages_come_back_when_a_cache_goes(model):
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=64) as tier:
        free = tier.host.available_size()
        for seed in range(5):  # each prompt needs 5 of the pool's 8 pages: only works if they are given back
            ids = prompt(40, seed=seed)
            cache = tier.cache(ids)
            gen(model, ids, cache, 1)
            del cache
        assert tier.host.available_size() <= free
        c = tier.cache(prompt(40, seed=9))
        gen(model, prompt(40, seed=9), c, 1)
        c.release()
        assert isinstance(c, KvtierCache) and c.get_seq_length() == 0


@pytest.mark.cuda
def test_window_streams_on_the_gpu_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = llama(torch.bfloat16, num_hidden_layers=8).cuda()
    ids = (prompt(300) % 127 + 1).cuda()  # no token equals pad_token_id=0: generate would mask it as padding
    with KVTier(m, model_id="test/llama", page_size=16, window=2, host_tokens=2048) as tier:
        cache = tier.cache(ids)
        assert same(gen(m, ids, cache), gen(m, ids, DynamicCache(config=m.config)))
        assert tier.stats.on_demand_loads == 0 and len(cache._window.k_slots) == 2
        every_layer = 8 * 2 * 300 * 2 * 16 * 2  # 8 layers of K and V: 300 tokens x 2 heads x 16 dims, bf16
        assert cache.window_bytes < every_layer / 2  # two slots (with some room to grow), not eight layers
        stored = [cache.host_kv(layer, 288) for layer in range(8)]
        again = tier.cache(ids)
        assert again.restored_tokens == 288
        for layer in range(8):  # the restored prefix is the bytes the first call computed
            assert all(torch.equal(x, y) for x, y in zip(again.host_kv(layer, 288), stored[layer])), layer
        # On a GPU the reference for what follows a restore is recomputation's tokens: kernels chosen for other
        # shapes differ in the last bits of the logits (the bench compares those with transformers reusing the
        # same prefix KV, and they are equal there).
        got, want = gen(m, ids, again), gen(m, ids, DynamicCache(config=m.config))
        assert torch.equal(got[0], want[0]), (
            f"restored generate picked other tokens (logits differ by up to {float((got[1] - want[1]).abs().max())})")
        assert tier.stats.on_demand_loads == 0


def test_an_automatic_window_keeps_what_the_device_memory_holds(model, monkeypatch):
    """window="auto" (the default): every layer on the device when their slots take at most half of its free
    memory as the sequence starts, else as many as that half holds (at least 2), decided per sequence; outputs
    bit-exact either way."""
    from kvtier.integrations.transformers import state as ts
    from kvtier.integrations.transformers.window import slot_bytes

    ids = prompt(37)
    want, again = gen(model, ids, default(model)), reused(model, ids, ids, 32)
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512) as tier:
        assert tier.window == "auto"
        cache = tier.cache(ids)
        assert cache.resident_layers == 3 and tier.stats.resident_layers == 3
        assert same(gen(model, ids, cache), want)
        assert len(cache._window.k_slots) == 3 and tier.stats.layer_loads == 0  # nothing streamed
        layer = slot_bytes(37, 2, 16, 16, torch.float32, PS)
        for free, layers in ((2 * layer, 2), (int(4.5 * layer), 2), (6 * layer, 3), (0, 2)):
            monkeypatch.setattr(ts, "free_bytes", lambda device, free=free: free)  # the device's memory, now
            c = tier.cache(ids)
            assert c.resident_layers == layers and tier.stats.resident_layers == layers, (free, layers)
            assert c.restored_tokens == 32 and same(gen(model, ids, c), again)  # (its prefix from the host pool)
            assert len(c._window.k_slots) == layers
            c.release()
    # a fixed window is kept whatever the memory
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512, window=1) as tier:
        assert tier.cache(ids).resident_layers == 1


def test_every_layer_resident_moves_each_forward_in_one_call(model, monkeypatch):
    """With every layer resident a forward's backups (and a restore's loads) are one call for every layer, not
    one a layer; with a window of 2 they go layer by layer. Outputs bit-exact and pages restored either way."""
    from kvtier.integrations.transformers.window import LayerBatch

    ids = prompt(37)
    for window, per_layer, one_call in ((3, False, True), (2, True, True), (3, True, False)):
        if not one_call:  # (as on CUDA, until the one-call copies have run on a GPU)
            monkeypatch.setattr(LayerBatch, "one_call_devices", ())
        with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512, window=window) as tier:
            st, calls = tier._state, {"layer": 0, "all": 0}
            real, real_all = st.transfer, st.transfer_layers

            def one(*a, calls=calls, real=real, **k):
                calls["layer"] += 1
                return real(*a, **k)

            def every(*a, calls=calls, real_all=real_all, **k):
                calls["all"] += 1
                return real_all(*a, **k)

            monkeypatch.setattr(st, "transfer", one)
            monkeypatch.setattr(st, "transfer_layers", every)
            assert same(gen(model, ids, tier.cache(ids), 3), gen(model, ids, default(model), 3))
            forwards = 3  # the prompt and two decode steps (the third token needs no forward after it); with a
            # window of 2: 3 backups a forward, layer 0's load after the prompt and 2 loads a decode step; with
            # every layer resident layer by layer: 3 backups a forward and no load
            loads = 0 if window == 3 else 1 + 2 * (forwards - 1)
            assert calls == ({"layer": 3 * forwards + loads, "all": 0} if per_layer else
                             {"layer": 0, "all": forwards}), (window, calls)
            calls.update(layer=0, all=0)
            again = tier.cache(ids)  # restored from the host pool: its 4 pages loaded in one call
            assert again.restored_tokens == 32 and same(gen(model, ids, again, 3), reused(model, ids, ids, 32, 3))
            if not per_layer:
                assert calls == {"layer": 0, "all": 1 + forwards}, calls
            elif window == 3:  # every layer's load, then 3 backups a forward
                assert calls == {"layer": 3 + 3 * forwards, "all": 0}, calls
            again.release()
            monkeypatch.undo()


@pytest.mark.cuda
def test_every_layer_resident_on_the_gpu_moves_in_one_call_cuda(monkeypatch):
    """window="auto" on a GPU keeps every layer of a small model: each forward's backups go in one call (where
    CUDA is in LayerBatch.one_call_devices; else layer by layer), every layer's host pages hold the bytes
    transformers computed, and a restore's loads fill every slot with the stored bytes before the model reads
    them (each layer waits for its own layer's copies)."""
    from kvtier.integrations.transformers.window import LayerBatch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = llama(torch.bfloat16, num_hidden_layers=8).cuda()
    ids = (prompt(300) % 127 + 1).cuda()
    ref = DynamicCache(config=m.config)
    want = gen(m, ids, ref)
    with KVTier(m, model_id="test/llama", page_size=16, host_tokens=2048) as tier:
        st, calls = tier._state, {"layer": 0, "all": 0}
        real, real_all = st.transfer, st.transfer_layers

        def one(*a, **k):
            calls["layer"] += 1
            return real(*a, **k)

        def every(*a, **k):
            calls["all"] += 1
            return real_all(*a, **k)

        monkeypatch.setattr(st, "transfer", one)
        monkeypatch.setattr(st, "transfer_layers", every)
        cache = tier.cache(ids)
        assert cache.resident_layers == 8
        assert same(gen(m, ids, cache), want)
        # the prompt and 4 decode steps: in one call each, or (CUDA not in LayerBatch.one_call_devices) 8 calls
        one_call = "cuda" in LayerBatch.one_call_devices
        assert calls == ({"layer": 0, "all": 5} if one_call else {"layer": 40, "all": 0}), calls
        for layer in range(8):
            k, v = cache.host_kv(layer, 288)
            assert torch.equal(k, ref.layers[layer].keys[:, :, :288].cpu()), layer
            assert torch.equal(v, ref.layers[layer].values[:, :, :288].cpu()), layer
        again = tier.cache(ids)
        assert again.restored_tokens == 288
        assert calls == ({"layer": 0, "all": 6} if one_call else {"layer": 48, "all": 0}), calls
        torch.cuda.current_stream().synchronize()
        for layer in range(8):
            for slot, held in ((again._window.k_slots[layer], ref.layers[layer].keys),
                               (again._window.v_slots[layer], ref.layers[layer].values)):
                got = slot[16 : 16 + 288].transpose(0, 1).unsqueeze(0)
                st.wait(torch.cuda.current_stream(), again._window.loaded[layer])
                torch.cuda.current_stream().synchronize()
                assert torch.equal(got.cpu(), held[:, :, :288].cpu()), layer
        got, want = gen(m, ids, again), gen(m, ids, DynamicCache(config=m.config))
        assert torch.equal(got[0], want[0])


def prompt_then_a_failed_forward(model, tier, ids, more):
    """A cache that computed ``ids``, then a forward of ``more`` that raised at the last layer (its first
    layers ran)."""
    cache = tier.cache(ids)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): cache})

    def boom(*_):
        raise RuntimeError("the last layer failed")

    hook = model.model.layers[-1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="last layer failed"), torch.no_grad():
            model(more, **{cache_kwarg(model): cache})
    finally:
        hook.remove()
    return cache


def test_a_forward_that_raises_midway_then_a_crop_loses_and_touches_nothing(model):
    """Every layer resident: a decode step that raises at the last layer leaves its first layers' backups
    deferred; a crop that gives their page back sends them first (into pages still the sequence's), so the
    sequence goes on bit-exact and another sequence's pages are never written."""
    ids, other_ids = prompt(37), prompt(20, seed=5)
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512, window=3) as tier:
        cache = prompt_then_a_failed_forward(model, tier, ids, ids[:, :1])
        assert cache._batch.deferred is not None and cache.get_seq_length() == 38
        cache.crop(-6)  # 32 tokens: page 4 (rows 32..38, the failed step's row among them) goes back
        other = tier.cache(other_ids)
        gen(model, other_ids, other, 2)  # takes free host pages, page 4's among them
        before = [other.host_kv(layer) for layer in range(3)]
        got = gen(model, ids, cache, 3)
        assert same(got, reused(model, ids, ids, 32, 3))
        after = [other.host_kv(layer) for layer in range(3)]
        assert all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y))


@pytest.mark.parametrize("window", [2, 3])
def test_a_crop_after_a_forward_that_raised_keeps_only_rows_every_layer_has(model, window):
    """A forward of 10 tokens that raises at the last layer, then a crop that would keep 3 of its rows: the
    last layer never computed them, so the crop keeps the 37 tokens every layer holds (it kept the others,
    and a later request restored KV never computed); the sequence then goes on as transformers' own."""
    ids, extra = prompt(37), prompt(10, seed=9)
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512, window=window) as tier:
        cache = prompt_then_a_failed_forward(model, tier, ids, extra)
        cache.crop(-7)  # 47 -> 40 asked; the last layer holds 37
        assert cache.get_seq_length() == 37 and [layer.length for layer in cache.layers] == [37] * 3
        more = torch.cat([ids, extra], 1)
        got = gen(model, more, cache, 3)
        assert same(got, reused(model, ids, more, 37, 3))
        cache.release()
        other = tier.cache(more)  # restores the pages that sequence kept: computed as 37 tokens, then 10
        ref = default(model)
        with torch.no_grad():
            model(ids, **{cache_kwarg(model): ref})
            model(extra, **{cache_kwarg(model): ref})
        ref.crop(40 - more.shape[1])
        assert other.restored_tokens == 40 and same(gen(model, more, other, 3), gen(model, more, ref, 3))


def test_a_layer_of_a_one_call_transfer_waits_for_its_own_events():
    """A slot's next user waits for its own layer of a transfer of every layer (the submission's layer i
    recorded, then that layer's events), not the first layer's; a single layer's transfer waits for index 0."""
    from kvtier.integrations.transformers.state import TierRuntime

    class Sub:
        def __init__(self):
            self.waited = []

        def wait_recorded(self, index):
            self.waited.append(index)

    class Stream:
        def __init__(self):
            self.events = []

        def wait_event(self, ev):
            self.events.append(ev)

    sub, stream = Sub(), Stream()
    pending = [(sub, [f"e{i}a", f"e{i}b"], i) for i in range(4)]
    TierRuntime.wait(stream, pending[2])
    TierRuntime.wait(stream, [pending[3], (sub, ["x"])])
    assert sub.waited == [2, 3, 0] and stream.events == ["e2a", "e2b", "e3a", "e3b", "x"]


def test_free_memory_is_measured_on_the_cpu():
    from kvtier.integrations.transformers.state import free_bytes

    assert 0 < free_bytes(torch.device("cpu")) < 1 << 50


def test_window_slots_grow_and_reload(model):
    ids = prompt(20)
    with KVTier(model, model_id="test/llama", page_size=4, window=1, host_tokens=512) as tier:
        cache = tier.cache(ids)
        got = gen(model, ids, cache, 40)  # past the slots' first size: reallocated, every layer reloaded
        assert tier.stats.on_demand_loads > 0 and cache._window.size >= 59
        assert same(got, gen(model, ids, default(model), 40))


def test_a_restored_prefix_and_many_new_tokens_load_once(model):
    """The window is made for the whole prompt: a host hit followed by more new tokens than the slots' headroom
    (8 pages here) neither reallocates the slots nor loads the restored prefix a second time, layer by layer."""
    p1 = prompt(4 * PS)
    p2 = torch.cat([p1, prompt(12 * PS + 3, seed=4)], 1)
    with KVTier(model, model_id="test/llama", page_size=PS, window="auto", host_tokens=1024) as tier:
        gen(model, p1, tier.cache(p1), 1)
        cache = tier.cache(p2)
        assert cache.restored_host_pages == 4 and cache.resident_layers == tier.layers
        loads = tier.stats.layer_loads
        got = gen(model, p2, cache, 2)
        assert tier.stats.on_demand_loads == 0 and cache._window.layers_version == 1
        assert tier.stats.layer_loads == loads  # (the restore's loads were the only ones)
        assert same(got, reused(model, p1, p2, 4 * PS, 2))


def test_pages_another_cache_kept_first_still_chain_the_keys(model):
    ids = prompt(20)
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512) as tier:
        a, b = tier.cache(ids), tier.cache(ids)  # the same prompt computed twice at once
        gen(model, ids, a, 2)
        seq, _ = gen(model, ids, b, 24)  # b's first pages are already kept (a's): its own stay private
        assert b.table.keys[0] is None and b.table.keys[3] is not None
        c = tier.cache(seq)  # b's later pages were keyed by the whole chain: all restored
        assert c.restored_tokens == (seq.shape[1] - 1) // PS * PS == 40
        # the reference computes what b computed (a prefill, then one token at a time), keeps 40 tokens of it
        ref = default(model)
        assert torch.equal(gen(model, ids, ref, 24)[0], seq)
        ref.crop(40 - seq.shape[1] + 1)
        assert same(gen(model, seq, c, 3), gen(model, seq, ref, 3))
        b.release()
        with pytest.raises(kvtier.ClosedError, match="released"):
            gen(model, seq, b, 1)


def test_a_layers_first_tokens_reach_attention_as_the_model_made_them(model):
    """Like DynamicCache, a layer's first update hands attention the model's own key and value tensors (no
    copy); a later one a contiguous copy of the slot's rows."""
    ids = prompt(2 * PS + 3)
    with KVTier(model, model_id="test/llama", page_size=PS, host_tokens=512) as tier:
        cache = tier.cache(ids)
        k = torch.randn(1, tier.heads, 5, tier.k_dim).to(tier.dtype)
        v = torch.randn(1, tier.heads, 5, tier.v_dim).to(tier.dtype)
        keys, values = cache.update(k, v, 0)
        assert keys is k and values is v
        keys, values = cache.update(k + 1, v + 1, 0)
        assert keys.is_contiguous() and torch.equal(keys[:, :, :5], k) and torch.equal(values[:, :, 5:], v + 1)
        cache.release()


def test_a_model_id_that_would_plant_a_namespace_field_is_refused(model):
    with pytest.raises(kvtier.InvalidArgumentError, match="`model_id`.*sealed=k"):
        KVTier(model, model_id="org/m|sealed=k", page_size=PS, host_tokens=256)
