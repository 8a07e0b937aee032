"""How kvtier's transformers cache restores a prompt's cached prefix (:class:`Restorer`, a component each
``KvtierCache`` owns): the restore planner's plan carried out — the host pages attached, the head of the prefix
computed while its tail is read from the store — and the tail in flight: read into private host pages, used by
the next forward before the read has finished, and checked before anything that forward made is kept or
returned.

How it stays correct (kvtier's promise: a wrong byte is never served):

- The tail's pages are the sequence's private pages (``PageTable.keys`` None) until :meth:`Restorer.settle_tail`
  has seen the read's result; only the verified leading pages then go to the controller's index.
- On CUDA the loads of those pages wait on the transfer stream behind a host gate that opens when the read has
  finished (``TierRuntime.hold_transfers_until``), so no load reads a page before its bytes are there; on the
  CPU the first load waits for the read instead.
- A forward that ran on the tail settles it at its last layer, before it adopts anything. When a page failed,
  that forward's output was made from bytes that are not the page's: nothing of it is adopted, and the
  forward hook replaces the output with :func:`recompute_forward` (the cache cut back to the verified pages,
  the rest of the tokens computed again).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from ... import _native
from ..._errors import ClosedError, KvtierError
from ...planner import RestorePlan
from ...store import page_hashes
from .state import TierRuntime
from .window import PageTable


@dataclass
class PendingTail:
    """Pages ``[first, first + len(keys))`` of the prompt, read into ``starts`` by ``future`` (its result: how
    many leading pages were read and verified)."""

    future: concurrent.futures.Future[int]
    first: int
    keys: list[str]
    starts: list[int]
    gate: Any = None  # the transfer stream's gate (CUDA), opened here too once the read is seen done
    first_gate: Any = None  # the gate the read opens once its pages' first layers are in (opened here too)

    def wait(self) -> None:
        """Until the read has finished (its result is not looked at)."""
        concurrent.futures.wait([self.future])
        for gate in (self.first_gate, self.gate):
            if gate is not None:
                gate.open()

    def good(self) -> int:
        """How many leading pages were read and verified (0 when the read raised)."""
        self.wait()
        try:
            return min(len(self.keys), int(self.future.result()))
        except Exception:  # noqa: BLE001 - a failed read is a miss
            return 0


def recompute_forward(model: Any, device: torch.device, start: int, tokens: list[int], kwargs: dict[str, Any],
                      output: Any, fed: int) -> Any:
    """The output of the forward ``model(**kwargs)`` made again after a tail page failed: its cache has been cut
    back to its verified pages (``start`` tokens), ``tokens`` are the tokens after them up to where the failed
    forward ended (the failed pages' and that forward's ``fed`` ones), computed on ``device``; the output is
    trimmed to the failed forward's shape."""
    if kwargs.get("labels") is not None:
        raise KvtierError("a restored page failed its check after a forward with `labels` used it; the cache was cut "
                          "back to the verified pages: call the model again from there")
    if kwargs.get("inputs_embeds") is not None:
        raise KvtierError("a restored page failed its check after a forward fed by `inputs_embeds` used it; kvtier "
                          "cannot compute that forward again: call it again with input_ids")
    for name in ("position_ids", "cache_position"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            plain = torch.arange(start + len(tokens) - fed, start + len(tokens), device=value.device)
            if value.numel() != fed or not bool((value.reshape(-1) == plain).all()):
                raise KvtierError(f"a restored page failed its check after a forward with its own `{name}` used it; "
                                  "kvtier cannot compute that forward again: call it again")
    again = {k: v for k, v in kwargs.items() if k not in ("input_ids", "position_ids", "cache_position")}
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    out = model(input_ids=ids, **again)
    return _trimmed(out, output)


def _trimmed(out: Any, like: Any) -> Any:
    """``out``'s per-token tensors cut to the last tokens ``like`` has (the failed forward fed fewer tokens)."""
    def cut(new: Any, old: Any) -> Any:
        if isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and new.dim() >= 2 and old.dim() >= 2 \
                and new.shape[1] > old.shape[1]:
            return new[:, new.shape[1] - old.shape[1]:]
        if isinstance(new, tuple) and isinstance(old, tuple) and len(new) == len(old):
            return tuple(cut(a, b) for a, b in zip(new, old))
        return new

    if isinstance(out, tuple) and isinstance(like, tuple):
        return tuple(cut(a, b) for a, b in zip(out, like))
    for name in ("logits", "hidden_states"):
        new, old = getattr(out, name, None), getattr(like, name, None)
        if new is not None and old is not None:
            setattr(out, name, cut(new, old))
    new, old = getattr(out, "attentions", None), getattr(like, "attentions", None)
    if isinstance(new, tuple) and isinstance(old, tuple) and len(new) == len(old):  # (batch, heads, queries, keys)
        out.attentions = tuple(a[:, :, a.shape[2] - b.shape[2]:] if isinstance(a, torch.Tensor) and
                               isinstance(b, torch.Tensor) and a.dim() == 4 and a.shape[2] > b.shape[2] else a
                               for a, b in zip(new, old))
    return out


class RestoreHost(Protocol):
    """What a :class:`Restorer` reads and changes of the cache it restores into, besides :class:`CacheSteps`:
    the cache itself is what the head's forward is given."""

    restored_tokens: int
    restored_store_pages: int

    def get_seq_length(self, layer_idx: int = 0) -> int: ...


class CacheSteps(NamedTuple):
    """The cache's own steps a restore runs (handed for that call only: the restorer keeps no hold on its cache)."""

    salted: Callable[[list[str]], list[str]]  # the tenant's keys of a chain of page hashes
    attach: Callable[..., None]  # pages acquired from the controller become the sequence's (KvtierCache._attach)
    ensure_window: Callable[[int], Any]  # the device window, for at least that many tokens
    load: Callable[..., None]  # host -> a layer's slot (KvtierCache._load)


class Restorer:
    """How a :class:`~kvtier.integrations.transformers.cache.KvtierCache` restores its prompt's cached prefix (a
    component each cache owns): the plan carried out (host pages attached, the head computed while the tail is
    read), the tail in flight and its settling, and the recomputation when a page of it failed (see the module
    docs). It holds the restore's own state (the plan, the tail, the head's stored keys); the cache's steps come
    with each call."""

    def __init__(self, state: TierRuntime, table: PageTable, resident_layers: int) -> None:
        self._state = state
        self.table = table  # the cache's PageTable (the tail's read is registered there)
        self.resident_layers = resident_layers
        self.plan: RestorePlan | None = None  # the restore's plan (None: restore="all", or nothing cached)
        self.recomputed_tokens = 0  # tokens of the cached prefix recomputed by the restore (a split plan's head)
        self.ttft: Any = None  # (plan, start) until the forward that completes the prompt (its time to first token)
        self.stored: set[str] = set()  # keys of pages recomputed by a split plan that the store already has
        self.tail: PendingTail | None = None  # a split restore's tail still being read
        self.in_head = False  # a split restore's head is being computed (its backups are never deferred)

    def restore(self, cache: RestoreHost, steps: CacheSteps, tokens: list[int]) -> None:
        st, ps = self._state, self._state.page_size
        n = (len(tokens) - 1) // ps  # at least one token is left to compute (the model must give logits)
        if n <= 0:
            return
        chain = page_hashes(tokens[: n * ps], ps)
        keys = steps.salted(chain)
        ctrl = st.controller
        if st.restore == "all":  # every cached page, loaded: no measurement, no planning
            host, disk = ctrl.match(keys)
            if disk:
                ctrl.prefetch(keys[: host + disk]).result()
            steps.attach(ctrl.acquire(keys), keys, chain, host)
            return
        t0 = st.marks.mark()
        # on CUDA the next forward is queued before the tail's read ends (its loads wait behind a gate); with
        # every layer resident the tail loads run on a stream of their own and that forward trails the head
        # layer by layer (``_load``)
        trail = st.cuda and self.resident_layers >= st.layers
        plan = self.plan = ctrl.plan_restore(keys, len(tokens), can_split=True, overlap=st.cuda, trail=trail)
        h, j, k = plan.host_pages, plan.recompute_to, plan.load_to
        # the host pages are held first (a reference each): the tail's read cannot evict them to make room
        got = ctrl.acquire(keys[:h]) if h else []
        steps.attach(got, keys, chain, len(got))
        r = len(got)
        # the tail is read into private pages in the background from now on (while the head is computed),
        # and used by the next forward before the read has finished (restore.py)
        starts = ctrl.allocate(k - j) if k > j and j >= r else None
        pending = None
        # trailing, the store reads the first half of every page's layers first: their loads, and the rest of
        # the prompt's first layers, run while it reads the other half
        half = st.layers // 2 if trail else 0
        if starts is not None:
            steps.ensure_window(len(tokens))  # (never reallocated, so never drained, while the read runs)
            first_gate = _native.HostGate() if half else None
            read = ctrl.read_into(keys[j:k], starts, first_layers=half, gate=first_gate,
                                  deadline=ctrl.restore_deadline_s((k - j) * ps, plan=plan))
            pending = PendingTail(read, j, list(keys[j:k]), list(starts), first_gate=first_gate)
            self.table.reading = pending.future
        # (no room for the tail in the host pool: the next forward computes it)
        try:
            if j > r:  # the head: computed here, while the tail streams in
                self._compute_head(cache, steps, plan, keys, tokens, r, j)
        except BaseException:
            self.tail = pending
            self.drop_tail()
            raise
        self.tail = pending
        if pending is not None:
            if cache.get_seq_length() == j * ps and not trail:
                # loads of the tail's pages wait (on the device) for the read
                pending.gate = st.hold_transfers_until(pending.future)
                steps.attach(pending.starts, keys, chain, 0, first=j, private=True)  # (the index's once settled)
            elif cache.get_seq_length() == j * ps:
                steps.attach(pending.starts, keys, chain, 0, first=j, private=True, tail=True, load=False)
                self._load_tail(steps, pending, k * ps, half)
            else:
                self.drop_tail()
        self.ttft = (plan, t0)

    def _load_tail(self, steps: CacheSteps, tail: PendingTail, tokens: int, half: int) -> None:
        """Every layer's tail on the tail stream (CUDA, every layer resident): the first ``half`` layers behind
        the gate the read opens once their bytes are in, the others behind the read's end."""
        st = self._state
        win = steps.ensure_window(0)
        if tail.first_gate is not None:
            st.hold_tail_at(tail.first_gate)
        else:
            tail.gate = st.hold_transfers_until(tail.future, tail=True)
        for layer_idx in range(st.layers):
            if layer_idx == half and tail.first_gate is not None:
                tail.gate = st.hold_transfers_until(tail.future, tail=True)
            steps.load(win, layer_idx, tokens, tail=True)
        for t in (*win.k_slots, *win.v_slots):  # never reused by the allocator before the loads are done
            t.record_stream(st.tail_stream())

    def _compute_head(self, cache: RestoreHost, steps: CacheSteps, plan: RestorePlan, keys: list[str],
                      tokens: list[int], r: int, j: int) -> None:
        """Pages ``[r, j)`` of the prompt computed by the model into ``cache`` (a split plan's head)."""
        st, ps, ctrl = self._state, self._state.page_size, self._state.controller
        model = st.model()
        if model is None:
            raise ClosedError("the model of this KVTier is gone; build a KVTier for the model in use")
        # head pages the durable tier already holds are not written again (those only a later tier, such as
        # the cluster, holds are: its copy is not durability)
        durable, pos = ctrl.durable_tier, plan.host_pages
        for name, count in plan.segments:
            if name == durable:
                self.stored.update(keys[max(pos, plan.host_pages) : min(pos + count, j)])
            pos += count
        ids = torch.tensor([tokens[r * ps : j * ps]], device=st.device)
        self.in_head = True  # (its backups go layer by layer: the rest of the prompt follows them)
        try:
            self._run_head(cache, steps, ids)
        finally:
            self.in_head = False
        self.recomputed_tokens = (j - r) * ps
        st.stats.recomputed_head_tokens += self.recomputed_tokens

    def _run_head(self, cache: RestoreHost, steps: CacheSteps, ids: torch.Tensor) -> None:
        st = self._state
        model = st.model()
        side = st.head_stream()
        if side is None:
            with torch.no_grad():
                model(input_ids=ids, use_cache=True, logits_to_keep=1, **{st.cache_kwarg: cache})
        else:
            # On CUDA the head runs on its own stream: a caller that synchronizes the current stream before its
            # next forward (torch does, for every blocking host-to-device copy; generate makes several) does not
            # wait for the head, so that forward is queued while the head computes. It needs the head only
            # through the KV, whose loads follow the head's backups on the transfer stream.
            compute = torch.cuda.current_stream(st.device)
            side.wait_stream(compute)  # (the window's slots, the ids: made on the current stream)
            with torch.no_grad(), torch.cuda.stream(side):
                model(input_ids=ids, use_cache=True, logits_to_keep=1, **{st.cache_kwarg: cache})
            win = steps.ensure_window(0)
            for t in (*win.k_slots, *win.v_slots):  # never reused by the allocator before the head is done
                t.record_stream(side)

    def drop_tail(self) -> None:
        """A tail that never became the sequence's: its private pages go back once the read has finished."""
        tail, self.tail = self.tail, None
        self.table.reading = None
        if tail is not None:
            tail.wait()
            self._state.controller.free(tail.starts)

    def settle_tail(self, cache: RestoreHost) -> int | None:
        """The pending tail's read has finished: its verified leading pages go to the index (the sequence keeps
        a reference to each). Returns None when every page was verified, else the first failed page (from then
        on the sequence's pages hold wrong bytes until it is cut back); ``cache``'s counts lose the failed ones."""
        tail, self.tail = self.tail, None
        if tail is None:
            return None
        self.table.reading = None
        good, st, ps = tail.good(), self._state, self._state.page_size
        st.after_tail()  # (its pages go to the index, its slots' rows to whatever follows)
        if good:
            took = st.controller.adopt(tail.keys[:good], tail.starts[:good], stored=[True] * good)
            for i, (key, ok) in enumerate(zip(tail.keys, took), start=tail.first):
                if ok and i < len(self.table.keys):
                    self.table.keys[i] = key
        bad = len(tail.keys) - good
        if not bad:
            return None
        cache.restored_tokens -= bad * ps
        cache.restored_store_pages -= bad
        st.stats.restored_pages -= bad
        st.stats.restored_store_pages -= bad
        return tail.first + good

    def recover(self, model: Any, kwargs: dict[str, Any], output: Any, span: tuple[int, int],
                redo: tuple[int, list[int]]) -> Any:
        """The forward that just ran used tail pages from ``redo[0]`` on, which failed their check (the
        sequence was cut back to them at its last layer): the output of that forward computed again, the
        failed pages' tokens (``redo[1]``) first. ``span``: (the sequence's length before that forward, the
        tokens it fed)."""
        st, ps = self._state, self._state.page_size
        failed, prior = redo
        _, n = span
        ids = kwargs.get("input_ids")
        new = ids[0, -n:].tolist() if isinstance(ids, torch.Tensor) and ids.dim() == 2 and n else []
        return recompute_forward(model, st.device, failed * ps, prior + new, kwargs, output, n)
