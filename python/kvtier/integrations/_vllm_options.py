"""The options of kvtier's vLLM tier (its entry in ``secondary_tiers``) and the checks of what vLLM hands it,
all made before anything is opened."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import Locality
from vllm.v1.kv_offload.config import OffloadingConfig

from .._errors import InvalidArgumentError
from ..config import parse_size
from ..deadlines import check_deadline
from ..metrics_server import DEFAULT_HOST, check_options as check_metrics_options
from ..staging import DEFAULT_STAGING_BYTES
from ..store import DEFAULT_CAPACITY
from ._engine_planner import check_options

#: The vLLM release this tier is built and tested against.
VLLM_VERSION = "0.33.0"
#: Options read from the tier's entry in ``secondary_tiers`` (``None`` for ``path``: required).
OPTIONS: dict[str, Any] = {
    "path": None,  # the store's root directory (one owner-only namespace per model/layout/parallel config)
    # the disk budget of the whole `path` directory (every namespace in it: DP replicas, other models), LRU-evicted
    "capacity_bytes": DEFAULT_CAPACITY,
    "io_threads": 16,  # IO requests in flight per batch
    "direct": None,  # None: O_DIRECT if the file system allows it (warns otherwise); False: buffered
    "namespace_tag": None,  # a string of the user's in the namespace (weights revision, attention backend)
    "locality": None,  # vLLM's tier locality ("LOCAL" or "REMOTE"), for its KV events and tier filters
    # lookup answers HIT only for rows worth loading (kvtier.integrations._engine_planner): vLLM recomputes a
    # row rather than wait on a tier measured slower than its prefill
    "restore_planner": True,
    "prefill_tokens_per_s": None,  # the engine's prefill throughput for this model (default: a fast engine)
    # a per-deployment tenant salt: every row key of this server becomes that tenant's (vLLM already mixes a
    # request's cache_salt into its block hashes, but the tier never sees the salt itself)
    "tenant": None,
    "keyring": None,  # a keyring directory (`kvtier keys init DIR`): rows sealed at rest (docs/SECURITY.md)
    # deadlines (docs/VLLM.md): a load answers by then with the rows that arrived ("auto": 2 s + 0.1 s per 1024
    # tokens, SGLang's prefetch rule; null: none, zero copy), a stored piece that makes no progress for
    # write_deadline_s fails; rows move through staging_bytes of kvtier's memory (late IO never lands in vLLM's)
    "read_deadline_s": "auto",
    "write_deadline_s": 2.0,
    "staging_bytes": DEFAULT_STAGING_BYTES,
    # kvtier's Prometheus families on http://metrics_host:port/metrics of the scheduler process
    # (kvtier.metrics_server): null: off; 0: a free port, logged; N: N + the DP replica's index; "0.0.0.0"
    # exposes it to every network
    "metrics_port": None,
    "metrics_host": DEFAULT_HOST,
}
#: Keys vLLM's tier factory reads itself (and removes before constructing the tier).
VLLM_KEYS = ("type", "module_path", "backpressure")
#: Bytes of a collision-resistant block hash (vLLM's ``sha256`` / ``sha256_cbor``); shorter hashes
#: (``xxhash``: 16 bytes) are refused — see :meth:`KvtierTier.lookup`.
SECURE_HASH_BYTES = 32


def parse_options(config: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - set(OPTIONS))
    if unknown:
        raise InvalidArgumentError(
            f"invalid argument `secondary_tiers` (kvtier tier): unknown key(s) {unknown}; the kvtier tier "
            f"accepts {sorted(OPTIONS)} besides vLLM's own {list(VLLM_KEYS)}"
        )
    opts = {k: config.get(k, v) for k, v in OPTIONS.items()}
    path = opts["path"]
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InvalidArgumentError(
            f"invalid argument `path` (kvtier tier): the store's root directory is required (a non-empty "
            f"string), got {path!r}"
        )
    opts["path"] = os.path.expanduser(os.fspath(path))
    opts["capacity_bytes"] = parse_size("capacity_bytes", opts["capacity_bytes"], 4096)
    for key, low in (("capacity_bytes", 4096), ("io_threads", 1)):
        v = opts[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise InvalidArgumentError(f"invalid argument `{key}` (kvtier tier): must be an int >= {low}, got {v!r}")
    if opts["direct"] is not None and not isinstance(opts["direct"], bool):
        raise InvalidArgumentError(
            f"invalid argument `direct` (kvtier tier): must be null, true or false, got {opts['direct']!r}"
        )
    tag = opts["namespace_tag"]
    if tag is not None and (not isinstance(tag, str) or not tag or "|" in tag):
        raise InvalidArgumentError(
            f"invalid argument `namespace_tag` (kvtier tier): must be a non-empty string without '|', got {tag!r}"
        )
    check_options(opts["restore_planner"], opts["prefill_tokens_per_s"])
    check_deadline("read_deadline_s", opts["read_deadline_s"], auto=True)
    check_deadline("write_deadline_s", opts["write_deadline_s"])
    opts["staging_bytes"] = parse_size("staging_bytes", opts["staging_bytes"], 4096)
    check_metrics_options(opts["metrics_port"], opts["metrics_host"], where=" (kvtier tier)")
    loc = opts["locality"]
    if loc is not None:
        try:
            opts["locality"] = Locality(loc)
        except ValueError:
            raise InvalidArgumentError(
                f"invalid argument `locality` (kvtier tier): must be one of {[x.value for x in Locality]}, got {loc!r}"
            ) from None
    return opts


def check_view(view: Any) -> tuple[int, int]:
    """``(rows, row bytes)`` of the primary tier's view, after checking its shape (nothing is exported from it
    yet: a failed construction must leave vLLM free to release it)."""
    if not isinstance(view, memoryview):
        raise InvalidArgumentError(
            f"invalid argument `primary_kv_view`: expected a memoryview, got {type(view).__name__}"
        )
    if (
        view.ndim != 2
        or view.itemsize != 1
        or view.readonly
        or not view.c_contiguous
        or view.shape is None
        or view.shape[0] < 1
        or view.shape[1] < 1
    ):
        raise InvalidArgumentError(
            "invalid argument `primary_kv_view`: expected a writable, C-contiguous 2-D byte view "
            f"(rows x row bytes) of vLLM's CPU tier, got ndim={view.ndim}, itemsize={view.itemsize}, "
            f"shape={view.shape}, readonly={view.readonly}"
        )
    return int(view.shape[0]), int(view.shape[1])


def offloading_config(spec: Any) -> OffloadingConfig:
    cfg = getattr(spec, "config", None)
    if not isinstance(cfg, OffloadingConfig):
        raise InvalidArgumentError(
            "invalid argument `offloading_spec`: expected vLLM's OffloadingSpec, whose `config` is an "
            f"OffloadingConfig (it names the namespace), got config={type(cfg).__name__}"
        )
    if not cfg.model.name or not cfg.groups or cfg.worker_kv_bytes_per_block <= 0:
        raise InvalidArgumentError(
            "invalid argument `offloading_spec`: its OffloadingConfig has no model name, no KV cache groups or "
            "no bytes per block, so the layout that names the namespace is unknown"
        )
    return cfg
