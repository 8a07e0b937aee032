"""kvtier as a Hugging Face transformers KV cache (the ``Cache`` API of transformers 5.19 to 5.24; tested with
the releases in :data:`TESTED_TRANSFORMERS`: 5.19.0 as SGLang 0.5.23 pins it, 5.20.2 as vLLM 0.33.0 resolves
it, and 5.24.0).

:class:`KVTier` is built once per model: a pinned kvtier host pool that holds every layer's KV of the live
sequence and the pages kept for reuse, a :class:`kvtier.TierController` over it, and optionally a
:class:`kvtier.PageStore` (and tiers behind it: a Mooncake cluster, any tier of :data:`kvtier.tier.TIERS`).
:meth:`KVTier.cache` gives a :class:`KvtierCache` for one sequence, which ``model(...)`` and ``generate()`` take
as ``cache=`` (or the deprecated ``past_key_values=``; releases before the ``cache`` name, such as 5.19 and 5.20,
take only ``past_key_values=``: :func:`cache_kwarg` tells which)::

    tier = KVTier(model, model_id="my-org/my-model", page_size=16)
    out = model.generate(ids, cache=tier.cache(ids), max_new_tokens=32)  # past_key_values= before the rename

- **Layers stay or stream.** By default (``window="auto"``) a sequence keeps every layer on the GPU when they
  fit in half of its free memory, as transformers' own cache does. With a fixed ``window`` (or a sequence too
  long for that), the GPU holds ``window`` layer slots; layer ``l`` uses slot ``l % window``. When layer
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
import inspect
import json
import os
import warnings
import weakref
from dataclasses import asdict
from typing import Any
from collections.abc import Sequence

import torch
import transformers
from transformers.cache_utils import DynamicCache, DynamicLayer

from ..._errors import InvalidArgumentError
from ...config import parse_size
from ...controller import TierController
from ...deadlines import check_deadline
from ...planner import PrefillModel
from ...namespace import check_value
from ...pools import host_pool_for
from ...store import DEFAULT_CAPACITY, PageStore
from ...tier import TierContext, TierSpec, build_tiers, check_tier_chain
from .cache import KvtierCache
from .plan import calibrate as _calibrate
from .state import TierRuntime, TransformersStats
from .window import DeviceWindow

__all__ = ["KVTier", "KvtierCache", "TransformersStats", "TESTED_TRANSFORMERS", "RESTORE_MODES", "cache_kwarg"]

#: ``KVTier(restore=...)``: ``"plan"`` decides every restore with measurements; ``"all"`` takes every cached page
RESTORE_MODES = ("plan", "all")

#: The transformers releases this module is tested with (its ``Cache`` API changes between minor releases):
#: 5.19.0 (SGLang 0.5.23's pin), 5.20.2 (the newest vLLM 0.33.0 allows) and 5.24.0. :class:`KVTier` warns
#: with any other release.
TESTED_TRANSFORMERS: frozenset[str] = frozenset({"5.19.0", "5.20.2", "5.24.0"})
# config entries that do not change a layer's KV (the rest, unknown ones included, name the namespace)
_NOT_KV = {"_name_or_path", "transformers_version", "use_cache", "output_attentions", "output_hidden_states",
           "return_dict", "_commit_hash", "dtype", "torch_dtype", "id2label", "label2id", "problem_type",
           "chunk_size_feed_forward", "tokenizer_class", "prefix", "task_specific_params"}


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
        if token_ids.dtype == torch.bool or token_ids.is_complex():
            raise InvalidArgumentError(f"invalid argument `{name}`: expected integer token ids, got {token_ids.dtype}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= 2**32):
            raise InvalidArgumentError(f"invalid argument `{name}`: expected token ids (ints in [0, 2**32)) of one sequence")
        out: list[int] = token_ids.tolist()  # an integer tensor's elements are ints: checked as a whole above
        if not out:
            raise InvalidArgumentError(f"invalid argument `{name}`: empty")
        return out
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, (str, bytes)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in token_ids):
        raise InvalidArgumentError(f"invalid argument `{name}`: expected token ids (ints in [0, 2**32)) of one sequence")
    if not token_ids:
        raise InvalidArgumentError(f"invalid argument `{name}`: empty")
    return list(token_ids)


def cache_kwarg(model: Any) -> str:
    """The name ``model``'s forward takes a cache by: ``cache`` where it has that parameter (newer releases, e.g.
    5.24, which still take the deprecated ``past_key_values`` too), else ``past_key_values`` (e.g. 5.19, 5.20)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "cache"
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


