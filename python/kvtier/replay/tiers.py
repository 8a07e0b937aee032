"""kvtier's real tiers as the replay bench drives them: per node a :class:`kvtier.TierController` over a CPU
host pool and a store — a :class:`kvtier.PageStore` of its own, or one PageStore shared by every node.

One trace block is one page of ``page_bytes`` (K and V halves) on the host and on disk; the first 8 bytes of
each page's K half carry the block's id, written when the page is filled and checked whenever a page comes
back from a store (a page read back with another block's bytes is counted and fails the bench).

Capacity in bytes. A PageStore's limit covers its data slots *and* its journal (docs/STORE.md, "Capacity,
exactly"): the journal holds a put record per object written since its last compaction (compaction waits
for it to pass four times the live records, or ``min(1 MiB, capacity / 16)``), a prepaid del record per
live object plus 4 KiB, and a preallocation step of ``min(1 MiB, capacity / 64)``. So the pages a byte
capacity holds move with the journal. :func:`store_capacity_bytes` gives the store its pages' slots plus
the journal's *mean* size over a compaction cycle, so it holds the model's page count on average (a few
percent more right after a compaction, fewer just before one); the bench prints both counts.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier import DeviceKVPool, PageStore, TierController, host_pool_for
from kvtier.planner import PrefillModel, TierEstimate

from .._errors import KvtierError
from .trace import BLOCK_TOKENS

#: a clear put record (the replay's store seals and compresses nothing) is 31 bytes plus its key: docs/STORE.md,
#: "Journal records" ("A del or a clear put is `31 + key_len` bytes"), made from the core's record layout;
#: tests/test_replay.py holds this to that line
RECORD_FIXED = 31


def disk_page_bytes(page_bytes: int) -> int:
    """Bytes of data slots one page takes on disk: K and V objects, each in whole 4 KiB blocks."""
    return 2 * (-(-(page_bytes // 2) // 4096) * 4096)


def store_capacity_bytes(pages: int | None, page_bytes: int, key_len: int) -> int:
    """A PageStore capacity holding ``pages`` pages on average (see the module docs); None: unlimited."""
    if pages is None:
        return 1 << 50
    data = pages * disk_page_bytes(page_bytes)
    live = 2 * pages * (RECORD_FIXED + key_len + 2)  # a put record per object ("<key>.k", "<key>.v")
    compact_at = max(min(1 << 20, max(data // 16, 16 << 10)), 4 * live)
    step = min(1 << 20, data // 64 // 4096 * 4096)
    journal = (live + compact_at) // 2 + live + 4096 + step // 2
    return -(-(data + journal) // 4096) * 4096


def page_key(block_id: int) -> str:
    return f"{block_id:x}"


def _pool(pages: int, page_bytes: int) -> tuple[Any, Any]:
    """A CPU device pool of one page and a host pool of exactly ``pages`` pages (HiCache's sizing adds one
    spare page to ``size // page_size``)."""
    if page_bytes % 8192 or page_bytes <= 0:
        raise KvtierError(
            f"--page-bytes {page_bytes}: must be a positive multiple of 8 KiB (K and V halves in "
            "whole 4 KiB blocks, as O_DIRECT needs)"
        )
    if pages < 2:
        raise KvtierError(f"--host-tokens: the host tier needs at least 2 blocks ({2 * BLOCK_TOKENS} tokens)")
    dp = DeviceKVPool(
        BLOCK_TOKENS, BLOCK_TOKENS, 1, 1, page_bytes // (4 * BLOCK_TOKENS), dtype=torch.bfloat16, device="cpu"
    )
    hp = host_pool_for(dp, host_to_device_ratio=pages - 1, layout="page_first_direct", pin_memory=False)
    assert hp.page_num == pages, (hp.page_num, pages)
    return dp, hp


def _tags(hp: Any) -> torch.Tensor:
    """A view of the first 8 bytes of every page's K half, as int64."""
    return hp.k_buffer.reshape(hp.page_num, -1).view(torch.int64)[:, 0]


class SharedStore:
    """One PageStore serving several nodes' host pools: pages are staged through a pool of its own (a
    PageStore reads and writes one registered pool). What each node's TierController sees as its store."""

    name = "disk"

    def __init__(self, path: str, pages: int | None, page_bytes: int, key_len: int, batch_pages: int) -> None:
        self.dp, self.staging = _pool(max(2, batch_pages), page_bytes)
        self.store = PageStore(
            path, capacity_bytes=store_capacity_bytes(pages, page_bytes, key_len), model_name="replay"
        )
        self.store.register_mem_pool_host(self.staging)
        self.lock = threading.Lock()

    def view(self, host_pool: Any) -> _SharedView:
        return _SharedView(self, host_pool)

    def close(self) -> None:
        self.store.close()
        self.staging.close()


class _SharedView:
    """A node's face of a :class:`SharedStore` (``pool`` is the node's host pool, as TierController checks)."""

    name = "disk"

    def __init__(self, shared: SharedStore, pool: Any) -> None:
        self.shared, self.pool = shared, pool

    def _staging_idx(self, n: int) -> torch.Tensor:
        return torch.arange(n * BLOCK_TOKENS, dtype=torch.int64)

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        return self.shared.store.batch_exists(keys)

    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        pages = host_indices[::BLOCK_TOKENS] // BLOCK_TOKENS
        with self.shared.lock:
            st = self.shared.staging
            st.k_buffer[: len(keys)] = self.pool.k_buffer[pages]
            st.v_buffer[: len(keys)] = self.pool.v_buffer[pages]
            return self.shared.store.batch_set_v1(keys, self._staging_idx(len(keys)))

    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        pages = host_indices[::BLOCK_TOKENS] // BLOCK_TOKENS
        with self.shared.lock:
            st = self.shared.staging
            ok = self.shared.store.batch_get_v1(keys, self._staging_idx(len(keys)))
            good = torch.tensor([i for i, g in enumerate(ok) if g], dtype=torch.int64)
            if len(good):
                self.pool.k_buffer[pages[good]] = st.k_buffer[good]
                self.pool.v_buffer[pages[good]] = st.v_buffer[good]
            return ok

    def measured(self) -> dict[str, TierEstimate]:
        return self.shared.store.measured()


class KvtierNode:
    """One node: host pool + TierController over its own PageStore (``store_dir``), a shared one, or a
    cluster tier (``cluster``: makes a tier registered with the node's host pool)."""

    def __init__(
        self,
        host_pages: int,
        page_bytes: int,
        prefill_tokens_per_s: float,
        *,
        store_dir: str | None = None,
        store_pages: int | None = None,
        key_len: int = 8,
        shared: SharedStore | None = None,
        cluster: Callable[[Any], Any] | None = None,
    ) -> None:
        self.dp, self.hp = _pool(host_pages, page_bytes)
        self.own_store: PageStore | None = None
        self.cluster_tier: Any = None
        if cluster is not None:
            self.cluster_tier = store = cluster(self.hp)
        elif shared is not None:
            store = shared.view(self.hp)
        else:
            assert store_dir is not None
            self.own_store = store = PageStore(
                store_dir, capacity_bytes=store_capacity_bytes(store_pages, page_bytes, key_len), model_name="replay"
            )
            store.register_mem_pool_host(self.hp)
        # no deadlines: the replay counts what the tiers hold, never how fast a loaded machine answers
        self.ctl = TierController(
            self.dp, self.hp, store, prefetch_budget_pages=host_pages, prefill=PrefillModel.fixed(prefill_tokens_per_s),
            restore_deadline=None, write_deadline_s=None, lookup_deadline_s=None,
        )
        self.tags = _tags(self.hp)
        self.wrong_pages = 0  # pages read back from a store with another block's bytes

    def peek(self, keys: Sequence[str]) -> int:
        """The prefix this node would find (host run, then store run), changing no recency (routing)."""
        with self.ctl.lock:
            n = 0
            while n < len(keys) and keys[n] in self.ctl.pages:
                n += 1
        return n + (self.ctl.store.batch_exists(keys[n:]) if n < len(keys) else 0)

    def _starts(self, keys: Sequence[str]) -> torch.Tensor:
        with self.ctl.lock:
            return torch.tensor([self.ctl.pages[k].start // BLOCK_TOKENS for k in keys], dtype=torch.int64)

    def serve(self, ids: Sequence[int]) -> tuple[int, int]:
        """One request (the steps of :mod:`kvtier.replay.model`): ``(host blocks, store blocks)``
        of its prefix found (the store's: the leading run of them the read brought to the host)."""
        ctl = self.ctl
        keys = [page_key(h) for h in ids]
        block = dict(zip(keys, ids))
        n, m = ctl.match(keys)
        pinned = list(keys[:n])
        if len(ctl.acquire(pinned)) != n:
            raise KvtierError("kvtier replay: a host page found by match() could not be acquired")
        if m:
            seg = keys[n : n + m]
            with ctl.lock:
                want = [k for k in seg if k not in ctl.pages]
            ctl.prefetch(seg).result()
            with ctl.lock:
                loaded = [k for k in want if k in ctl.pages]
                # the store's part of the hit is what reached the host: a page the lookup found but the read
                # did not deliver (evicted meanwhile, a failed check) is recomputed
                m = next((i for i, k in enumerate(seg) if k not in ctl.pages), m)
            if loaded:
                if len(ctl.acquire(loaded)) != len(loaded):
                    raise KvtierError("kvtier replay: a prefetched page could not be acquired")
                pinned += loaded
                got = self.tags[self._starts(loaded)]
                expect = torch.tensor([block[k] for k in loaded], dtype=torch.int64)
                self.wrong_pages += int((got != expect).sum())
        with ctl.lock:
            new = [k for k in dict.fromkeys(keys) if k not in ctl.pages]
        starts = None
        while new:
            starts = ctl.allocate(len(new))
            if starts is not None:
                break
            new = new[:-1]
        if new and starts is not None:
            self.tags[torch.tensor(starts, dtype=torch.int64) // BLOCK_TOKENS] = torch.tensor(
                [block[k] for k in new], dtype=torch.int64
            )
            if not all(ctl.adopt(new, starts)):
                raise KvtierError("kvtier replay: a new page was refused by adopt()")
            pinned += new
        ctl.release(pinned)
        ctl.wait_idle()
        return n, m

    def store_pages(self) -> int:
        st = self.own_store.get_stats() if self.own_store is not None else None
        return int(st["pages"]) if st is not None else -1

    def close(self) -> None:
        self.ctl.close()
        if self.own_store is not None:
            self.own_store.close()
        if self.cluster_tier is not None:  # before the host memory it registered goes
            self.cluster_tier.close()
        self.hp.close()


def open_dir(root: str, name: str) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    return path
