"""kvtier: a host-memory and disk tier for the KV caches of LLM inference engines.

The Rust core (``kvtier._native``) owns aligned host memory, page allocation and transfer plans; this
package adds torch views, CUDA pinning policy and HiCache-compatible KV pools.

The public names below are imported on first use: ``import kvtier`` and the command line's ``--help``,
``inspect`` and ``verify`` do not import torch (a storage host may not have it installed; where it is,
importing it costs seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

from ._errors import (
    ClosedError,
    CudaError,
    CudaUnavailableError,
    HugePagesUnavailableError,
    InvalidArgumentError,
    KvtierError,
)
from ._native import __version__

#: public name -> the submodule that defines it (imported on first use)
_LAZY = {
    "HostBuffer": "buffer",
    "TierController": "controller",
    "LayerLoad": "overlap",
    "LayerLoader": "overlap",
    "backup_async": "overlap",
    "AsymmetricMHAHostPool": "pools",
    "DeviceKVPool": "pools",
    "MHAHostPool": "pools",
    "host_pool_for": "pools",
    "device_layers": "pools",
    "MLADeviceKVPool": "pools_mla",
    "MLAHostPool": "pools_mla",
    "PageStore": "store",
    "page_hashes": "hashes",
    "MooncakeTier": "tiers.mooncake",
    "TieredStore": "tiers.chain",
    "Tier": "tier",
}
_SUBMODULES = {"buffer", "cli", "config", "controller", "hashes", "kernels", "metrics", "overlap", "planner", "pools",
               "pools_mla", "store", "testing",
               "transfer", "replay", "integrations", "tiers"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name, name if name in _SUBMODULES else None)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    try:
        mod = importlib.import_module(f".{module}", __name__)
    except ModuleNotFoundError as exc:
        if exc.name == "torch":
            raise KvtierError(f"kvtier.{name} needs torch, which is not installed: pip install 'kvtier[torch]' "
                              "(or torch itself)") from None
        raise
    value = mod if name == module else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AsymmetricMHAHostPool",
    "DeviceKVPool",
    "LayerLoad",
    "LayerLoader",
    "backup_async",
    "MHAHostPool",
    "MLADeviceKVPool",
    "MLAHostPool",
    "device_layers",
    "PageStore",
    "MooncakeTier",
    "TieredStore",
    "Tier",
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
