"""The transformers cache never serves KV computed for something other than what its key says: each test is a
way a cache could (inference mode, masks, positions, crops, shared pages, calls it cannot honour)."""

import tempfile

import functools

import pytest
import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvtier._errors import InvalidArgumentError
from kvtier.integrations.transformers import KVTier as _KVTier, cache_kwarg

# These tests pin the restore mechanics (which pages come back, from where): every cached page is taken
# (restore="all"), so no decision depends on timing; tests/test_restore_planning.py covers the planner.
KVTier = functools.partial(_KVTier, restore="all")  # noqa: E402

PS = 8
TINY = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)


def llama(seed=0, **kw):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **kw})).eval()


def prompt(n, seed=1):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def gen(model, ids, cache, n=5, **kw):
    out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=n, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.logits)


def same(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def reused(model, ids, tokens, n=5):
    """transformers reusing the first ``tokens`` of ``ids``' own KV (a cropped DynamicCache)."""
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): ref})
    ref.crop(tokens - ids.shape[1])
    return gen(model, ids, ref, n)


@pytest.mark.parametrize("how", ["padded mask", "shifted positions"])
def test_kv_computed_at_other_positions_is_never_kept(how):
    m, ids = llama(), prompt(33)
    with KVTier(m, model_id="t", page_size=PS, host_tokens=512) as tier:
        if how == "padded mask":
            mask = torch.ones_like(ids)
            mask[0, :4] = 0
            gen(m, ids, tier.cache(ids), attention_mask=mask)
        else:
            with torch.no_grad():
                m(ids, **{cache_kwarg(m): tier.cache(ids)}, position_ids=torch.arange(100, 133)[None])
        assert tier.stats.adopted_pages == 0 and tier.stats.unverified_sequences == 1
        again = tier.cache(ids)
        assert again.restored_tokens == 0
        assert same(gen(m, ids, again), gen(m, ids, DynamicCache(config=m.config)))


def test_a_local_checkpoint_needs_a_model_id():
    d = tempfile.mkdtemp()
    llama().save_pretrained(d)
    m = LlamaForCausalLM.from_pretrained(d).eval()
    with pytest.raises(InvalidArgumentError, match="model_id"):
        KVTier(m, page_size=PS, host_tokens=512)
    KVTier(m, model_id="mine/v1", page_size=PS, host_tokens=512).close()


def test_switching_attention_implementation_is_refused():
    m, ids = llama(), prompt(33)
    with KVTier(m, model_id="t", page_size=PS, host_tokens=512) as tier:
        gen(m, ids, tier.cache(ids))
        m.set_attn_implementation("eager" if tier.attn_implementation != "eager" else "sdpa")
        with pytest.raises(InvalidArgumentError, match="attention implementation"):
            tier.cache(ids)


def test_eager_and_sdpa_do_not_share_pages():
    root, ids = tempfile.mkdtemp(), prompt(33)
    m = llama(attn_implementation="sdpa")
    with KVTier(m, model_id="t", page_size=PS, host_tokens=512, store_dir=root) as tier:
        gen(m, ids, tier.cache(ids))
        assert tier.stats.adopted_pages == 4
    with KVTier(m, model_id="t", page_size=PS, host_tokens=512, store_dir=root) as tier:
        assert tier.cache(ids).restored_tokens == 32  # the same implementation finds them
    m = llama(attn_implementation="eager")
    with KVTier(m, model_id="t", page_size=PS, host_tokens=512, store_dir=root) as tier:
        assert tier.cache(ids).restored_tokens == 0


def test_encoder_decoder_and_multimodal_models_are_refused():
    torch.manual_seed(0)
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        encoder_layers=1, decoder_layers=2, d_model=32, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=128)).eval()
    with pytest.raises(InvalidArgumentError, match="encoder-decoder or multimodal"):
        KVTier(bart, model_id="bart", page_size=PS, host_tokens=512)


