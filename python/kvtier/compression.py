"""Lossless compression of KV pages in the slow tiers: which codec a KV dtype gets, what it saves as the store's
counters tell it, and the read rate a planner should expect from a tier that stores compressed pages. The codec
itself is the Rust core's (``kvtier_core::codec``; docs/STORE.md, "Compressed objects")."""

from __future__ import annotations

import os
from typing import Any

#: What ``compression=`` takes.
COMPRESSION = ("auto", "lossless", "off")


def codec_for(dtype: str) -> str | None:
    """The page codec for a KV dtype (``"bits16"`` for bfloat16 and float16, ``"bits8"`` for the fp8 variants),
    or None for a dtype it does not compress. Takes torch's names (``torch.bfloat16``, ``float8_e4m3fn``) and the
    engines' (SGLang's ``--kv-cache-dtype`` ``bf16``, ``fp8_e4m3``, ``fp8_e5m2``; ``fp16``, ``half``)."""
    d = str(dtype).removeprefix("torch.").lower()
    if d in ("bfloat16", "bf16", "float16", "fp16", "half"):
        return "bits16"
    if d.startswith(("float8", "fp8")):
        return "bits8"
    return None


def effective_read_GBps(disk_GBps: float, st: dict[str, Any], io_threads: int) -> float:
    """The rate a restore reads decoded pages at: ``disk_GBps`` × the stored pages' ratio (content bytes per
    stored byte, from the store's counters ``st``), at most the decode rate measured on this store's reads
    (per thread, on ``io_threads`` threads or the machine's cores if fewer)."""
    stored, content = int(st.get("stored_bytes", 0)), int(st.get("content_bytes", 0))
    rate = disk_GBps * (content / stored if stored > 0 and content > stored else 1.0)
    dec_bytes, dec_ns = int(st.get("decoded_bytes", 0)), int(st.get("decode_ns", 0))
    if dec_bytes > 0 and dec_ns > 0:
        rate = min(rate, dec_bytes / dec_ns * min(io_threads, os.cpu_count() or 1))
    return rate


def compression_stats(st: dict[str, Any]) -> dict[str, Any]:
    """What the codec gives, from a store's counters: the ratio of what its objects hold to the bytes they take
    (``compression_ratio``, 1.0 with nothing coded), the ratio of its writes, and the decode and encode rates per
    thread (GB/s of decoded bytes; 0 before any)."""
    stored, content = int(st.get("stored_bytes", 0)), int(st.get("content_bytes", 0))
    written, raw = int(st.get("bytes_written", 0)), int(st.get("raw_bytes_written", 0))
    dec, dec_ns = int(st.get("decoded_bytes", 0)), int(st.get("decode_ns", 0))
    enc, enc_ns = int(st.get("encode_input_bytes", 0)), int(st.get("encode_ns", 0))
    return {"compression_ratio": round(content / stored, 4) if stored else 1.0,
            "write_compression_ratio": round(raw / written, 4) if written else 1.0,
            "decode_GBps_per_thread": round(dec / dec_ns, 3) if dec_ns else 0.0,
            "encode_GBps_batch": round(enc / enc_ns, 3) if enc_ns else 0.0}
