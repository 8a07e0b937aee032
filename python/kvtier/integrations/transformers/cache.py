"""The per-sequence half of kvtier's transformers integration: :class:`KvtierCache` (the ``Cache`` that ``model(...)``
and ``generate()`` call), its window of device layer slots and its host page table. Built by :meth:`KVTier.cache`."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache

from ..._errors import ClosedError, InvalidArgumentError, KvtierError
from ...store import page_hashes
from ...tenants import tenant_keys
from .state import TierRuntime
from .restore import CacheSteps, Restorer
from .window import DeviceWindow, LayerBatch, LayerLength, PageTable, release_now, release_table, slot_bytes

# forward arguments that do not change the KV a token gets (positions and masks are checked, not listed here)
_PLAIN = frozenset({"input_ids", "cache", "past_key_values", "use_cache", "logits_to_keep", "return_dict",
                    "output_attentions", "output_hidden_states", "labels"})


class KvtierCache(DynamicCache):
    """The KV cache of one sequence, kept in a :class:`KVTier` (see the module docs); made by
    :meth:`KVTier.cache`. ``restored_tokens``, ``restored_host_pages`` and ``restored_store_pages`` say what
    its prompt did not have to compute."""

    def __init__(self, tier: Any, state: TierRuntime, token_ids: list[int], *, restore: bool = True,
                 keep: bool = True, salt: str | None = None) -> None:
        """``tier``: the KVTier that makes it (``cache.tier``); ``state``: that tier's runtime; ``keep=False``:
        nothing of the sequence is ever kept (counted as unverified)."""
        Cache.__init__(self, layers=[LayerLength() for _ in range(state.layers)])
        self.tier = tier
        self._state = state
        self.salt = salt  # the tenant: its keys are tenant_keys(salt, chain) (kvtier.tenants)
        self.table = PageTable()
        self._finalizer = weakref.finalize(self, release_table, state, self.table)
        self._finalizer.atexit = False  # (a process that ends gives its pages back with it)
        self._fed: list[int] = []  # token ids the model was fed (restored ones first)
        self._prompt = token_ids  # what this cache was made for: the first forwards must feed its rest
        # per forward, whether its positions were the plain ones (all-ones mask, positions following the cache)
        self._pending: list[Any] = []  # (tensors on the model's device, read at the next adoption: never waited on)
        self._verified = True
        self._adopted = 0  # pages [0, _adopted) are in the controller's index (or were refused)
        self._page_keys: list[str] = []  # the (tenant's) key of every full page of _fed (adopted or not)
        self._chain: list[str] = []  # the chained hash of every full page of _fed (the salt is not in the chain)
        self._released = False
        self._epoch = 0
        self._window: DeviceWindow | None = None
        # the layers this sequence keeps on the device: the KVTier's window, or with window="auto" as many as half
        # of the device's free memory holds now (every layer where they fit)
        need = slot_bytes(max(len(token_ids), 1), state.heads, state.k_dim, state.v_dim, state.dtype, state.page_size)
        self.resident_layers = state.stats.resident_layers = state.resident_layers(need)
        self._batch = LayerBatch()  # every layer resident: the forward's backups, sent after its last layer
        self._idx: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.restored_tokens = self.restored_host_pages = self.restored_store_pages = 0
        self._forward: Any = None  # (start, new tokens, cached tokens) of the forward in flight
        self._restorer = Restorer(state, self.table, self.resident_layers)  # plan, tail in flight, head (restore.py)
        # (first failed tail page, the cached tokens from it on) when the forward in flight used a failed tail
        self._redo: tuple[int, list[int]] | None = None
        self._span: tuple[int, int] | None = None  # (length before, tokens fed) of the forward in flight
        self._hooked = False  # the model's pre-hook saw the next forward (its hook can compute it again)
        self._this_hooked = False  # ... the forward in flight (taken at its first layer)
        self._last_held = -2  # the cache's length at generate's last step (its next is a decode step when +1)
        state.stats.caches += 1
        if not keep:
            self._unverified()
        if restore:
            self._restorer.restore(self, CacheSteps(self._salted, self._attach, self._ensure_window, self._load),
                                   token_ids)
        self.plan, self.recomputed_tokens = self._restorer.plan, self._restorer.recomputed_tokens  # (restore.py)

    def _salted(self, chain: list[str]) -> list[str]:
        return tenant_keys(self.salt, chain) if self.salt is not None and chain else chain

    def _attach(self, starts: list[int], keys: list[str], chain: list[str], host: int, *, first: int = 0,
                private: bool = False, tail: bool = False, load: bool = True) -> None:
        """Pages ``[first, first + len(starts))`` of the prompt (``keys``, and ``chain``: their hashes before
        the tenant's salt), acquired from the controller, become the sequence's (without a copy); ``host`` of
        them came from the host pool, the rest from the store. ``private``: the pages are the sequence's own,
        not the index's (a tail still being read). ``tail``: their loads go on the tail stream (see
        :meth:`_load`); ``load`` False: the caller issues the loads."""
        st, ps = self._state, self._state.page_size
        r = len(starts)
        if not r:
            return
        self.table.starts += list(starts)
        self.table.keys += [None] * r if private else list(keys[first : first + r])
        self._adopted = first + r
        self._page_keys[first:] = list(keys[first : first + r])
        self._chain[first:] = list(chain[first : first + r])
        self._fed[first * ps:] = self._prompt[first * ps : (first + r) * ps]
        for layer in self.layers:
            layer.length = (first + r) * ps
        self.restored_tokens += r * ps
        self.restored_host_pages += min(host, r)
        self.restored_store_pages += r - min(host, r)
        st.stats.restored_pages += r
        st.stats.restored_host_pages += min(host, r)
        st.stats.restored_store_pages += r - min(host, r)
        win, pending = self._ensure_window((first + r) * ps), self._restorer.tail
        if load and not tail and self._batch.load(win, st, self._slots, self._epoch, (first + r) * ps,
                                                  pending.wait if pending is not None else None):
            return
        for layer_idx in range(win.window if load else 0):  # the first layers move while the embeddings compute
            self._load(win, layer_idx, (first + r) * ps, tail=tail)

    # ------------------------------------------------------------------ the hooks KVTier installs on the model
    def before_forward(self, ids: Any, kwargs: dict[str, Any]) -> None:
        """The forward pre-hook: checks and records the ids about to be fed (:meth:`_fed_tokens`), and starts
        timing the forward — only when it says something (a page or more of new tokens, or the forward that may
        end a time to first token), so a decode step makes no event."""
        st = self._state
        if getattr(st.text_config, "_attn_implementation", None) != st.attn_implementation:
            self._unverified()  # KV computed another way than the namespace says: never kept
        self._fed_tokens(ids, kwargs)
        self._span = None
        self._redo = None  # (left by a forward that never reached its hook: interrupted, its output never returned)
        self._hooked = True
        if isinstance(ids, torch.Tensor) and ids.dim() == 2:
            n = int(ids.shape[1])
            self._span = (self.get_seq_length(), n)
            if st.observe and (n >= st.page_size or self._restorer.ttft is not None):
                st.marks.poll()
                # a forward on a tail still being read waits for the disk: not a prefill to learn from
                self._forward = (st.marks.mark(), n, self.get_seq_length(), self._restorer.tail is None)

    def after_forward(self, model: Any = None, kwargs: dict[str, Any] | None = None, output: Any = None) -> Any:
        """The forward hook: the forward's time goes to the prefill model (forwards of a page or more: decode
        steps say little about prefill); the first forward that completes the prompt ends the time to first
        token of the cache's plan. Returns None, or the output that replaces ``output`` when the forward used a
        tail page that failed its check (:meth:`Restorer.recover`)."""
        started, self._forward = self._forward, None
        redo, self._redo = self._redo, None
        self._hooked = False
        if redo is not None and self._span is not None:
            return self._restorer.recover(model, kwargs or {}, output, self._span, redo)
        if started is None:
            return None
        st = self._state
        start, n, ctx, learn = started
        end = st.marks.mark()
        ctrl = st.controller
        if n >= st.page_size and learn:
            st.marks.after(start, end, lambda s: ctrl.observe_prefill(n, ctx, s))
        ttft = self._restorer.ttft
        if ttft is not None and len(self._fed) >= len(self._prompt):
            self._restorer.ttft = None
            plan, t0 = ttft
            st.marks.after(t0, end, lambda s: ctrl.observe_ttft(plan, s))
        return None

    # ------------------------------------------------------------------ helpers
    def _fed_tokens(self, ids: Any, kwargs: dict[str, Any]) -> None:
        """The ids about to be fed (their KV gets keyed by them), from :meth:`before_forward`. KV is keyed by token ids
        alone, so a forward whose KV also depends on something else (a mask with padding, other positions,
        embeddings, images, any argument not in _PLAIN) makes the sequence unverified: nothing more of it is
        kept. A forward that feeds other tokens than the prompt this cache was made for is an error: its
        restored prefix belongs to that prompt."""
        start, pos = len(self._fed), self.get_seq_length()  # (an unverified sequence stops tracking _fed)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] == 1 and pos < len(self._prompt):
            fed = ids[0].tolist()
            expect = self._prompt[pos : pos + len(fed)]
            if fed[: len(expect)] != expect:
                raise InvalidArgumentError(
                    "invalid argument `input_ids`: they are not the prompt this cache was made for (KVTier.cache(ids) "
                    "restored that prompt's prefix); pass the same ids to KVTier.cache and to generate/model")
        if not self._verified:
            return
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or start != self.get_seq_length():
            self._unverified()
            return
        n = ids.shape[1]
        for name, value in kwargs.items():
            if value is None or name in _PLAIN:
                continue
            if name in ("position_ids", "cache_position") and isinstance(value, torch.Tensor):
                want = torch.arange(start, start + n, device=value.device)
                self._pending.append((value.reshape(-1) == want).all() if value.numel() == n else torch.tensor(False))
            elif name == "attention_mask" and isinstance(value, torch.Tensor):
                self._pending.append((value == 1).all())
            else:  # embeddings, images, token types, anything whose effect on the KV the key cannot name
                self._unverified()
                return
        self._fed.extend(ids[0].tolist())

    def check_generate_inputs(self, input_ids: torch.Tensor, first: bool = True) -> None:
        """The check KVTier adds to the model's ``prepare_inputs_for_generation``: ``generate``'s whole sequence
        (it feeds the model only the tokens after this cache's length) must start with every token this cache
        holds: ids that differ inside the held prefix — restored, cropped to, or left by an earlier ``generate``
        — are refused, never answered from another prompt's KV. The whole held prefix is compared at each call's
        first step and whenever the cache's length moved other than by the one token of a decode step (one sync
        each); decode steps are not compared."""
        held = self.get_seq_length()
        step = not first and held == self._last_held + 1  # generate fed the one token it just produced
        self._last_held = held
        if step:
            return
        m = min(held, len(self._fed))  # (an unverified sequence stops tracking _fed)
        if int(input_ids.shape[1]) < held or input_ids[0, :m].tolist() != self._fed[:m]:
            raise InvalidArgumentError(
                "invalid argument `input_ids`: they do not start with the tokens this cache holds (KVTier.cache(ids) "
                "restored the prefix of another prompt, or the cache holds another conversation); pass the same ids "
                "to KVTier.cache and to generate")

    def _unverified(self) -> None:
        if self._verified:
            self._verified = False
            self._state.stats.unverified_sequences += 1

    def _slots(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host slots, device rows) of pages [first, last), cached so repeated transfers are validated once."""
        got = self._idx.get((first, last))
        if got is None:
            ps = self._state.page_size
            starts = torch.tensor(self.table.starts[first:last], dtype=torch.int64)
            host = (starts[:, None] + torch.arange(ps)[None]).reshape(-1)
            got = host, torch.arange(ps + first * ps, ps + last * ps, dtype=torch.int64)
            if len(self._idx) > 8:
                self._idx.clear()
            self._idx[(first, last)] = got
        return got

    def _ensure_window(self, tokens: int) -> DeviceWindow:
        t = self._state
        if self._window is None:  # for the whole prompt (not the prefix alone: its forward would reallocate, reload)
            self._window = DeviceWindow(t.layers, self.resident_layers, t.heads, t.k_dim, t.v_dim, t.dtype, t.device,
                                        t.page_size, max(tokens, len(self._prompt)))
        elif self._window.size < tokens:
            t.drain()  # nothing in flight may touch the old slots
            self._window.ensure(tokens)
        return self._window

    def _grow(self, tokens: int) -> None:
        need = -(-tokens // self._state.page_size) - len(self.table.starts)
        if need > 0:
            got = self._state.controller.allocate(need)
            if got is None:
                raise KvtierError(
                    f"kvtier host pool full: {tokens} tokens of this sequence do not fit next to the pages other "
                    f"live caches hold (KVTier(host_tokens={self._state.host_tokens})); raise host_tokens")
            self.table.starts += got
            self.table.keys += [None] * len(got)

    def _load(self, win: DeviceWindow, layer_idx: int, tokens: int, *, tail: bool = False) -> None:
        """Host -> slot of ``layer_idx``: its first ``tokens`` tokens (whole pages), on the transfer stream
        after the compute stream's work so far (the slot's previous user included).

        ``tail`` (a split restore's tail, every layer resident, CUDA): on the tail stream instead, so these
        loads wait for the store's read alone and not behind the head's backups; the slot's next user then
        waits for both its last transfer (the head's backup of this layer) and this load, and so runs as soon
        as the head has computed this layer and the tail has arrived (the rest of the prompt trails the head
        layer by layer instead of waiting for all of it)."""
        st = self._state
        if self._restorer.tail is not None and not st.cuda:  # (on CUDA the transfer stream waits at its gate)
            self._restorer.tail.wait()
        s = layer_idx % win.window
        # a slot that still holds this layer's first `held` tokens (a window of every layer: the head a split
        # restore computed, or the last forward's) gets only the pages from the one `held` ends in
        held, kept = win.state[s], 0
        if held is not None and held[0] == layer_idx and held[2] == self._epoch and held[1] <= tokens:
            if held[1] == tokens:  # (nothing to move: the slot's last transfer is what its users wait for)
                return
            kept = held[1]
        first, last = kept // st.page_size, -(-tokens // st.page_size)
        host, dev = self._slots(first, last)
        pending = st.transfer(win, layer_idx, host, dev, to_host=False, tail=tail)
        if tail and kept and win.loaded[s] is not None:  # (rows [0, kept): the head's, still being written)
            before = win.loaded[s]
            win.loaded[s] = [*(before if isinstance(before, list) else [before]), pending]
        else:
            win.loaded[s] = pending
        win.state[s] = (layer_idx, tokens, self._epoch)
        st.stats.layer_loads += 1

    # ------------------------------------------------------------------ the Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        st = self._state
        st.check_open()
        if self._released:
            raise ClosedError("this KvtierCache was released; make a new one with KVTier.cache()")
        if not 0 <= layer_idx < st.layers:
            raise InvalidArgumentError(f"invalid argument `layer_idx`: {layer_idx} not in [0, {st.layers})")
        if key_states.dim() == 4 and key_states.shape[0] != 1:
            raise InvalidArgumentError(f"invalid argument `key_states`: a batch of {key_states.shape[0]} sequences; kvtier's "
                                       "cache holds one (batch size 1, no beam search or num_return_sequences > 1)")
        want_k, want_v = (1, st.heads, key_states.shape[-2], st.k_dim), (1, st.heads, key_states.shape[-2], st.v_dim)
        if tuple(key_states.shape) != want_k or tuple(value_states.shape) != want_v or key_states.dtype != st.dtype \
                or value_states.dtype != st.dtype or key_states.device != st.device:
            raise InvalidArgumentError(
                f"invalid argument `key_states`/`value_states`: expected {want_k} and {want_v} {st.dtype} on "
                f"{st.device} (batch size 1), got {tuple(key_states.shape)} {key_states.dtype} and "
                f"{tuple(value_states.shape)} {value_states.dtype} on {key_states.device}")
        ps, layer = st.page_size, self.layers[layer_idx]
        if layer_idx == 0:  # backups of a forward that never reached its last layer; whether the model's hooks
            self._batch.flush(self._window, st, self._slots)  # are around this forward (a base model's: not)
            self._this_hooked, self._hooked = self._hooked, False
        t0 = layer.get_seq_length()
        t1 = t0 + key_states.shape[-2]
        self._grow(t1)
        win = self._ensure_window(t1)
        s = layer_idx % win.window
        if t0 and win.state[s] != (layer_idx, t0, self._epoch):
            st.stats.on_demand_loads += 1
            self._load(win, layer_idx, t0)
        compute = torch.cuda.current_stream(st.device) if st.cuda else None
        st.wait(compute, win.loaded[s])
        ks, vs = win.k_slots[s], win.v_slots[s]
        ks[ps + t0 : ps + t1].copy_(key_states[0].transpose(0, 1))
        vs[ps + t0 : ps + t1].copy_(value_states[0].transpose(0, 1))
        # attention gets the model's own tensors for a layer's first tokens (as DynamicCache), else copies of the
        # slot's rows (never views: the slot may be loaded with the layer `window` ahead before attention runs;
        # with one head a transposed view would count as contiguous and .contiguous() would not copy)
        keys, values = (key_states, value_states) if t0 == 0 else (
            ks[ps : ps + t1].transpose(0, 1).unsqueeze(0).clone(memory_format=torch.contiguous_format),
            vs[ps : ps + t1].transpose(0, 1).unsqueeze(0).clone(memory_format=torch.contiguous_format))
        layer.length = t1
        win.state[s] = (layer_idx, t1, self._epoch)
        # the pages this step wrote go to the host (this layer only); then the slot takes the layer `window`
        # ahead (the next forward's first layers once the last ones are done)
        host, dev = self._slots(t0 // ps, -(-t1 // ps))
        # the slot's next user: the layer `window` ahead, or past the last layer the next forward's layer of
        # the same slot (layers need not be a multiple of the window)
        nxt = layer_idx + win.window if layer_idx + win.window < st.layers else layer_idx % win.window
        nxt_len = self.layers[nxt].get_seq_length()
        # the slot's next writer (a load below, ordered after it on the transfer stream, or the compute stream
        # when no load is needed, as in a prefill) must wait until the backup has read it
        if not self._batch.defer(win, st.layers, layer_idx, t0, t1, self._restorer.in_head):
            win.loaded[s] = st.transfer(win, layer_idx, host, dev, to_host=True)
        if nxt != layer_idx and nxt_len:
            self._load(win, nxt, nxt_len)
        if layer_idx == st.layers - 1:
            self._batch.flush(win, st, self._slots)
            st.stats.computed_tokens += t1 - t0
            if self._restorer.tail is not None:  # this forward ran on the tail: checked before anything is kept
                self._failed_tail(self._restorer.settle_tail(self), t0)
            if self._redo is None:
                self._adopt(t1)
        return keys, values

    def _settled(self) -> None:
        """Settle a pending tail outside a forward: a failed page cuts the sequence back to the verified ones."""
        if self._restorer.tail is not None:
            failed = self._restorer.settle_tail(self)
            if failed is not None and self.get_seq_length() > failed * self._state.page_size:
                self._truncate(failed * self._state.page_size)

    def _failed_tail(self, failed: int | None, ctx: int) -> None:
        """At the last layer of the forward that ran on the tail (``ctx``: the sequence's length before it):
        ``failed`` is the first tail page that failed its check (None: none did). The sequence is cut back to
        the verified pages at once, so nothing of this forward is kept; the model's hook then computes the
        forward again (:meth:`Restorer.recover`), or — a forward its hooks do not see (a base model's) or cannot
        repeat (no ``input_ids``) — this raises."""
        if failed is None:
            return
        ps = self._state.page_size
        prior = self._fed[failed * ps : ctx]  # the cached tokens from the failed page on (prompt or not)
        self._truncate(failed * ps)
        if not self._this_hooked or self._span is None or len(prior) != ctx - failed * ps:
            raise KvtierError(
                "a restored page failed its check after this forward had used it: its output is not returned; "
                f"the cache was cut back to the {failed * ps} tokens verified: call the model again from there "
                "with input_ids (through the model kvtier hooked, not its base model)")
        self._redo = (failed, prior)

    def _adopt(self, tokens: int) -> None:
        """Hand the sequence's newly completed pages to the controller's index (keyed by the fed tokens)."""
        if not self._verified:
            return
        if len(self._fed) != tokens:
            self._unverified()
            return
        ps, st = self._state.page_size, self._state
        first, full = self._adopted, tokens // ps
        if full <= first:
            return
        if self._pending:  # the forwards since the last adoption all had plain positions (one sync per page)
            plain = bool(torch.stack([torch.as_tensor(x).reshape(()).cpu() for x in self._pending]).all())
            self._pending.clear()
            if not plain:
                self._unverified()
                return
        prior = self._chain[first - 1] if first else None
        chain = page_hashes(self._fed[first * ps : full * ps], ps, prior)
        keys = self._salted(chain)
        self._chain[first:] = chain
        self._page_keys[first:] = keys
        event = st.fence()
        stored = [k in self._restorer.stored for k in keys] if self._restorer.stored else None
        took = st.controller.adopt(keys, self.table.starts[first:full], event=event, stored=stored)
        for j, (k, ok) in enumerate(zip(keys, took), start=first):
            if ok:
                self.table.keys[j] = k
        st.stats.adopted_pages += sum(took)
        self._adopted = full

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a negative int, as transformers' ``crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                             "Please use a negative integer to remove that number of tokens from the cache instead.")
        if tokens_to_remove < 0:
            self._truncate(max(0, self.get_seq_length() + tokens_to_remove))

    def reset(self) -> None:
        self._truncate(0)

    def _truncate(self, tokens: int) -> None:
        st, ps = self._state, self._state.page_size
        st.check_open()
        self._redo = None
        if self._restorer.tail is not None:
            self._settled()
            tokens = min(tokens, self.get_seq_length())
        self._batch.flush(self._window, st, self._slots)  # (a forward that raised: its rows, before pages go)
        st.after_tail()  # (rows cut here are written again by the next forward's loads and compute)
        tokens = min(tokens, *(layer.length for layer in self.layers))  # (a raised forward's rows are not all there)
        keep = -(-tokens // ps)
        self.table.release(st, keep)
        j = tokens // ps
        shared = self.table.keys[j] if tokens % ps else None
        if shared is not None:  # a shared page gets written again: copy it first
            got = st.controller.allocate(1)
            if got is None:
                raise KvtierError("kvtier host pool full: no page to copy a shared page into; raise host_tokens")
            st.drain()
            old, new = self.table.starts[j] // ps, got[0] // ps
            for buf in (st.host.k_buffer, st.host.v_buffer):
                buf[new].copy_(buf[old])
            st.controller.release([shared])
            self.table.starts[j], self.table.keys[j] = got[0], None
        self._adopted = min(self._adopted, j)
        del self._page_keys[j:]
        del self._chain[j:]
        del self._fed[tokens:]
        self._last_held = -2
        for layer in self.layers:
            layer.length = tokens
        self._epoch += 1
        self._idx.clear()

    def release(self) -> None:
        """Give the sequence's host pages back now (else when the cache is garbage collected); the cache cannot
        be used afterwards."""
        if self._restorer.tail is not None and not self._state.closed:
            self._settled()  # (its verified pages to the index, the counters right)
        if self._finalizer.detach() is not None:  # (here: the tail's private pages once its read has finished)
            release_now(self._state, self.table)
        self._restorer.tail = self._redo = None  # never settled afterwards: its pages are no longer the sequence's
        self._released = True
        for layer in self.layers:
            layer.length = 0
        self._window, self._batch.deferred = None, None  # (a raised forward's backups: its pages are gone)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KvtierCache holds one sequence: beam search is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise NotImplementedError("KvtierCache holds one sequence (batch size 1)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if len(indices) != 1 or int(indices[0]) != 0:
            raise NotImplementedError("KvtierCache holds one sequence (batch size 1)")

    def __iter__(self) -> Any:
        raise TypeError("KvtierCache keeps its KV in kvtier's pools; it cannot be iterated as tensors")

    def host_kv(self, layer_idx: int, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of layer ``layer_idx``'s K and V of the first ``tokens`` tokens as kvtier holds them on the
        host, shaped as transformers' caches (``(1, heads, tokens, dim)``): for checks."""
        st, ps = self._state, self._state.page_size
        st.check_open()
        tokens = self.get_seq_length(layer_idx) if tokens is None else tokens
        if not 0 <= layer_idx < st.layers or not 0 <= tokens <= self.get_seq_length(layer_idx):
            raise InvalidArgumentError(f"invalid argument `layer_idx`/`tokens`: {layer_idx}, {tokens}")
        self._settled()
        tokens = min(tokens, self.get_seq_length(layer_idx))
        st.drain()
        pages = [s // ps for s in self.table.starts[: -(-tokens // ps)]]
        out = []
        for buf in (st.host.k_buffer, st.host.v_buffer):  # (pages, layers, page_size, heads, dim)
            rows = buf[pages, layer_idx].reshape(-1, st.heads, buf.shape[-1])[:tokens]
            out.append(rows.transpose(0, 1).unsqueeze(0).contiguous())
        return out[0], out[1]

    @property
    def window_bytes(self) -> int:
        """Device bytes of this cache's layer slots."""
        return 0 if self._window is None else self._window.nbytes

    def __repr__(self) -> str:
        return (f"KvtierCache(tokens={self.get_seq_length()}, restored={self.restored_tokens}, "
                f"window={self.resident_layers}/{self._state.layers})")