def test_a_cache_fed_another_prompt_is_an_error():
    m = llama()
    with KVTier(m, model_id="t", page_size=PS, host_tokens=512) as tier:
        gen(m, prompt(33, seed=1), tier.cache(prompt(33, seed=1)))
        c = tier.cache(prompt(33, seed=1))
        assert c.restored_tokens == 32
        with pytest.raises(InvalidArgumentError, match="input_ids"):
            gen(m, prompt(33, seed=2), c)


def test_restored_pages_survive_host_pressure_and_the_sequence_keeps_adding_pages():
    m, p0 = llama(), prompt(41, seed=0)
    with KVTier(m, model_id="t", page_size=PS, host_tokens=96) as tier:
        a = tier.cache(p0)
        gen(m, p0, a, 3)
        a.release()
        b = tier.cache(p0)  # only b references the pages now
        assert b.restored_tokens == 40
        for s in range(1, 4):  # other prompts fill the small host pool: eviction must spare b's pages
            ids = prompt(33, seed=s)
            x = tier.cache(ids)
            gen(m, ids, x, 2)
            x.release()
        assert tier.controller.stats.host_evictions > 0
        adopted = tier.stats.adopted_pages
        assert same(gen(m, p0, b, 12), reused(m, p0, b.restored_tokens, 12))
        assert tier.stats.adopted_pages > adopted  # the restored sequence's new full pages are kept too


def test_bad_configuration_names_the_users_argument():
    m = llama()
    with pytest.raises(InvalidArgumentError, match="store_dir"):
        KVTier(m, model_id="t", store_dir="")
    with pytest.raises(InvalidArgumentError, match="store_capacity_bytes"):
        KVTier(m, model_id="t", page_size=PS, host_tokens=512, store_dir=tempfile.mkdtemp(), store_capacity_bytes=4096)
    with pytest.raises(InvalidArgumentError, match="host_tokens"):
        KVTier(m, model_id="t", page_size=PS, host_tokens=10**13)
    with KVTier(m, model_id="t", page_size=PS, host_tokens=512) as tier:
        ids = prompt(9)
        with pytest.raises(InvalidArgumentError, match="batch size 1"):
            gen(m, ids, tier.cache(ids), num_beams=2)


def test_generate_under_inference_mode_restores_exactly():
    """An engine or script under ``torch.inference_mode()``: pages stored and restored inside it (index
    tensors without a version counter) give the same tokens and logits as a DynamicCache."""
    m = llama()
    ids = prompt(40)
    with torch.inference_mode():
        want = gen(m, ids, DynamicCache(config=m.config))
    with tempfile.TemporaryDirectory() as d, KVTier(m, model_id="t/llama", page_size=PS, window=2,
                                                     host_tokens=512, store_dir=d) as tier:
        with torch.inference_mode():
            first = gen(m, ids, tier.cache(ids))
            second = gen(m, ids, tier.cache(ids))  # restores the stored prefix
        assert tier.stats.restored_pages > 0
    assert same(first, want) and same(second, want)


def test_the_version_warning_fires_only_outside_the_tested_releases(monkeypatch):
    """TESTED_TRANSFORMERS holds every release the tests run with (the engines' environments and the dev one):
    no warning there (pytest makes one an error), a warning naming the tested releases under any other."""
    from kvtier.integrations import transformers as integration

    assert transformers.__version__ in integration.TESTED_TRANSFORMERS, transformers.__version__
    assert {"5.19.0", "5.20.2", "5.24.0"} <= integration.TESTED_TRANSFORMERS
    m = llama()
    KVTier(m, model_id="t", page_size=PS, host_tokens=512).close()
    monkeypatch.setattr(integration, "TESTED_TRANSFORMERS", frozenset({"5.9.0", "5.10.1"}))
    with pytest.warns(UserWarning, match=rf"tested with transformers 5\.9\.0, 5\.10\.1; this is {transformers.__version__}"):
        KVTier(m, model_id="t", page_size=PS, host_tokens=512).close()
