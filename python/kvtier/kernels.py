"""The ``kernel`` IO backend's Triton gather/scatter: moved to :mod:`kvtier.transfer.kernels`; this module
re-exports its public names for code that imports ``kvtier.kernels``."""

from __future__ import annotations

from .transfer.kernels import (
    LAYER_PARAM,
    RowsLaunch,
    WarmLaunches,
    available,
    launch_rows,
    layer_offsets,
    native_status,
    prepare_rows,
    run_rows,
    set_native,
    word_of,
)

__all__ = ["LAYER_PARAM", "RowsLaunch", "WarmLaunches", "available", "launch_rows", "layer_offsets", "native_status",
           "prepare_rows", "run_rows", "set_native", "word_of"]
