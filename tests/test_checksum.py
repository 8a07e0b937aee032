"""The checksum every tier binds bytes to their key with is crc32c, to the bit, on whatever CPU runs it.

The core sums object bytes with vector instructions chosen at run time (``hash::bulk_crc``), so the code path
differs from machine to machine: this checks the built extension's ``HostRanges.crc32c`` against a plain
table-driven crc32c written here, at every length to 4 KiB from 64 start offsets, at 200 random lengths to
64 KiB and at page-like sizes,
so a run of the suite on a new CPU (the GPU machine's, an ARM host's) proves the sums the page store's journal
and the cluster tier's records hold are the same there."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier import _native


def _table() -> list[int]:
    out = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        out.append(c)
    return out


TABLE = _table()


def crc32c(data: bytes, crc: int = 0) -> int:
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def test_the_reference_is_crc32c() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the catalogue's check value of CRC-32/ISCSI


@pytest.fixture(scope="module")
def memory() -> tuple[_native.HostRanges, torch.Tensor, bytes]:
    rng = random.Random(20261203)
    raw = bytes(rng.getrandbits(8) for _ in range((1 << 20) + 8192))
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    ranges = _native.HostRanges()
    ranges.register_tensor(t)
    return ranges, t, raw


def test_every_length_to_4_kib_from_every_offset(memory: tuple[_native.HostRanges, torch.Tensor, bytes]) -> None:
    """Every prefix length 1..4096 from each start offset 0..63 (the vector loops start above 256 bytes on
    x86 and fold in 64-byte blocks): the reference runs once over each offset's 4 KiB, one prefix at a time."""
    ranges, t, raw = memory
    base, n_max = t.data_ptr(), 4096
    for off in range(64):
        got = ranges.crc32c(["k"] * n_max, [base + off] * n_max, list(range(1, n_max + 1)))
        c, bad = 0xFFFFFFFF, []
        for n in range(1, n_max + 1):
            c = TABLE[(c ^ raw[off + n - 1]) & 0xFF] ^ (c >> 8)
            want = crc32c(b"k", c ^ 0xFFFFFFFF)
            if got[n - 1] != want:
                bad.append(n)
        assert not bad, f"offset {off}: lengths {bad[:8]}"


def test_random_lengths_to_64_kib(memory: tuple[_native.HostRanges, torch.Tensor, bytes]) -> None:
    ranges, t, raw = memory
    rng = random.Random(7)
    cases = [(rng.randrange(8192), rng.randrange(1, 65537)) for _ in range(200)]
    got = ranges.crc32c(["r"] * len(cases), [t.data_ptr() + off for off, _ in cases], [n for _, n in cases])
    want = [crc32c(b"r", crc32c(raw[off:off + n])) for off, n in cases]
    assert [c for c, g, w in zip(cases, got, want) if g != w] == []


@pytest.mark.parametrize("n", [4095, 4096, 65536, 65536 + 17, (1 << 20) - 1, 1 << 20])
def test_page_sizes(memory: tuple[_native.HostRanges, torch.Tensor, bytes], n: int) -> None:
    ranges, t, raw = memory
    off = 3
    assert ranges.crc32c(["page"], [t.data_ptr() + off], [n]) == [crc32c(b"page", crc32c(raw[off:off + n]))]


def test_a_changed_byte_changes_the_sum(memory: tuple[_native.HostRanges, torch.Tensor, bytes]) -> None:
    ranges, t, _ = memory
    before = ranges.crc32c(["x"], [t.data_ptr()], [65536])
    t[40000] ^= 1
    try:
        assert ranges.crc32c(["x"], [t.data_ptr()], [65536]) != before
    finally:
        t[40000] ^= 1
