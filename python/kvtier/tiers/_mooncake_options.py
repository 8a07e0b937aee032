"""The checks of :class:`~kvtier.tiers.mooncake.MooncakeTier`'s options, without connecting (SGLang's extra
config is checked with them before anything opens)."""

from __future__ import annotations

from typing import Any

from .._errors import InvalidArgumentError
from ..namespace import check_value

PROTOCOLS = ("tcp", "rdma")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(name: str, v: Any, lo: int) -> int:
    if not _is_int(v) or v < lo:
        raise InvalidArgumentError(f"invalid argument `{name}`: must be an int >= {lo}, got {v!r}")
    return int(v)



def validate_options(*, master_server_address: Any, model_name: Any = "default", key_tag: Any = None,
                     tp_rank: Any = 0, tp_size: Any = 1, pp_rank: Any = 0, pp_size: Any = 1, cp_rank: Any = 0,
                     cp_size: Any = 1, dcp_size: Any = 1, protocol: Any = "tcp", device_name: Any = "",
                     local_hostname: Any = "127.0.0.1", metadata_server: Any = "P2PHANDSHAKE",
                     global_segment_size: Any = 0, local_buffer_size: Any = 16 << 20, replica_num: Any = 1,
                     accept_unverified: Any = False, setup_timeout_s: Any = 30.0, tenant: Any = None) -> None:
    """Every option checked without connecting (what construction checks first; SGLang's extra config is
    checked with it before anything opens). Raises InvalidArgumentError naming the option."""
    if not isinstance(master_server_address, str) or ":" not in master_server_address:
        raise InvalidArgumentError(f"invalid argument `master_server_address`: expected 'host:port', got "
                                   f"{master_server_address!r}")
    host, _, port = master_server_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"invalid argument `master_server_address`: bad host or port in "
                                   f"{master_server_address!r}")
    if not isinstance(model_name, str) or not model_name:
        raise InvalidArgumentError(f"invalid argument `model_name`: a non-empty str names the keys (pages of "
                                   f"different models must never share them), got {model_name!r}")
    if key_tag is not None and (not isinstance(key_tag, str) or not key_tag):
        raise InvalidArgumentError(f"invalid argument `key_tag`: a non-empty str or None, got {key_tag!r}")
    check_value("model_name", model_name)  # (both name the record's fingerprint: no field may be planted)
    check_value("key_tag", repr(key_tag), "key_tag")
    if protocol not in PROTOCOLS:
        raise InvalidArgumentError(f"invalid argument `protocol`: {protocol!r}; expected one of {PROTOCOLS}")
    for name, v in (("device_name", device_name), ("local_hostname", local_hostname),
                    ("metadata_server", metadata_server)):
        if not isinstance(v, str):
            raise InvalidArgumentError(f"invalid argument `{name}`: expected a str, got {v!r}")
    if protocol == "rdma" and not device_name:
        raise InvalidArgumentError("invalid argument `device_name`: protocol 'rdma' needs the RDMA devices "
                                   "(e.g. 'mlx5_0')")
    for name, rank, size in (("tp", tp_rank, tp_size), ("pp", pp_rank, pp_size), ("cp", cp_rank, cp_size)):
        if not (_is_int(size) and size >= 1 and _is_int(rank) and 0 <= rank < size):
            raise InvalidArgumentError(f"invalid argument `{name}_rank`: {rank!r} is not in [0, {name}_size={size!r})")
    if dcp_size != 1:
        raise InvalidArgumentError(f"invalid argument `dcp_size`: {dcp_size!r}; decode context parallelism is not "
                                   "supported by the cluster tier (SGLang 0.5.23 sends it to its file and "
                                   "mooncake backends only)")
    _int("global_segment_size", global_segment_size, 0)
    _int("local_buffer_size", local_buffer_size, 0)
    _int("replica_num", replica_num, 1)
    if isinstance(setup_timeout_s, bool) or not isinstance(setup_timeout_s, (int, float)) or not setup_timeout_s > 0:
        raise InvalidArgumentError(
            f"invalid argument `setup_timeout_s`: must be a number of seconds > 0, got {setup_timeout_s!r}")
    if not isinstance(accept_unverified, bool):
        raise InvalidArgumentError(f"invalid argument `accept_unverified`: expected true or false, got "
                                   f"{accept_unverified!r}")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise InvalidArgumentError(f"invalid argument `tenant`: a non-empty salt string or None, got {tenant!r}")
