"""The split restore's tail in flight (kvtier.integrations.transformers.restore), as an adversary breaks it.

Each test says what it exercises; the first ones say what used to go wrong and what holds now.
All run on the CPU (on the CPU ``KVTier.cache`` waits for the tail's read at its first load, but the tail is
still unsettled — private, counted, and checked only at the next forward — until that forward's last layer)."""

import gc

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvtier
from kvtier.integrations.transformers import cache_kwarg
from test_restore_planning import PS, greedy, llama, stored_then_dropped, tokens
from test_restore_tail import PAGES, _fail_reads, _host_pages_in_use, _settled, _split_disk, _tier


def _logits(model, ids, cache, **kw):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache}, **kw).logits


def _want_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, past_key_values=DynamicCache(config=model.config)).logits


def _index_is_backed_by_allocated_pages(tier):
    """Every page the index holds is memory the host pool counts as allocated (and nothing else is)."""
    _settled(tier)
    return _host_pages_in_use(tier) == len(tier.controller.pages)


def _failing_split(tmp_path, monkeypatch, name, model=None, bad=None):
    model = model or llama()
    ids = tokens(PAGES * PS + 5)
    tier = _tier(model, tmp_path, name)
    stored_then_dropped(tier, model, ids)
    _split_disk(tier)
    _fail_reads(monkeypatch, tier, bad)
    return model, ids, tier


# ---------------------------------------------------------------------------------------------- what used to go wrong
@pytest.mark.parametrize("then", ["host_kv", "reset", "crop"])
def test_release_then_another_call_never_adopts_freed_tail_pages(tmp_path, monkeypatch, then):
    """Used to go wrong (now ``release()`` settles the tail first and drops it): ``release()`` gives the tail's private pages back (PageTable.release frees every page whose
    key is None) but leaves ``_tail`` set; a later ``host_kv``/``reset``/``crop`` runs ``_settled`` ->
    ``Restorer.settle_tail``, which hands those FREED pages to the controller's index (``adopt``). The index then
    holds pages the host pool will give to the next allocation: another sequence overwrites them and a
    later restore serves its bytes under these keys (and the eviction of them frees memory twice)."""
    model = llama()
    ids = tokens(PAGES * PS + 5)
    with _tier(model, tmp_path, f"rel-{then}") as tier:
        want = greedy(model, ids, DynamicCache(config=model.config))
        stored_then_dropped(tier, model, ids)
        _split_disk(tier)
        c = tier.cache(ids)
        assert c.plan.kind == "split"
        c.release()
        try:
            if then == "host_kv":
                c.host_kv(0)
            elif then == "reset":
                c.reset()
            else:
                c.crop(-1)
        except kvtier.KvtierError:
            pass  # a clear refusal after release is fine
        ok = _index_is_backed_by_allocated_pages(tier)
        # show the consequence: another prompt takes the freed memory, then the original is restored
        other = tokens(PAGES * PS + 5, seed=7)
        o = tier.cache(other)
        greedy(model, other, o, 1)
        d = tier.cache(ids)
        got = greedy(model, ids, d)
        assert ok, (f"the index holds {len(tier.controller.pages)} pages but the host pool has only "
                    f"{_host_pages_in_use(tier)} allocated: freed tail pages were adopted")
        assert torch.equal(got, want)


