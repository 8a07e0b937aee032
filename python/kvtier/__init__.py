"""kvtier: a host-memory and disk tier for the KV caches of LLM inference engines.

The Rust core (``kvtier._native``) owns aligned host memory, page allocation and transfer plans; this
package adds torch views, CUDA pinning policy and HiCache-compatible KV pools.
"""

from ._errors import (
    ClosedError,
    CudaError,
    CudaUnavailableError,
    HugePagesUnavailableError,
    InvalidArgumentError,
    KvtierError,
)
from ._native import __version__
from .buffer import HostBuffer
from .controller import TierController
from .overlap import LayerLoad, LayerLoader, backup_async
from .pools import AsymmetricMHAHostPool, DeviceKVPool, MHAHostPool, host_pool_for
from .store import PageStore, page_hashes

__all__ = [
    "AsymmetricMHAHostPool",
    "DeviceKVPool",
    "LayerLoad",
    "LayerLoader",
    "backup_async",
    "MHAHostPool",
    "PageStore",
    "TierController",
    "page_hashes",
    "host_pool_for",
    "ClosedError",
    "CudaError",
    "CudaUnavailableError",
    "HostBuffer",
    "HugePagesUnavailableError",
    "InvalidArgumentError",
    "KvtierError",
    "__version__",
]