class KVTier:
    """kvtier's host pool, store and policy for one transformers model (see the module docs).

    Args:
        model: a transformers causal LM (``PreTrainedModel``) whose every decoder layer is full attention.
        model_id: names the weights in the namespace (default: ``model.config.name_or_path`` and its commit);
            required for a model built from a config (random or your own weights): KV of other weights with
            the same config must never be served.
        page_size: tokens per page (the unit of reuse and of every transfer).
        window: layers resident on the device at once: ``"auto"`` (default) keeps every layer of a sequence
            on the device when their slots take at most half of the device's free memory as the sequence
            starts (as transformers' own cache does; decided again for every sequence), else as many layers as
            that half holds (at least 2); or a fixed number (1 … number of layers): the GPU then holds that
            many layers and streams the others in from the host pool while the model runs.
        host_tokens: tokens of KV (every layer) the pinned host pool holds: the live sequence plus the pages
            kept for reuse (least recently used ones are evicted, to the store first if it has them).
        store_dir: a directory for a :class:`kvtier.PageStore` (pages persist across processes), or None.
        store_capacity_bytes: the disk budget of the whole ``store_dir`` directory (every model's namespace in
            it, in every process, together); least-recently-used pages of this model are evicted to keep it.
        tiers: tiers behind the local store (``store_dir`` required), in order: specs of
            :func:`kvtier.tier.build_tier` (``"name"`` or ``{"name": {options}}``; any name in
            :data:`kvtier.tier.TIERS`, e.g. ``[{"mooncake": {"master_server_address": "host:port"}}]``), built
            for this model (its namespace's name, the store's keyring).
        cluster: a Mooncake master address: shorthand for ``tiers=[{"mooncake": {"master_server_address":
            cluster}}]``.
        pin_memory: pin the host pool (CUDA).
        restore: ``"plan"`` (default): every restore is decided with measurements — the prefix's pages are
            loaded, recomputed, or its head recomputed while its tail loads, whichever the tiers' measured
            speeds and the model's measured prefill predict fastest (:meth:`TierController.plan_restore`);
            ``"all"``: every cached page is loaded, however slow its tier.
        prefill: the model's prefill cost for planning: a :class:`kvtier.planner.PrefillModel`, or tokens/s;
            default: learned from this tier's own forwards (seeded by a calibration at construction).
        calibrate: with a learned prefill model, time a few forwards of random tokens at construction (up
            to 4K tokens) so the first request is planned with a model.
        keyring: seal the store's pages at rest (:class:`kvtier.PageStore`'s ``keyring``).
        store_compression: the store's ``compression`` (:class:`kvtier.PageStore`): ``"auto"`` (default) stores
            bf16, fp16 and fp8 pages losslessly compressed, ``"off"`` as they are.
        restore_deadline: how long a restore waits for the store before it recomputes what has not arrived
            (:class:`kvtier.TierController`'s): ``"auto"`` (default, from the model's prefill time), seconds, or
            None (as long as the IO takes).
    """

    def __init__(self, model: Any, *, model_id: str | None = None, page_size: int = 16, window: int | str = "auto",
                 host_tokens: int = 65536, store_dir: str | os.PathLike[str] | None = None,
                 store_capacity_bytes: int | str = DEFAULT_CAPACITY, cluster: str | None = None, pin_memory: bool = True,
                 restore: str = "plan", prefill: PrefillModel | float | None = None, calibrate: bool = True,
                 keyring: Any = None, store_compression: str = "auto",
                 restore_deadline: float | str | None = "auto", tiers: Sequence[TierSpec] | None = None) -> None:
        config = getattr(model, "config", None)
        if config is None or not callable(model) or not hasattr(config, "get_text_config"):
            raise InvalidArgumentError(f"invalid argument `model`: expected a transformers model, got {type(model).__name__}")
        self.page_size = _positive("page_size", page_size)
        if window != "auto":
            if isinstance(window, str):
                raise InvalidArgumentError(f"invalid argument `window`: \"auto\" or a number of layers, got {window!r}")
            _positive("window", window)
        self.host_tokens = _positive("host_tokens", host_tokens)
        if host_tokens < 2 * page_size:
            raise InvalidArgumentError(f"invalid argument `host_tokens`: {host_tokens} is less than two pages of {page_size}")
        if store_dir is not None and (not isinstance(store_dir, (str, os.PathLike)) or not os.fspath(store_dir)):
            raise InvalidArgumentError(f"invalid argument `store_dir`: expected a non-empty path, got {store_dir!r}")
        store_capacity_bytes = parse_size("store_capacity_bytes", store_capacity_bytes, 4096)
        if not isinstance(pin_memory, bool):
            raise InvalidArgumentError(f"invalid argument `pin_memory`: must be a bool, got {pin_memory!r}")
        restore_deadline = check_deadline("restore_deadline", restore_deadline, auto=True)
        if restore not in RESTORE_MODES:
            raise InvalidArgumentError(f"invalid argument `restore`: {restore!r}; expected one of {RESTORE_MODES}")
        if isinstance(prefill, (int, float)) and not isinstance(prefill, bool):
            prefill = PrefillModel.fixed(prefill, name="prefill")
        elif prefill is not None and not isinstance(prefill, PrefillModel):
            raise InvalidArgumentError(f"invalid argument `prefill`: a PrefillModel or tokens/s, got {prefill!r}")
        if cluster is not None and (not isinstance(cluster, str) or store_dir is None):
            raise InvalidArgumentError("invalid argument `cluster`: a Mooncake master address (str), with `store_dir` set")
        remote, remote_arg = _tier_chain(cluster, tiers, store_dir), "cluster" if cluster is not None else "tiers"
        if model_id is None:
            name = getattr(config, "name_or_path", "")
            if not name:
                raise InvalidArgumentError(
                    "invalid argument `model_id`: the model has no name_or_path (it was built from a config), so "
                    "nothing names its weights; pass model_id= naming them (KV of other weights must never be served)")
            commit = getattr(config, "_commit_hash", None)
            if not commit:
                raise InvalidArgumentError(
                    f"invalid argument `model_id`: {name!r} has no hub commit (a local checkpoint), so its path does "
                    "not name its weights (new weights saved there would share the namespace); pass model_id= naming them")
            model_id = f"{name}@{commit}"
        if not isinstance(model_id, str) or not model_id:
            raise InvalidArgumentError(f"invalid argument `model_id`: expected a non-empty str, got {model_id!r}")
        check_value("model_id", model_id)
        if transformers.__version__ not in TESTED_TRANSFORMERS:
            tested = ", ".join(sorted(TESTED_TRANSFORMERS, key=lambda v: tuple(map(int, v.split(".")))))
            warnings.warn(f"kvtier.integrations.transformers is tested with transformers {tested}; this is "
                          f"{transformers.__version__} (its Cache API changes between minor releases)", stacklevel=2)
        text = config.get_text_config(decoder=True)
        if getattr(config, "is_encoder_decoder", False) or text is not config:
            raise InvalidArgumentError(
                f"invalid argument `model`: {type(model).__name__} is an encoder-decoder or multimodal model; kvtier's "
                "cache keys pages by the decoder's own token ids and supports decoder-only language models")
        probe = DynamicCache(config=text)
        others = sorted({type(layer).__name__ for layer in probe.layers if type(layer) is not DynamicLayer})
        if not probe.layers or others:
            raise InvalidArgumentError(
                f"invalid argument `model`: kvtier's cache needs every decoder layer to be full attention; "
                f"{type(model).__name__} has {', '.join(others) or 'no layers'} (sliding-window, linear or shared layers)")
        self.layers = len(probe.layers)
        if window != "auto" and window > self.layers:  # type: ignore[operator]
            raise InvalidArgumentError(f"invalid argument `window`: {window} is more than the model's {self.layers} layers")
        self.window = window
        # one token through the model tells the KV geometry each layer caches (heads, K and V dims, dtype)
        device = next(iter(model.parameters())).device
        try:
            with torch.no_grad():
                model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True,
                      **{cache_kwarg(model): probe})
        except Exception as exc:  # noqa: BLE001 - any model that cannot run one token this way is not supported
            raise InvalidArgumentError(f"invalid argument `model`: {type(model).__name__} did not run one token with a "
                                       f"cache ({type(exc).__name__}: {exc})") from exc
        shapes = {(tuple(layer.keys.shape[1:2] + layer.keys.shape[3:]), tuple(layer.values.shape[1:2] + layer.values.shape[3:]),
                   layer.keys.dtype, layer.keys.device) for layer in probe.layers}
        if len(shapes) != 1:
            raise InvalidArgumentError(f"invalid argument `model`: its layers cache KV of different shapes: {shapes}")
        (heads, k_dim), (v_heads, v_dim), dtype, kv_device = shapes.pop()
        if heads != v_heads:
            raise InvalidArgumentError(f"invalid argument `model`: K has {heads} heads and V {v_heads}; kvtier needs equal")
        self.heads, self.k_dim, self.v_dim, self.dtype, self.device = heads, k_dim, v_dim, dtype, kv_device
        self.cuda = kv_device.type == "cuda"
        self.attn_implementation = getattr(text, "_attn_implementation", None)  # part of the namespace: checked per use
        fields = {k: v for k, v in text.to_dict().items() if k not in _NOT_KV}
        fields.update(_kvtier="transformers-v1", attn=getattr(text, "_attn_implementation", None), device=kv_device.type,
                      kv=[heads, k_dim, v_dim, str(dtype)])
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]
        self.model_name = f"hf:{model_id}:{digest}"
        stats = TransformersStats()
        self._template = DeviceWindow(self.layers, 1, heads, k_dim, v_dim, dtype, kv_device, page_size, page_size)
        token_bytes = (k_dim + v_dim) * heads * self.layers * torch.empty((), dtype=dtype).element_size()
        if store_dir is not None and store_capacity_bytes < 2 * page_size * token_bytes:
            raise InvalidArgumentError(f"invalid argument `store_capacity_bytes`: {store_capacity_bytes} holds less than "
                                       f"two pages of {page_size * token_bytes} bytes")
        try:
            self.host = host_pool_for(self._template, host_size_gb=(host_tokens + page_size) * token_bytes / 1e9,
                                      layout="page_first_direct", pin_memory=pin_memory)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"invalid argument `host_tokens`: {host_tokens} tokens of KV "
                                       f"({(host_tokens + page_size) * token_bytes / 1e9:.2f} GB): {exc}") from exc
        self.store: Any = None
        self.page_store: PageStore | None = None
        try:
            if store_dir is not None:
                self.page_store = PageStore(store_dir, capacity_bytes=store_capacity_bytes,
                                            budget_bytes=store_capacity_bytes, model_name=self.model_name,
                                            keyring=keyring, compression=store_compression)
                self.page_store.register_mem_pool_host(self.host)
                self.store = self.page_store
                if remote:
                    from ...tiers import TieredStore

                    context = TierContext(model_name=self.model_name, keyring=self.page_store.keyring)
                    try:
                        built = build_tiers(remote, context, self.host)
                    except InvalidArgumentError as exc:
                        raise InvalidArgumentError(f"invalid argument `{remote_arg}`: {exc}") from exc
                    self.store = TieredStore([("disk", self.page_store), *zip([n for n, _ in remote], built)])
            self.controller = TierController(self._template, self.host, self.store, write_policy="write_through",
                                             prefill=prefill, probe=restore == "plan",
                                             restore_deadline=restore_deadline)
        except BaseException:
            if self.store is not None:
                self.store.close()
            elif self.page_store is not None:
                self.page_store.close()
            self.host.close()
            raise
        self.stream = torch.cuda.Stream(kv_device) if self.cuda else None
        self._lanes = self.host.engine.lanes_for("direct", self.host.sides()) if self.cuda else 1
        # what the caches and the calibration share with this tier (they never see the KVTier's insides)
        self._state = TierRuntime(layers=self.layers, window=None if window == "auto" else int(window), heads=heads, k_dim=k_dim, v_dim=v_dim, dtype=dtype,
                                  device=kv_device, page_size=page_size, host_tokens=host_tokens, host=self.host,
                                  controller=self.controller, stats=stats, restore=restore, model=weakref.ref(model),
                                  cache_kwarg=cache_kwarg(model), text_config=text,
                                  attn_implementation=self.attn_implementation, stream=self.stream, lanes=self._lanes)
        tier_ref = weakref.ref(self)

        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            tier = tier_ref()
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if tier is not None and isinstance(cache, KvtierCache) and cache.tier is tier:
                ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
                cache.before_forward(ids, kwargs)

        def done(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            tier = tier_ref()
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if tier is not None and isinstance(cache, KvtierCache) and cache.tier is tier:
                if args and isinstance(args[0], torch.Tensor) and "input_ids" not in kwargs:
                    kwargs = {**kwargs, "input_ids": args[0]}
                return cache.after_forward(module, kwargs, output)  # (not None: the forward was computed again)
            return None

        self._hook = model.register_forward_pre_hook(hook, with_kwargs=True)
        self._done_hook = model.register_forward_hook(done, with_kwargs=True)
        self._unwrap = _check_generate_inputs(model, tier_ref)
        # a tier dropped without close() leaves no hook behind
        weakref.finalize(self, _unhook, self._hook, self._done_hook, self._unwrap)
        if restore == "plan" and prefill is None and calibrate:
            _calibrate(self, self._state, model, int(getattr(text, "vocab_size", 0) or 2))

    # ------------------------------------------------------------------ public
    def cache(self, token_ids: Any, *, cache_salt: str | None = None) -> KvtierCache:
        """A cache for the sequence that starts with ``token_ids`` (the prompt: a list or a ``(1, n)`` tensor),
        with the longest run of its full pages kept on the host or in the store restored (at least one token
        is left to compute). Pass the same ids to ``generate``/``model``. ``cache_salt``: the request's tenant
        (set by the server, never taken from the caller's input): its pages are keyed for that tenant alone, in
        every tier (:func:`kvtier.tenants.tenant_keys`); ``None``: shared by every request without a salt."""
        self._check_open()
        now = getattr(self._state.text_config, "_attn_implementation", None)
        if now != self.attn_implementation:
            raise InvalidArgumentError(
                f"invalid argument `model`: its attention implementation changed from {self.attn_implementation!r} to "
                f"{now!r} since this KVTier was built (its pages were computed with the first); build a new KVTier")
        tokens = _token_list("token_ids", token_ids)
        self._state.wait_releases()  # (a cache dropped just before gives its pages back first)
        self._state.marks.poll()
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidArgumentError(f"invalid argument `cache_salt`: a non-empty string or None, got {cache_salt!r}")
        return KvtierCache(self, self._state, tokens, salt=cache_salt)

    def calibrate(self, lengths: Sequence[int] | None = None) -> None:
        """Time forwards of random tokens of each of ``lengths`` (default: a few up to 4K tokens) through a
        cache that keeps nothing, for the learned prefill model (also a warm-up of those shapes). Counters
        are left as they were. A no-op with a prefill model the caller fixed."""
        self._check_open()
        model = self._state.model()
        if model is None or not self.controller.prefill.learned:
            return
        if lengths is not None and (isinstance(lengths, (str, bytes)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in lengths)):
            raise InvalidArgumentError(f"invalid argument `lengths`: positive token counts, got {lengths!r}")
        _calibrate(self, self._state, model, int(getattr(self._state.text_config, "vocab_size", 0) or 2),
                   None if lengths is None else list(lengths))

    def drop_host_copies(self) -> int:
        """Evict every unreferenced page from the host pool (after its store write): later restores come from
        the store. Returns the pages dropped (for benchmarks and tests)."""
        self._check_open()
        self._state.wait_releases()  # (the pages of caches garbage collected are unreferenced first)
        self.controller.wait_idle()
        return self.controller.evict_unreferenced()

    @property
    def restore(self) -> str:
        """How the next :meth:`cache` restores a prefix: ``"plan"`` or ``"all"`` (see the constructor); settable
        between requests."""
        return self._state.restore

    @restore.setter
    def restore(self, mode: str) -> None:
        if mode not in RESTORE_MODES:
            raise InvalidArgumentError(f"invalid argument `restore`: {mode!r}; expected one of {RESTORE_MODES}")
        self._state.restore = mode

    @property
    def stats(self) -> TransformersStats:
        """Counters of this tier (every cache it made)."""
        return self._state.stats

    def synchronize(self) -> None:
        """Wait until every transfer this tier issued has completed (a failed one raises its error) and every
        pending forward and TTFT timing has been read into the planner: what a benchmark calls before it reads
        a clock or the planner's statistics."""
        self._state.wait_releases()  # (the pages of caches garbage collected)
        self._state.drain()
        self._state.marks.poll(wait=True)

    def _check_open(self) -> None:
        self._state.check_open()

    def close(self) -> None:
        """Wait for the store writes, then release the host pool and the store. Caches made by this tier must
        not be used afterwards."""
        if self._state.closed:
            return
        self._state.closed = True
        _unhook(self._hook, self._done_hook, self._unwrap)
        self.synchronize()
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


def _tier_chain(cluster: Any, tiers: Any, store_dir: Any) -> list[tuple[str, dict[str, Any]]]:
    """The tiers behind the local store (``tiers``, or ``cluster``'s shorthand), checked before anything opens."""
    if tiers is None:
        if cluster is None:
            return []
        try:
            return check_tier_chain([{"mooncake": {"master_server_address": cluster}}], "cluster")
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"invalid argument `cluster`: {exc}") from exc
    if cluster is not None:
        raise InvalidArgumentError("invalid argument `tiers`: pass `tiers` or its shorthand `cluster`, not both")
    specs = check_tier_chain(tiers, "tiers")
    if specs and store_dir is None:
        raise InvalidArgumentError("invalid argument `tiers`: tiers behind the local store need `store_dir` set")
    return specs


def _unhook(*undo: Any) -> None:
    for u in undo:
        (u.remove if hasattr(u, "remove") else u)()


def _check_generate_inputs(model: Any, tier_ref: Any) -> Any:
    """Wraps ``model.prepare_inputs_for_generation`` (on this instance) so that ``generate`` with a cache of
    the tier refuses ids that differ from the cache's prefix: ``generate`` feeds the model only the tokens
    after the cache's length, so the forward pre-hook alone would never see a prompt that differs inside
    the restored prefix. Returns the undo."""
    original = model.prepare_inputs_for_generation

    def prepare(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        tier = tier_ref()
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if tier is not None and isinstance(cache, KvtierCache) and cache.tier is tier and isinstance(input_ids, torch.Tensor) \
                and input_ids.dim() == 2 and input_ids.shape[0] == 1:
            cache.check_generate_inputs(input_ids, bool(kwargs.get("is_first_iteration")))
        return original(input_ids, *args, **kwargs)

    model.prepare_inputs_for_generation = prepare

    def undo() -> None:
        if model.__dict__.get("prepare_inputs_for_generation") is prepare:
            del model.prepare_inputs_for_generation

    return undo