def test_a_failed_tail_used_by_an_inputs_embeds_forward_is_never_served(tmp_path, monkeypatch):
    """Used to go wrong: a forward fed ``inputs_embeds`` (no input_ids) has ``_span`` None (before_forward sets it
    only for 2-D ids), so ``after_forward`` skips ``Restorer.recover`` although ``_redo`` says a tail page failed: the
    guard in ``recompute_forward`` that should refuse such a forward is unreachable. The logits computed
    from the garbage page are returned, ``_redo`` is cleared, and the cache keeps the garbage KV for every
    later forward. Expected: a KvtierError (as recompute_forward intends) or recomputing's logits."""
    model, ids, tier = _failing_split(tmp_path, monkeypatch, "embeds")
    with tier:
        want = _want_logits(model, ids)
        c = tier.cache(ids)
        held = c.get_seq_length()
        assert c.plan.kind == "split" and held == PAGES * PS
        emb = model.get_input_embeddings()(ids[:, held:])
        try:
            with torch.no_grad():
                out = model(inputs_embeds=emb, use_cache=True, **{cache_kwarg(model): c}).logits
        except kvtier.KvtierError:
            return  # the refusal recompute_forward was written to give
        err = (out - want[:, held:]).abs().max().item()
        assert err < 1e-4, f"logits computed from a failed tail page returned silently (off by {err:.3f})"


def test_a_failed_tail_used_by_the_base_model_is_never_served(tmp_path, monkeypatch):
    """Used to go wrong: the hooks are on the top model only. A forward of its base model (``model.model``, e.g.
    for hidden states) on a pending tail settles the tail at its last layer and sets ``_redo``, but no
    forward hook runs: its hidden states, computed from the failed page's garbage, are returned without an
    error, and the garbage stays in the cache (``_redo`` then lingers until some later top-level forward)."""
    model, ids, tier = _failing_split(tmp_path, monkeypatch, "base")
    with tier:
        with torch.no_grad():
            want = model.model(input_ids=ids, use_cache=True, past_key_values=DynamicCache(config=model.config)).last_hidden_state
        c = tier.cache(ids)
        held = c.get_seq_length()
        assert c.plan.kind == "split"
        try:
            with torch.no_grad():
                out = model.model(input_ids=ids[:, held:], use_cache=True, past_key_values=c).last_hidden_state
        except kvtier.KvtierError:
            return
        err = (out - want[:, held:]).abs().max().item()
        assert err < 1e-4, f"hidden states computed from a failed tail page returned silently (off by {err:.3f})"


@pytest.mark.parametrize("then", ["reset", "crop_below_failed", "past_prompt"])
def test_an_interrupt_after_the_tail_settled_leaves_no_stale_recovery(tmp_path, monkeypatch, then):
    """Used to go wrong: a KeyboardInterrupt after the last layer settled a failed tail (here: a pre-hook on the
    final norm) skips the forward hook, so ``_redo`` stays set (and the garbage pages stay in the cache).
    ``reset()``/``crop()`` do not clear it; the next forward is then "recovered" from the stale page:

    - reset / crop below the failed page: ``Restorer.recover`` cuts the cache to the old failed page — past what it
      holds (``_truncate`` sets every layer's length to it over nothing) — and feeds only the new ids there;
      the pre-hook's prompt check then refuses the caller's valid forward (InvalidArgumentError "not the
      prompt") and the cache is left corrupted.
    - past_prompt: the interrupted forward fed the prompt's rest and 3 more tokens; the next forward (one
      token, no crop) is recovered with ``self._prompt[failed*ps:ctx]``, which lacks the 3 tokens past the
      prompt: the recomputation drops them, the prompt check passes (it compares only the prompt's part),
      and logits of another sequence are returned silently."""
    model, ids, tier = _failing_split(tmp_path, monkeypatch, f"intr-{then}")
    with tier:
        longer = torch.cat([ids, tokens(4, seed=9)], dim=1)  # the prompt and 4 more tokens
        want = _want_logits(model, longer)
        c = tier.cache(ids)
        held = c.get_seq_length()
        assert c.plan.kind == "split"
        fired = []

        def interrupt(module, args):
            if not fired:
                fired.append(1)
                raise KeyboardInterrupt

        h = model.model.norm.register_forward_pre_hook(interrupt)
        first = longer[:, held:-1] if then == "past_prompt" else ids[:, held:]
        try:
            with pytest.raises(KeyboardInterrupt):
                _logits(model, first, c)
        finally:
            h.remove()
        if then == "reset":
            c.reset()
            got, ref = _logits(model, ids, c), want[:, : ids.shape[1]]
        elif then == "crop_below_failed":
            c.crop(-(c.get_seq_length() - PS))  # keep one page (below the failed one)
            got, ref = _logits(model, ids[:, PS:], c), want[:, PS : ids.shape[1]]
        else:  # the cache was cut back to its verified pages when the failed page was seen: go on from there
            held = c.get_seq_length()
            assert held < ids.shape[1]
            got, ref = _logits(model, longer[:, held:], c), want[:, held:]
        assert got.shape == ref.shape, (got.shape, ref.shape)
        err = (got - ref).abs().max().item()
        assert err < 1e-4, f"after the interrupt ({then}), the next forward's logits are off by {err:.3f}"


