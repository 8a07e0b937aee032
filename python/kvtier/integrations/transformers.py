"""kvtier as a Hugging Face transformers KV cache (the ``Cache`` API of transformers 5.24; tested with
``transformers==5.24.0``).

:class:`KVTier` is built once per model: a pinned kvtier host pool that holds every layer's KV of the live
sequence and the pages kept for reuse, a :class:`kvtier.TierController` over it, and optionally a
:class:`kvtier.PageStore` (and a Mooncake cluster tier behind it). :meth:`KVTier.cache` gives a
:class:`KvtierCache` for one sequence, which ``model(...)`` and ``generate()`` take as ``cache=`` (or the
deprecated ``past_key_values=``)::

    tier = KVTier(model, model_id="my-org/my-model", page_size=16, window=2)
    out = model.generate(ids, cache=tier.cache(ids), max_new_tokens=32)

- **Layers stream.** The GPU holds ``window`` layer slots; layer ``l`` uses slot ``l % window``. When layer
  ``l`` has been handed to attention, the slot's new pages go to the host (one per-layer backup) and layer
  ``l + window``'s KV is loaded into it, both on one transfer stream ordered after an event of the compute
  stream; layer ``l + window`` waits only for its own load's event (the :class:`kvtier.LayerLoader`
  discipline). Only the new tokens' pages travel to the host; every layer's whole history travels to the GPU.
- **Pages are keyed** by kvtier's chained page hashes (:func:`kvtier.page_hashes`) of the token ids the
  model was actually fed (a forward pre-hook on the model records them), under a namespace made of the
  model id, a digest of the model config (architecture, layers, heads, head dims, rope, everything in the
  config that can change KV), the attention implementation, the device type, and the pool's dtype, layout,
  page size and geometry. A different model, config or dtype misses.
- **Restore.** :meth:`KVTier.cache` looks the prompt's full pages up on the host, then in the store (read
  into the host pool, each page checksummed), and takes the leading run: those pages become the start of the
  new sequence **without a copy** (they are referenced, not duplicated), and only the rest of the prompt is
  computed. A page that fails its checksum or cannot be read is a miss, recomputed.
- Full pages of the sequence are handed to the controller's index once every layer of them is written, and
  from there written through to the store.

Only full-attention decoder layers (Llama, Qwen2/3, Mistral without a sliding window, DeepSeek-V3's cached
MLA latents, …) and batch size 1 are supported; anything else is refused up front with one clear error.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from dataclasses import asdict, dataclass
from typing import Any
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from .._errors import ClosedError, InvalidArgumentError, KvtierError
from ..controller import TierController
from ..pools import host_pool_for
from ..store import DEFAULT_CAPACITY, PageStore, page_hashes

#: The transformers version this module is tested with (its ``Cache`` API changes between minor versions).
TESTED_TRANSFORMERS = "5.24.0"
# config entries that do not change a layer's KV (the rest, unknown ones included, name the namespace)
_NOT_KV = {"_name_or_path", "transformers_version", "use_cache", "output_attentions", "output_hidden_states",
           "return_dict", "_commit_hash", "dtype", "torch_dtype", "id2label", "label2id", "problem_type",
           "chunk_size_feed_forward", "tokenizer_class", "prefix", "task_specific_params"}


@dataclass
class TransformersStats:
    """Counters of one :class:`KVTier` (every cache it made)."""

    caches: int = 0
    restored_pages: int = 0  # pages of a prompt served instead of computed ...
    restored_host_pages: int = 0  # ... from the host pool
    restored_store_pages: int = 0  # ... from the store (or the cluster tier behind it)
    computed_tokens: int = 0  # tokens whose KV the model computed (summed over layers / layers)
    adopted_pages: int = 0  # full pages handed to the index (then to the store)
    layer_loads: int = 0  # host -> device per-layer loads
    on_demand_loads: int = 0  # ... of which a layer waited for because it had not been prefetched
    unverified_sequences: int = 0  # caches fed tokens the pre-hook did not see (nothing of them persisted)


class _Window:
    """``window`` device slots seen as a kvtier device pool of ``layer_num`` layers (layer l is slot
    l % window; row ``page_size + t`` holds token t, rows ``[0, page_size)`` are the padding page)."""

    def __init__(self, layers: int, window: int, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device, page_size: int, tokens: int) -> None:
        self.layer_num, self.window, self.head_num, self.head_dim, self.v_head_dim = layers, window, heads, k_dim, v_dim
        self.dtype = self.store_dtype = dtype
        self.device, self.page_size = device, page_size
        self._alloc(self.headroom(tokens))

    def _alloc(self, tokens: int) -> None:
        ps = self.page_size
        self.size = max(1, -(-tokens // ps)) * ps
        shape = (self.size + ps, self.head_num)
        self.k_slots = [torch.zeros(*shape, self.head_dim, dtype=self.dtype, device=self.device) for _ in range(self.window)]
        self.v_slots = [torch.zeros(*shape, self.v_head_dim, dtype=self.dtype, device=self.device) for _ in range(self.window)]
        self.k_buffer = [self.k_slots[i % self.window] for i in range(self.layer_num)]
        self.v_buffer = [self.v_slots[i % self.window] for i in range(self.layer_num)]
        self.state: list[tuple[int, int, int] | None] = [None] * self.window  # (layer, tokens, epoch) held
        self.loaded: list[Any] = [None] * self.window  # CUDA event of the slot's last load

    def ensure(self, tokens: int) -> bool:
        """Room for ``tokens``; True when the slots were reallocated (their contents are gone)."""
        if tokens <= self.size:
            return False
        self._alloc(max(self.headroom(tokens), self.size * 3 // 2))
        return True

    def headroom(self, tokens: int) -> int:
        """Slot size for ``tokens``: room for some more, so decoding does not reallocate at every page."""
        return tokens + max(8 * self.page_size, tokens // 16)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_slots, *self.v_slots))


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"invalid argument `{name}`: must be a positive int, got {value!r}")
    return value


def _token_list(name: str, token_ids: Any) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise InvalidArgumentError(f"invalid argument `{name}`: expected one sequence of token ids (batch size 1), "
                                       f"got a {tuple(token_ids.shape)} {token_ids.dtype} tensor")
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in token_ids):
        raise InvalidArgumentError(f"invalid argument `{name}`: expected token ids (ints in [0, 2**32)) of one sequence")
    if not token_ids:
        raise InvalidArgumentError(f"invalid argument `{name}`: empty")
    return list(token_ids)


class KVTier:
    """kvtier's host pool, store and policy for one transformers model (see the module docs).

    Args:
        model: a transformers causal LM (``PreTrainedModel``) whose every decoder layer is full attention.
        model_id: names the weights in the namespace (default: ``model.config.name_or_path`` and its commit);
            required for a model built from a config (random or your own weights): KV of other weights with
            the same config must never be served.
        page_size: tokens per page (the unit of reuse and of every transfer).
        window: layers resident on the device at once (1 … number of layers).
        host_tokens: tokens of KV (every layer) the pinned host pool holds: the live sequence plus the pages
            kept for reuse (least recently used ones are evicted, to the store first if it has them).
        store_dir: a directory for a :class:`kvtier.PageStore` (pages persist across processes), or None.
        store_capacity_bytes: the store's limit.
        cluster: a Mooncake master address: a cluster tier behind the local store (``store_dir`` required).
        pin_memory: pin the host pool (CUDA).
    """

    def __init__(self, model: Any, *, model_id: str | None = None, page_size: int = 16, window: int = 2,
                 host_tokens: int = 65536, store_dir: str | os.PathLike[str] | None = None,
                 store_capacity_bytes: int = DEFAULT_CAPACITY, cluster: str | None = None, pin_memory: bool = True) -> None:
        config = getattr(model, "config", None)
        if config is None or not callable(model) or not hasattr(config, "get_text_config"):
            raise InvalidArgumentError(f"invalid argument `model`: expected a transformers model, got {type(model).__name__}")
        self.page_size = _positive("page_size", page_size)
        _positive("window", window)
        self.host_tokens = _positive("host_tokens", host_tokens)
        if host_tokens < 2 * page_size:
            raise InvalidArgumentError(f"invalid argument `host_tokens`: {host_tokens} is less than two pages of {page_size}")
        if store_dir is not None and not isinstance(store_dir, (str, os.PathLike)):
            raise InvalidArgumentError(f"invalid argument `store_dir`: expected a path, got {store_dir!r}")
        if cluster is not None and (not isinstance(cluster, str) or store_dir is None):
            raise InvalidArgumentError("invalid argument `cluster`: a Mooncake master address (str), with `store_dir` set")
        if model_id is None:
            name = getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")
            if not name:
                raise InvalidArgumentError(
                    "invalid argument `model_id`: the model has no name_or_path (it was built from a config), so "
                    "nothing names its weights; pass model_id= naming them (KV of other weights must never be served)")
            model_id = f"{name}@{getattr(config, '_commit_hash', None) or 'local'}"
        if not isinstance(model_id, str) or not model_id:
            raise InvalidArgumentError(f"invalid argument `model_id`: expected a non-empty str, got {model_id!r}")
        text = config.get_text_config(decoder=True)
        probe = DynamicCache(config=text)
        others = sorted({type(layer).__name__ for layer in probe.layers if type(layer) is not DynamicLayer})
        if not probe.layers or others:
            raise InvalidArgumentError(
                f"invalid argument `model`: kvtier's cache needs every decoder layer to be full attention; "
                f"{type(model).__name__} has {', '.join(others) or 'no layers'} (sliding-window, linear or shared layers)")
        self.layers = len(probe.layers)
        if window > self.layers:
            raise InvalidArgumentError(f"invalid argument `window`: {window} is more than the model's {self.layers} layers")
        self.window = window
        # one token through the model tells the KV geometry each layer caches (heads, K and V dims, dtype)
        device = next(iter(model.parameters())).device
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), cache=probe, use_cache=True)
        shapes = {(tuple(layer.keys.shape[1:2] + layer.keys.shape[3:]), tuple(layer.values.shape[1:2] + layer.values.shape[3:]),
                   layer.keys.dtype, layer.keys.device) for layer in probe.layers}
        if len(shapes) != 1:
            raise InvalidArgumentError(f"invalid argument `model`: its layers cache KV of different shapes: {shapes}")
        (heads, k_dim), (v_heads, v_dim), dtype, kv_device = shapes.pop()
        if heads != v_heads:
            raise InvalidArgumentError(f"invalid argument `model`: K has {heads} heads and V {v_heads}; kvtier needs equal")
        self.heads, self.k_dim, self.v_dim, self.dtype, self.device = heads, k_dim, v_dim, dtype, kv_device
        self.cuda = kv_device.type == "cuda"
        fields = {k: v for k, v in text.to_dict().items() if k not in _NOT_KV}
        fields.update(_kvtier="transformers-v1", attn=getattr(text, "_attn_implementation", None), device=kv_device.type,
                      kv=[heads, k_dim, v_dim, str(dtype)])
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]
        self.model_name = f"hf:{model_id}:{digest}"
        self.stats = TransformersStats()
        self._template = _Window(self.layers, 1, heads, k_dim, v_dim, dtype, kv_device, page_size, page_size)
        token_bytes = (k_dim + v_dim) * heads * self.layers * torch.empty((), dtype=dtype).element_size()
        self.host = host_pool_for(self._template, host_size_gb=(host_tokens + page_size) * token_bytes / 1e9,
                                  layout="page_first_direct", pin_memory=pin_memory)
        self.store: Any = None
        self.page_store: PageStore | None = None
        try:
            if store_dir is not None:
                self.page_store = PageStore(store_dir, capacity_bytes=store_capacity_bytes, model_name=self.model_name)
                self.page_store.register_mem_pool_host(self.host)
                self.store = self.page_store
                if cluster is not None:
                    from ..tiers import TieredStore
                    from ..tiers.mooncake import MooncakeTier

                    remote = MooncakeTier(cluster, model_name=self.model_name)
                    remote.register_mem_pool_host(self.host)
                    self.store = TieredStore([("disk", self.page_store), ("mooncake", remote)])
            self.controller = TierController(self._template, self.host, self.store, write_policy="write_through")
        except BaseException:
            if self.store is not None:
                self.store.close()
            elif self.page_store is not None:
                self.page_store.close()
            self.host.close()
            raise
        self.stream = torch.cuda.Stream(kv_device) if self.cuda else None
        self._closed = False
        tier_ref = weakref.ref(self)

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            tier = tier_ref()
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if tier is not None and isinstance(cache, KvtierCache) and cache.tier is tier:
                ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
                cache._fed_tokens(ids)

        self._hook = model.register_forward_pre_hook(hook, with_kwargs=True)

    # ------------------------------------------------------------------ public
    def cache(self, token_ids: Any) -> KvtierCache:
        """A cache for the sequence that starts with ``token_ids`` (the prompt: a list or a ``(1, n)`` tensor),
        with the longest run of its full pages kept on the host or in the store restored (at least one token
        is left to compute). Pass the same ids to ``generate``/``model``."""
        self._check_open()
        return KvtierCache(self, _token_list("token_ids", token_ids))

    def drop_host_copies(self) -> int:
        """Evict every unreferenced page from the host pool (after its store write): later restores come from
        the store. Returns the pages dropped (for benchmarks and tests)."""
        self._check_open()
        c = self.controller
        c.wait_idle()
        with c.lock:
            c._poll_locked()
            victims = [k for k, p in c.pages.items() if p.refs == 0 and p.ready]
            for k in victims:
                c._evict_locked(k)
        return len(victims)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("KVTier is closed")

    def close(self) -> None:
        """Wait for the store writes, then release the host pool and the store. Caches made by this tier must
        not be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self._hook.remove()
        if self.stream is not None:
            self.stream.synchronize()
        try:
            self.controller.close()
        finally:
            if self.store is not None:
                self.store.close()
            self.host.close()

    def __enter__(self) -> KVTier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KVTier({self.model_name!r}, layers={self.layers}, heads={self.heads}, k_dim={self.k_dim}, "
                f"v_dim={self.v_dim}, dtype={self.dtype}, page_size={self.page_size}, window={self.window})")

    def stats_dict(self) -> dict[str, Any]:
        return dict(asdict(self.stats), controller=asdict(self.controller.stats))


