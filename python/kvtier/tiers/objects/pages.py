"""A registered host pool's pages as objects of an object store: each page's object names (SGLang's), its data
objects' addresses and sizes inside the pool's buffers, the checks on the slots a batch names, and the
geometry fingerprint its integrity records carry (:mod:`kvtier.tiers.objects.records`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..._errors import InvalidArgumentError
from ...namespace import Namespace, fields_of
from ...page_layout import heads_of as _heads, logical_dtype
from .records import SEAL, SLOT, record_bytes, record_size


class PageObjects:
    """One registered pool's pages as objects. ``layout``: the pool's page layout (``kvtier.store``'s
    ``(k_base, k_stride, k_len, v_base, v_stride, v_len)``); ``ranks``: the tier's ``{"tp": (rank, size),
    "pp": ..., "cp": ...}``; ``sealed``: the keyring id of a sealed tier, else None; ``scheme`` and
    ``seal_scheme``: the names the tier's fingerprint and its seals' associated data start with (its format:
    pages of two schemes never vouch for each other)."""

    def __init__(self, pool: Any, layout: tuple[int, int, int, int, int, int], page_num: int, *, prefix: str,
                 model_name: str, key_tag: str | None, ranks: dict[str, tuple[int, int]],
                 kv_cache_dtype: str | None, sealed: str | None, scheme: str, seal_scheme: str) -> None:
        mla = layout[5] == 0
        self.pool, self.layout, self.page_num, self.mla, self.prefix = pool, layout, page_num, mla, prefix
        self.page_bytes = layout[2] + layout[5]
        self.sides = ("k",) if mla else ("k", "v")
        self.rec_bytes = record_size(len(self.sides), sealed is not None)  # one page's record
        self.slot = -(-self.rec_bytes // SLOT) * SLOT  # its place in a record buffer
        tp, pp = ranks["tp"], ranks["pp"]
        # SGLang's suffixes: MHA "{tp}" (or "{tp}_{pp}"), MLA "" (or "{pp}"): one object per page for all ranks
        self.suffix = (f"{pp[0]}" if pp[1] > 1 else "") if mla else (f"{tp[0]}_{pp[0]}" if pp[1] > 1 else f"{tp[0]}")
        # everything that decides which bytes a page holds: with GQA heads replicated over ranks, rank 1 of
        # TP 4 and rank 1 of TP 8 hold different heads under one key, so the TP size is named (an MLA page is
        # the same on every rank); PP ranks may hold different layers in equal numbers (start layer named)
        cp = ranks["cp"]
        named = {"pp": f"{pp[0]}/{pp[1]}"} if mla else {"tp": f"{tp[0]}/{tp[1]}", "pp": f"{pp[0]}/{pp[1]}"}
        # the key tag too: a tagged page "x" and an untagged page "<tag>_x" of one model are the same objects
        # (SGLang joins the names with "_"), and only the record tells them apart
        self.fingerprint_text = Namespace.build(
            scheme, model=str(model_name), key_tag=repr(key_tag), suffix=self.suffix, **named,
            cp=f"{cp[0]}/{cp[1]}", start_layer=str(getattr(pool, "start_layer", 0)),
            dtype=str(logical_dtype(pool, kv_cache_dtype)), layout=str(pool.layout), page=str(pool.page_size),
            layers=str(pool.layer_num), **fields_of(_heads(pool)), objects=f"{layout[2]},{layout[5]}",
            sealed=sealed).format()
        digest = hashlib.sha256(self.fingerprint_text.encode())
        #: the first 8 bytes of the fingerprint's sha256: what every record of this geometry carries
        self.fp = digest.digest()[:8]
        #: what a sealed tier's seals authenticate before each object's name: the whole fingerprint's sha256
        #: (a record is only checksummed, so a forged one could name any geometry; a seal cannot be forged)
        self.aad = f"{seal_scheme}:{digest.hexdigest()}"

    def base(self, key: str) -> str:
        """The name every object of the page ``key`` starts with."""
        return f"{self.prefix}_{key}_{self.suffix}"

    def data_keys(self, key: str) -> list[str]:
        """The names of one page's data objects (SGLang's)."""
        b = self.base(key)
        return [f"{b}_{s}" for s in self.sides]

    def pages(self, keys: list[str], host_indices: Any) -> np.ndarray:
        """Checked page numbers of ``host_indices`` (whole, aligned, in-range pages, one per key), before any IO."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dtype != torch.int64 or host_indices.dim() != 1:
            raise InvalidArgumentError("invalid argument `host_indices`: expected a 1-D torch.int64 tensor")
        ps = self.pool.page_size
        idx = host_indices.detach().to("cpu").numpy().astype(np.int64, copy=True)
        if idx.size != len(keys) * ps:
            raise InvalidArgumentError(f"invalid argument `host_indices`: {idx.size} slots for {len(keys)} pages of {ps}")
        rows = idx.reshape(len(keys), ps)
        starts = rows[:, 0]
        if (starts % ps).any() or (rows - starts[:, None] != np.arange(ps)).any():
            raise InvalidArgumentError("invalid argument `host_indices`: every page must be page_size consecutive "
                                       "slots starting at a multiple of page_size")
        pages: np.ndarray = starts // ps
        if pages.size and (pages.min() < 0 or pages.max() >= self.page_num):
            raise InvalidArgumentError(f"invalid argument `host_indices`: pages must lie in [0, {self.page_num})")
        return pages

    def objects(self, keys: list[str], pages: np.ndarray) -> tuple[list[str], list[int], list[int]]:
        """Per page, its data objects' keys, addresses and sizes (K then V)."""
        kb, kst, kn, vb, vst, vn = self.layout
        names: list[str] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        for key, p in zip(keys, pages.tolist()):
            dk = self.data_keys(key)
            names.append(dk[0])
            ptrs.append(kb + p * kst)
            sizes.append(kn)
            if not self.mla:
                names.append(dk[1])
                ptrs.append(vb + p * vst)
                sizes.append(vn)
        return names, ptrs, sizes


    def write_records(self, rview: np.ndarray, sizes: Sequence[int], crcs: Sequence[int], seals: bytes) -> None:
        """Writes the records of consecutive pages into a record buffer (``rview``, one :attr:`slot` each): their
        objects' sizes and checksums (``len(sides)`` per page) and, for a sealed tier, their ``seals``."""
        k = len(self.sides)
        for n in range(len(sizes) // k):
            rec = record_bytes(self.fp, [(sizes[n * k + s], crcs[n * k + s]) for s in range(k)],
                               seals[n * k * SEAL:(n + 1) * k * SEAL])
            rview[n * self.slot: n * self.slot + self.rec_bytes] = np.frombuffer(rec, dtype=np.uint8)