def test_a_recomputed_forward_keeps_the_attentions_shape(tmp_path, monkeypatch):
    """Used to go wrong: ``_trimmed`` cuts ``logits`` and ``hidden_states`` to the failed forward's tokens
    but not ``attentions`` (dim 2 is the query): a caller asking ``output_attentions=True`` gets every
    recomputed token's rows, a shape the forward it called never gives."""
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    model, ids, tier = _failing_split(tmp_path, monkeypatch, "attn", model=model)
    with tier:
        c = tier.cache(ids)
        held = c.get_seq_length()
        assert c.plan.kind == "split"
        with torch.no_grad():
            out = model(input_ids=ids[:, held:], use_cache=True, output_attentions=True, **{cache_kwarg(model): c})
        n = ids.shape[1] - held
        assert out.logits.shape[1] == n
        assert all(a.shape[2] == n for a in out.attentions), [tuple(a.shape) for a in out.attentions]


def test_a_failed_tail_released_unsettled_keeps_the_counters(tmp_path, monkeypatch):
    """Used to go wrong: the tail's pages are counted restored when attached; only ``Restorer.settle_tail`` takes
    failed ones back. A cache released (or collected) before its first forward never settles: the tier's
    ``restored_pages``/``restored_store_pages`` keep pages that failed their check."""
    model, ids, tier = _failing_split(tmp_path, monkeypatch, "counters")
    with tier:
        before = tier.stats.restored_store_pages
        c = tier.cache(ids)
        assert c.plan.kind == "split"
        c.release()
        _settled(tier)
        assert tier.stats.restored_store_pages == before, "pages that failed their check are counted restored"