class _Table:
    """The host pages of one sequence: ``starts[j]`` (host token slot of page j) and ``keys[j]`` (the index
    key of a page the controller owns and this sequence references, None for a private page)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.keys: list[str | None] = []

    def release(self, tier: KVTier, first: int = 0) -> None:
        starts, keys = self.starts[first:], self.keys[first:]
        del self.starts[first:], self.keys[first:]
        if tier._closed or not starts:
            return
        if tier.stream is not None:
            tier.stream.synchronize()  # no transfer in flight may still touch a page given back
        tier.controller.release([k for k in keys if k is not None])
        tier.controller.free([s for s, k in zip(starts, keys) if k is None])


def _release(tier: KVTier, table: _Table) -> None:
    try:
        table.release(tier)
    except Exception:  # noqa: BLE001 - a finalizer never raises; the pages are then lost to this pool only
        pass


class _Layer(DynamicLayer):
    """One layer's view of a :class:`KvtierCache`: its length (the KV itself lives in kvtier's pools)."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class KvtierCache(DynamicCache):
    """The KV cache of one sequence, kept in a :class:`KVTier` (see the module docs); made by
    :meth:`KVTier.cache`. ``restored_tokens``, ``restored_host_pages`` and ``restored_store_pages`` say what
    its prompt did not have to compute."""

    def __init__(self, tier: KVTier, token_ids: list[int]) -> None:
        Cache.__init__(self, layers=[_Layer() for _ in range(tier.layers)])
        self.tier = tier
        self.table = _Table()
        self._finalizer = weakref.finalize(self, _release, tier, self.table)
        self._fed: list[int] = []  # token ids the model was fed (restored ones first)
        self._verified = True
        self._adopted = 0  # pages [0, _adopted) are in the controller's index (or were refused)
        self._epoch = 0
        self._window: _Window | None = None
        self._idx: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.restored_tokens = self.restored_host_pages = self.restored_store_pages = 0
        tier.stats.caches += 1
        self._restore(token_ids)

    # ------------------------------------------------------------------ restore
    def _restore(self, tokens: list[int]) -> None:
        tier, ps = self.tier, self.tier.page_size
        n = (len(tokens) - 1) // ps  # at least one token is left to compute (the model must give logits)
        if n <= 0:
            return
        keys = page_hashes(tokens[: n * ps], ps)
        ctrl = tier.controller
        host, disk = ctrl.match(keys)
        if disk:
            ctrl.prefetch(keys[: host + disk]).result()
        starts = ctrl.acquire(keys)
        r = len(starts)
        self.table.starts, self.table.keys = list(starts), list(keys[:r])
        self._adopted = r
        self._fed = tokens[: r * ps]
        for layer in self.layers:
            layer.length = r * ps
        self.restored_tokens = r * ps
        self.restored_host_pages = min(host, r)
        self.restored_store_pages = r - self.restored_host_pages
        tier.stats.restored_pages += r
        tier.stats.restored_host_pages += self.restored_host_pages
        tier.stats.restored_store_pages += self.restored_store_pages
        if r:
            win = self._ensure_window(r * ps)
            for layer_idx in range(tier.window):  # the first layers move while the embeddings compute
                self._load(win, layer_idx, r * ps)

    # ------------------------------------------------------------------ helpers
    def _fed_tokens(self, ids: Any) -> None:
        """The forward pre-hook: the ids about to be fed (their KV gets keyed by them)."""
        if not self._verified:
            return
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or len(self._fed) != self.get_seq_length():
            self._unverified()
            return
        self._fed.extend(ids[0].tolist())

    def _unverified(self) -> None:
        if self._verified:
            self._verified = False
            self.tier.stats.unverified_sequences += 1

    def _slots(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host slots, device rows) of pages [first, last), cached so repeated transfers are validated once."""
        got = self._idx.get((first, last))
        if got is None:
            ps = self.tier.page_size
            starts = torch.tensor(self.table.starts[first:last], dtype=torch.int64)
            host = (starts[:, None] + torch.arange(ps)[None]).reshape(-1)
            got = host, torch.arange(ps + first * ps, ps + last * ps, dtype=torch.int64)
            if len(self._idx) > 8:
                self._idx.clear()
            self._idx[(first, last)] = got
        return got

    def _ensure_window(self, tokens: int) -> _Window:
        t = self.tier
        if self._window is None:
            self._window = _Window(t.layers, t.window, t.heads, t.k_dim, t.v_dim, t.dtype, t.device, t.page_size, tokens)
        elif self._window.size < tokens:
            if t.stream is not None:
                t.stream.synchronize()  # nothing in flight may touch the old slots
            self._window.ensure(tokens)
        return self._window

    def _grow(self, tokens: int) -> None:
        need = -(-tokens // self.tier.page_size) - len(self.table.starts)
        if need > 0:
            got = self.tier.controller.allocate(need)
            if got is None:
                raise KvtierError(
                    f"kvtier host pool full: {tokens} tokens of this sequence do not fit next to the pages other "
                    f"live caches hold (KVTier(host_tokens={self.tier.host_tokens})); raise host_tokens")
            self.table.starts += got
            self.table.keys += [None] * len(got)

    def _load(self, win: _Window, layer_idx: int, tokens: int) -> None:
        """Host -> slot of ``layer_idx``: its first ``tokens`` tokens (whole pages), on the transfer stream
        after the compute stream's work so far (the slot's previous user included)."""
        tier = self.tier
        s = layer_idx % win.window
        host, dev = self._slots(0, -(-tokens // tier.page_size))
        if tier.stream is not None:
            tier.stream.wait_stream(torch.cuda.current_stream(tier.device))
            with torch.cuda.stream(tier.stream):
                tier.host.load_to_device_per_layer(win, host, dev, layer_idx, "direct")
                win.loaded[s] = tier.stream.record_event()
        else:
            tier.host.load_to_device_per_layer(win, host, dev, layer_idx, "direct")
        win.state[s] = (layer_idx, tokens, self._epoch)
        tier.stats.layer_loads += 1

    # ------------------------------------------------------------------ the Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        tier = self.tier
        tier._check_open()
        if not 0 <= layer_idx < tier.layers:
            raise InvalidArgumentError(f"invalid argument `layer_idx`: {layer_idx} not in [0, {tier.layers})")
        want_k, want_v = (1, tier.heads, key_states.shape[-2], tier.k_dim), (1, tier.heads, key_states.shape[-2], tier.v_dim)
        if tuple(key_states.shape) != want_k or tuple(value_states.shape) != want_v or key_states.dtype != tier.dtype \
                or value_states.dtype != tier.dtype or key_states.device != tier.device:
            raise InvalidArgumentError(
                f"invalid argument `key_states`/`value_states`: expected {want_k} and {want_v} {tier.dtype} on "
                f"{tier.device} (batch size 1), got {tuple(key_states.shape)} {key_states.dtype} and "
                f"{tuple(value_states.shape)} {value_states.dtype} on {key_states.device}")
        ps, layer = tier.page_size, self.layers[layer_idx]
        t0 = layer.get_seq_length()
        t1 = t0 + key_states.shape[-2]
        self._grow(t1)
        win = self._ensure_window(t1)
        s = layer_idx % win.window
        if t0 and win.state[s] != (layer_idx, t0, self._epoch):
            tier.stats.on_demand_loads += 1
            self._load(win, layer_idx, t0)
        compute = torch.cuda.current_stream(tier.device) if tier.cuda else None
        if compute is not None and win.loaded[s] is not None:
            compute.wait_event(win.loaded[s])
        ks, vs = win.k_slots[s], win.v_slots[s]
        ks[ps + t0 : ps + t1].copy_(key_states[0].transpose(0, 1))
        vs[ps + t0 : ps + t1].copy_(value_states[0].transpose(0, 1))
        # copies (never views: the slot is reused as soon as attention has been enqueued; with one head a
        # transposed view would count as contiguous and .contiguous() would not copy)
        keys = ks[ps : ps + t1].transpose(0, 1).unsqueeze(0).clone(memory_format=torch.contiguous_format)
        values = vs[ps : ps + t1].transpose(0, 1).unsqueeze(0).clone(memory_format=torch.contiguous_format)
        layer.length = t1
        win.state[s] = (layer_idx, t1, self._epoch)
        # the pages this step wrote go to the host (this layer only); then the slot takes the layer `window`
        # ahead (the next forward's first layers once the last ones are done)
        host, dev = self._slots(t0 // ps, -(-t1 // ps))
        # the slot's next user: the layer `window` ahead, or past the last layer the next forward's layer of
        # the same slot (layers need not be a multiple of the window)
        nxt = layer_idx + win.window if layer_idx + win.window < tier.layers else layer_idx % win.window
        nxt_len = self.layers[nxt].get_seq_length()
        if tier.stream is not None and compute is not None:
            tier.stream.wait_stream(compute)
            with torch.cuda.stream(tier.stream):
                tier.host.backup_from_device_per_layer(win, host, dev, layer_idx, "direct")
        else:
            tier.host.backup_from_device_per_layer(win, host, dev, layer_idx, "direct")
        if nxt != layer_idx and nxt_len:
            self._load(win, nxt, nxt_len)
        if layer_idx == tier.layers - 1:
            tier.stats.computed_tokens += t1 - t0
            self._adopt(t1)
        return keys, values

    def _adopt(self, tokens: int) -> None:
        """Hand the sequence's newly completed pages to the controller's index (keyed by the fed tokens)."""
        if not self._verified:
            return
        if len(self._fed) != tokens:
            self._unverified()
            return
        ps, tier = self.tier.page_size, self.tier
        first, full = self._adopted, tokens // ps
        if full <= first:
            return
        prior = self.table.keys[first - 1] if first else None
        keys = page_hashes(self._fed[first * ps : full * ps], ps, prior)
        event = tier.stream.record_event() if tier.stream is not None else None
        took = tier.controller.adopt(keys, self.table.starts[first:full], event=event)
        for j, (k, ok) in enumerate(zip(keys, took), start=first):
            if ok:
                self.table.keys[j] = k
        tier.stats.adopted_pages += sum(took)
        self._adopted = full

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (a negative int, as transformers' ``crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                             "Please use a negative integer to remove that number of tokens from the cache instead.")
        if tokens_to_remove == 0:
            return
        self._truncate(max(0, self.get_seq_length() + tokens_to_remove))

    def reset(self) -> None:
        self._truncate(0)

    def _truncate(self, tokens: int) -> None:
        tier, ps = self.tier, self.tier.page_size
        tier._check_open()
        keep = -(-tokens // ps)
        self.table.release(tier, keep)
        j = tokens // ps
        shared = self.table.keys[j] if tokens % ps else None
        if shared is not None:  # a shared page gets written again: copy it first
            got = tier.controller.allocate(1)
            if got is None:
                raise KvtierError("kvtier host pool full: no page to copy a shared page into; raise host_tokens")
            if tier.stream is not None:
                tier.stream.synchronize()
            old, new = self.table.starts[j] // ps, got[0] // ps
            for buf in (tier.host.k_buffer, tier.host.v_buffer):
                buf[new].copy_(buf[old])
            tier.controller.release([shared])
            self.table.starts[j], self.table.keys[j] = got[0], None
        self._adopted = min(self._adopted, j)
        del self._fed[tokens:]
        for layer in self.layers:
            layer.length = tokens
        self._epoch += 1
        self._idx.clear()

    def release(self) -> None:
        """Give the sequence's host pages back now (else when the cache is garbage collected)."""
        self._finalizer()
        for layer in self.layers:
            layer.length = 0
        self._window = None

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
        tier, ps = self.tier, self.tier.page_size
        tokens = self.get_seq_length(layer_idx) if tokens is None else tokens
        if not 0 <= layer_idx < tier.layers or not 0 <= tokens <= self.get_seq_length(layer_idx):
            raise InvalidArgumentError(f"invalid argument `layer_idx`/`tokens`: {layer_idx}, {tokens}")
        if tier.stream is not None:
            tier.stream.synchronize()
        pages = [s // ps for s in self.table.starts[: -(-tokens // ps)]]
        out = []
        for buf in (tier.host.k_buffer, tier.host.v_buffer):  # (pages, layers, page_size, heads, dim)
            rows = buf[pages, layer_idx].reshape(-1, tier.heads, buf.shape[-1])[:tokens]
            out.append(rows.transpose(0, 1).unsqueeze(0).contiguous())
        return out[0], out[1]

    @property
    def window_bytes(self) -> int:
        """Device bytes of this cache's layer slots."""
        return 0 if self._window is None else self._window.nbytes

    def __repr__(self) -> str:
        return (f"KvtierCache(tokens={self.get_seq_length()}, restored={self.restored_tokens}, "
                f"window={self.tier.window}/{self.tier.layers})")
