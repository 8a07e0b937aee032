"""kvtier's stand-in for the ``sgl_kernel`` package: NOT SGLang's code, and not a kernel library.

SGLang's HiCache host pools import their device <-> host copy ops from ``sgl_kernel.kvcacheio`` at module import on
CUDA (sglang/srt/mem_cache/pool_host/mha.py, pool_host/mla.py, mem_cache/memory_pool_host.py). The compiled
``sgl_kernel`` wheel is built against one torch release and cannot be loaded beside another, so
benches/python/sglang_controller.py puts this directory on ``sys.path`` in its ``--device cuda`` mode, and only
when ``import sgl_kernel`` fails; its JSON output says which one ran (``"sgl_kernel": "stand-in"`` or ``"real"``).

:mod:`sgl_kernel.kvcacheio` has every name those three modules import. Its three *direct* ops (``transfer_kv_direct``,
``transfer_kv_per_layer_direct_pf_lf``, ``transfer_kv_all_layer_direct_lf_pf``: SGLang's ``--hicache-io-backend
direct``) do what sgl_kernel's C++ does (sgl-kernel/csrc/kvcacheio/transfer.cu): one ``Tensor.copy_(...,
non_blocking=True)`` per page, per layer and per K/V tensor, on the caller's current stream. Every other op (the
warp-copy kernels of ``--hicache-io-backend kernel`` that SGLang falls back to where its own JIT HiCache kernels do
not apply) raises a RuntimeError naming itself. ``get_device_accessible_ptr`` is left out on purpose: SGLang then
builds its pointer tables from raw host addresses, as it does on CUDA without it.

The few names below and in :mod:`sgl_kernel.quantization` are there only because SGLang's device KV pool module
(memory_pool.py) imports ``sglang.srt.layers.quantization`` on CUDA, whose modules import them unconditionally at
import time (w8a8_int8, compressed_tensors_w8a8_int8, gguf, fused_moe); nothing on the HiCache path calls them, and
each raises a RuntimeError naming itself if called. Any other public top-level name asked of this package gets such
a stub too, recorded in ``LAZY_STUBS`` (the script reports them); ``sgl_kernel.scalar_type`` is absent on purpose, so
that SGLang takes its own fallback for it.
"""

import importlib
import os

from . import kvcacheio

STANDIN = True  # (the real package has no such attribute)
LAZY_STUBS: list[str] = []


def _not_in_standin(qualified: str):
    def op(*args, **kwargs):
        raise RuntimeError(
            f"{qualified} is not part of kvtier's stand-in for sgl_kernel (benches/python/sgl_kernel_standin), "
            "which provides only the direct KV copy ops of --hicache-io-backend direct; install the real sgl_kernel "
            "built for this torch to run it."
        )

    op.__name__ = op.__qualname__ = qualified.rsplit(".", 1)[-1]
    op.__doc__ = f"Not part of kvtier's stand-in: calling it raises RuntimeError ({qualified} is a CUDA kernel)."
    return op


# imported at module level by sglang.srt.layers.quantization (and its moe runner) on CUDA; never called here
int8_scaled_mm = _not_in_standin("sgl_kernel.int8_scaled_mm")
moe_sum = _not_in_standin("sgl_kernel.moe_sum")
moe_sum_reduce = _not_in_standin("sgl_kernel.moe_sum_reduce")


def __getattr__(name: str):
    if name.startswith("_"):  # (private and dunder names: introspection probes them; sgl_kernel's ops are public)
        raise AttributeError(f"module 'sgl_kernel' (kvtier's stand-in) has no attribute {name!r}")
    if os.path.exists(os.path.join(os.path.dirname(__file__), f"{name}.py")):  # (`from sgl_kernel import quantization`)
        return importlib.import_module(f"{__name__}.{name}")
    LAZY_STUBS.append(name)
    stub = _not_in_standin(f"sgl_kernel.{name}")
    globals()[name] = stub
    return stub


__all__ = ["kvcacheio", "int8_scaled_mm", "moe_sum", "moe_sum_reduce"]