# ---------------------------------------------------------------------------------------------------- checks that hold
def test_a_second_cache_while_the_first_tail_is_unsettled(tmp_path, monkeypatch):
    """A second cache of the same prompt made (and run) while the first's tail is still private and unsettled;
    the first's read fails in the middle. Both give recomputing's tokens; nothing leaks; counters add up."""
    model = llama()
    ids = tokens(PAGES * PS + 5)
    with _tier(model, tmp_path, "second") as tier:
        want = greedy(model, ids, DynamicCache(config=model.config))
        stored_then_dropped(tier, model, ids)
        _split_disk(tier)
        keys = []
        real = tier.controller.read_into

        def read_into(page_keys, starts, **kw):
            keys.append(list(page_keys))
            return real(page_keys, starts, **kw)

        monkeypatch.setattr(tier.controller, "read_into", read_into)

        class FirstReadMiddle:
            def __contains__(self, key):
                return bool(keys) and key == keys[0][len(keys[0]) // 2]

        _fail_reads(monkeypatch, tier, FirstReadMiddle())
        a = tier.cache(ids)
        b = tier.cache(ids)
        assert a.plan.kind == "split"
        assert torch.equal(greedy(model, ids, b), want)
        assert torch.equal(greedy(model, ids, a), want)
        assert tier.stats.restored_store_pages == a.restored_store_pages + b.restored_store_pages
        a.release()
        b.release()
        _settled(tier)
        assert all(pg.refs == 0 for pg in tier.controller.pages.values())
        assert _host_pages_in_use(tier) == len(tier.controller.pages)


@pytest.mark.parametrize("kw", [dict(output_hidden_states=True, return_dict_in_generate=True),
                                dict(attention_mask=True), dict(logits_to_keep=0)])
def test_generate_with_options_on_a_failed_tail(tmp_path, monkeypatch, kw):
    """generate(max_new_tokens=5) with output_hidden_states / return_dict_in_generate / an attention mask /
    logits_to_keep=0 on a tail that fails every page: recomputing's tokens."""
    model, ids, tier = _failing_split(tmp_path, monkeypatch, "gen")
    with tier:
        kw = dict(kw)
        if kw.get("attention_mask") is True:
            kw["attention_mask"] = torch.ones_like(ids)
        want = model.generate(ids, past_key_values=DynamicCache(config=model.config), max_new_tokens=5,
                              do_sample=False, pad_token_id=0, **kw)
        c = tier.cache(ids)
        assert c.plan.kind == "split"
        got = model.generate(ids, **{cache_kwarg(model): c}, max_new_tokens=5, do_sample=False, pad_token_id=0, **kw)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
        else:
            assert torch.equal(got.sequences, want.sequences)
            # (a restored prefix is not computed: the first step's hidden states are the rest's tokens only)
            for a, b in zip(got.hidden_states[0], want.hidden_states[0]):
                assert a.shape[1] == ids.shape[1] - c.plan.recompute_to * PS or a.shape[1] < b.shape[1]
                assert (a[:, -1] - b[:, -1]).abs().max().item() < 1e-4


def test_close_with_a_tail_unsettled_then_collect(tmp_path, monkeypatch):
    """KVTier.close() while a cache's tail is unsettled: no hang, no error; the cache refuses use afterwards."""
    model, ids, tier = _failing_split(tmp_path, monkeypatch, "close")
    c = tier.cache(ids)
    assert c.plan.kind == "split"
    tier.close()
    with pytest.raises(kvtier.ClosedError):
        _logits(model, ids[:, c.get_seq_length():], c)
    del c
    gc.collect()


def test_two_tenants_split_the_same_prompt(tmp_path, monkeypatch):
    """Two tenants (cache_salt) restoring the same prompt: tenant b has nothing stored (recompute); tenant a's
    tail fails; neither sees the other's pages; nothing leaks."""
    model = llama()
    ids = tokens(PAGES * PS + 5)
    with _tier(model, tmp_path, "tenants") as tier:
        want = greedy(model, ids, DynamicCache(config=model.config))
        c = tier.cache(ids, cache_salt="a")
        greedy(model, ids, c, 1)
        c.release()
        tier.controller.wait_idle()
        tier.drop_host_copies()
        _split_disk(tier)
        _fail_reads(monkeypatch, tier)
        a = tier.cache(ids, cache_salt="a")
        b = tier.cache(ids, cache_salt="b")
        assert a.plan.kind == "split" and b.restored_tokens == 0
        assert torch.equal(greedy(model, ids, a), want)
        assert torch.equal(greedy(model, ids, b), want)
        a.release()
        b.release()
        _settled(tier)
        assert _host_pages_in_use(tier) == len(tier.controller.pages)


def test_an_interrupt_in_the_recomputation_returns_nothing_and_leaks_nothing(tmp_path, monkeypatch):
    """A KeyboardInterrupt inside the recomputed forward (layer 1's pre-hook, second call): nothing returned,
    and once released every page is back."""
    model, ids, tier = _failing_split(tmp_path, monkeypatch, "intr-re")
    with tier:
        c = tier.cache(ids)
        held = c.get_seq_length()
        calls = []

        def interrupt(module, args, kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt

        h = model.model.layers[1].register_forward_pre_hook(interrupt, with_kwargs=True)
        try:
            with pytest.raises(KeyboardInterrupt):
                _logits(model, ids[:, held:], c)
        finally:
            h.remove()
        assert len(calls) == 2
        c.release()
        _settled(tier)
        assert all(pg.refs == 0 for pg in tier.controller.pages.values())
        assert _host_pages_in_use(tier) == len(tier.controller.pages)
