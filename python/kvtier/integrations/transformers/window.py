"""The device and host halves of one sequence in kvtier's transformers cache: :class:`DeviceWindow` (the device
layer slots, seen as a kvtier device pool), :class:`PageTable` (the sequence's host pages) and :class:`LayerLength`
(a layer's length, the only part of a transformers cache layer that kvtier keeps outside its pools)."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from .state import TierRuntime


class LayerLength(DynamicLayer):
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


class DeviceWindow:
    """``window`` device slots seen as a kvtier device pool of ``layer_num`` layers (layer l is slot
    l % window; row ``page_size + t`` holds token t, rows ``[0, page_size)`` are the padding page)."""

    def __init__(self, layers: int, window: int, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype,
                 device: torch.device, page_size: int, tokens: int) -> None:
        self.layer_num, self.window, self.head_num, self.head_dim, self.v_head_dim = layers, window, heads, k_dim, v_dim
        self.dtype = self.store_dtype = dtype
        self.device, self.page_size = device, page_size
        # bumped whenever the slots are reallocated: the host pool's check of this device pool holds while
        # it is unchanged (kvtier.pools: `layers_version`); nothing outside this window sees its tensors
        self.layers_version = 0
        self._alloc(self.headroom(tokens))

    def _alloc(self, tokens: int) -> None:
        ps = self.page_size
        self.size = max(1, -(-tokens // ps)) * ps
        shape = (self.size + ps, self.head_num)
        self.k_slots = [torch.zeros(*shape, self.head_dim, dtype=self.dtype, device=self.device) for _ in range(self.window)]
        self.v_slots = [torch.zeros(*shape, self.v_head_dim, dtype=self.dtype, device=self.device) for _ in range(self.window)]
        self.k_buffer = [self.k_slots[i % self.window] for i in range(self.layer_num)]
        self.v_buffer = [self.v_slots[i % self.window] for i in range(self.layer_num)]
        self.layers_version += 1
        self.state: list[tuple[int, int, int] | None] = [None] * self.window  # (layer, tokens, epoch) held
        self.loaded: list[Any] = [None] * self.window  # CUDA event of the slot's last transfer (load or backup)

    def ensure(self, tokens: int) -> bool:
        """Room for ``tokens``; True when the slots were reallocated (their contents are gone)."""
        if tokens <= self.size:
            return False
        self._alloc(max(self.headroom(tokens), self.size * 3 // 2))
        return True

    def headroom(self, tokens: int) -> int:
        """Slot size for ``tokens``: room for some more, so decoding does not reallocate at every page."""
        return slot_tokens(tokens, self.page_size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_slots, *self.v_slots))


class LayerBatch:
    """A window of every layer moving a sequence's pages in one call (each per-layer call costs the host about
    half a millisecond): a restore's loads (:meth:`load`), and a forward's backups, which wait for its last
    layer (:meth:`defer`, :meth:`flush`). No slot is reused within a forward when every layer is resident.
    Used on the devices in :attr:`one_call_devices` (elsewhere a window of every layer moves layer by layer)."""

    #: device types whose windows of every layer move in one call
    one_call_devices: tuple[str, ...] = ("cpu", "cuda")

    def __init__(self) -> None:
        self.deferred: tuple[int, int, list[int]] | None = None  # (t0, t1, layers) of the forward in flight

    @staticmethod
    def load(win: DeviceWindow, st: TierRuntime, slots: Any, epoch: int, tokens: int, wait: Any) -> bool:
        """Every layer's first ``tokens`` tokens to its slot in one call (the cache's ``_load`` for each layer,
        validated and submitted once; ``slots(first, last)`` gives the host slots and device rows of pages
        ``[first, last)``; ``wait``: what the CPU waits for first, or None). False where the window holds fewer
        layers or the slots hold different rows (the caller loads layer by layer)."""
        if win.window < st.layers or win.device.type not in LayerBatch.one_call_devices:
            return False
        kept = set()
        for layer_idx in range(st.layers):
            held = win.state[layer_idx]
            ok = held is not None and held[0] == layer_idx and held[2] == epoch and held[1] <= tokens
            kept.add(held[1] if ok and held is not None else 0)
        if len(kept) != 1:
            return False
        held_tokens = kept.pop()
        if held_tokens == tokens:
            return True
        if wait is not None and not st.cuda:
            wait()
        host, dev = slots(held_tokens // st.page_size, -(-tokens // st.page_size))
        for layer_idx, pending in enumerate(st.transfer_layers(win, host, dev, to_host=False)):
            win.loaded[layer_idx] = pending
            win.state[layer_idx] = (layer_idx, tokens, epoch)
        st.stats.layer_loads += st.layers
        return True

    def defer(self, win: DeviceWindow, layers: int, layer_idx: int, t0: int, t1: int, in_head: bool) -> bool:
        """Whether this layer's backup waits for the forward's last layer: with every layer resident, outside a
        split's head (whose backups the rest of the prompt follows layer by layer), for a forward whose layers
        all write the same rows."""
        if win.window < layers or in_head or win.device.type not in self.one_call_devices:
            return False
        if layer_idx == 0:
            self.deferred = (t0, t1, [])
        d = self.deferred
        if d is None or (d[0], d[1]) != (t0, t1) or len(d[2]) != layer_idx:
            return False
        d[2].append(layer_idx)
        return True

    def flush(self, win: DeviceWindow | None, st: TierRuntime, slots: Any) -> None:
        """Send the deferred backups: one call for every layer, or layer by layer for a forward some of whose
        layers were backed up as they went."""
        d, self.deferred = self.deferred, None
        if d is None or not d[2] or win is None:
            return
        t0, t1, layers = d
        host, dev = slots(t0 // st.page_size, -(-t1 // st.page_size))
        if len(layers) == st.layers:
            for layer_idx, pending in enumerate(st.transfer_layers(win, host, dev, to_host=True)):
                win.loaded[layer_idx] = pending
        else:
            for layer_idx in layers:
                win.loaded[layer_idx % win.window] = st.transfer(win, layer_idx, host, dev, to_host=True)


def slot_tokens(tokens: int, page_size: int) -> int:
    """Tokens a layer slot is made for when the sequence has ``tokens``: room for some more, so decoding does
    not reallocate at every page."""
    return tokens + max(8 * page_size, tokens // 16)


def slot_bytes(tokens: int, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype, page_size: int) -> int:
    """Device bytes of one layer's slot (K and V, the padding page included) for a sequence of ``tokens``."""
    rows = max(1, -(-slot_tokens(tokens, page_size) // page_size)) * page_size + page_size
    return rows * heads * (k_dim + v_dim) * torch.empty((), dtype=dtype).element_size()


class PageTable:
    """The host pages of one sequence: ``starts[j]`` (host token slot of page j) and ``keys[j]`` (the index
    key of a page the controller owns and this sequence references, None for a private page)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.keys: list[str | None] = []
        self.reading: Any = None  # a store read into some of the pages (a future), until the cache has settled it

    def release(self, state: TierRuntime, first: int = 0, *, take: bool = True) -> None:
        starts, keys = self.starts[first:], self.keys[first:]
        del self.starts[first:], self.keys[first:]
        if state.closed or not starts:
            return
        if self.reading is not None:  # never free a page a read is still writing into
            concurrent.futures.wait([self.reading])
        state.drain(take)  # no transfer in flight may still touch a page given back
        state.controller.release([k for k in keys if k is not None])
        state.controller.free([s for s, k in zip(starts, keys) if k is None])


def release_table(state: TierRuntime, table: PageTable) -> None:
    """A garbage-collected cache's pages given back (its finalizer), here, as a caller who dropped it expects;
    except while a store read still writes into them: the release waits for it, and a collection runs on any
    thread, inside any lock (the controller's among them, which that read's deadline answer takes), so it waits
    on a thread of its own (:meth:`TierRuntime.release_later`). A cache's own
    :meth:`~kvtier.integrations.transformers.KvtierCache.release` gives them back on the caller's thread."""
    if state.closed or not table.starts:
        return
    # (collected on a thread of kvtier's own, the store's: the read a drain waits behind may be queued on it)
    if (table.reading is not None and not table.reading.done()) or threading.current_thread().name.startswith("kvtier-"):
        state.release_later(lambda: release_now(state, table, own=False))
        return
    release_now(state, table)


def release_now(state: TierRuntime, table: PageTable, *, own: bool = True) -> None:
    """``table``'s pages given back on this thread (once what still writes into them has finished; ``own=False``:
    on a release thread, which leaves the transfers' errors to the tier's own drain)."""
    try:
        table.release(state, take=own)
    except Exception:  # noqa: BLE001 - a finalizer never raises; the pages are then lost to this pool only
        pass
