"""``kvtier cluster master`` and ``kvtier cluster storage-node``: the two processes of a Mooncake cluster,
started the same way on any machine where ``kvtier[mooncake]`` is installed (README "Use it across nodes")."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ._errors import KvtierError

MASTER_HELP = """\
Runs Mooncake's master (the mooncake_master binary of the mooncake-transfer-engine-non-cuda wheel) with the
system libraries it links (libibverbs, found where kvtier found them: the system, `make syslibs`, or
$KVTIER_SYSLIB_DIR). Every argument is passed to it unchanged; the usual ones:

  --rpc_address=ADDR        the address clients and storage nodes reach it at
  --rpc_port=PORT           (default 50051)
  --metrics_host=ADDR --metrics_port=PORT
                            its Prometheus endpoint (default port 9003)
  --client_ttl=SECONDS      how long a silent client's segments stay listed (default 10)
  --default_kv_lease_ttl=MS how long a read object cannot be evicted (default 5000)

It runs in the foreground until SIGTERM or SIGINT and logs to standard error; under a service manager or
with `&`, redirect that where logs belong. `kvtier cluster master --mooncake-help` prints every flag.
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    cluster = sub.add_parser("cluster", help="run the processes of a Mooncake cluster: master, storage-node",
                             description="The processes of a cluster tier (README 'Use it across nodes'). Each runs in the "
                             "foreground until SIGTERM or SIGINT, needs no terminal or standard input, and can run "
                             "under a service manager.")
    csub = cluster.add_subparsers(dest="cluster_command", required=True)
    csub.add_parser("master", add_help=False, help="Mooncake's master, with the libraries kvtier found",
                    description=MASTER_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    node = csub.add_parser("storage-node", help="lend this machine's memory to the cluster",
                           description="Mounts --segment bytes of this machine's memory into the cluster and serves "
                           "them until SIGTERM or SIGINT (then unmounts and exits 0). Prints one line starting with "
                           "'ready' once mounted. A dead storage node's objects are gone: kvtier's cluster tier "
                           "then misses and the local disk keeps serving.")
    node.add_argument("--master", required=True, help="the master's HOST:PORT")
    node.add_argument("--segment", required=True, help="memory to lend: bytes, or a size such as 64G or 512MiB")
    node.add_argument("--hostname", default="127.0.0.1",
                      help="this machine's address as the inference nodes reach it (default 127.0.0.1)")
    node.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"], help="transfer protocol (default tcp)")
    node.add_argument("--metadata", default="P2PHANDSHAKE",
                      help="Mooncake metadata server (default P2PHANDSHAKE: none)")
    node.add_argument("--log", default=None, help="append this process's and Mooncake's output to FILE instead of "
                      "standard output and error")
    return cluster


def run(args: argparse.Namespace, rest: list[str]) -> int:
    if args.cluster_command == "master":
        return _master(rest)
    if rest:
        raise KvtierError(f"kvtier cluster storage-node: unrecognized arguments: {' '.join(rest)}")
    from .config import parse_size
    from ._errors import InvalidArgumentError
    from .tiers._storage_node import serve

    try:
        segment = parse_size("segment", args.segment, 1 << 20)
    except InvalidArgumentError as exc:
        raise KvtierError(f"--segment: {exc}") from None
    host, _, port = args.master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvtierError(f"--master {args.master!r}: expected HOST:PORT, such as 10.0.0.1:50051")
    return serve(args.master, segment, hostname=args.hostname, protocol=args.protocol, metadata=args.metadata,
                 log=args.log)


def _master(rest: list[str]) -> int:
    if {"-h", "--help"} & set(rest):
        print(MASTER_HELP, end="")
        return 0
    rest = ["--help" if a == "--mooncake-help" else a for a in rest]
    from .tiers._mooncake_env import INSTALL_HINT, binary, child_env, missing_libraries

    try:
        path = binary("mooncake_master")
    except KvtierError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to find it is the same advice
        raise KvtierError(f"{INSTALL_HINT} ({exc})") from None
    env = child_env()
    missing = missing_libraries(path, env)
    if missing:  # (else the loader's own message and exit status 127, from a process that never started)
        raise KvtierError(f"{path} cannot start: the system libraries {', '.join(missing)} are missing. Install the "
                          "packages that provide them (libibverbs.so.1: apt-get install libibverbs1 on Debian/Ubuntu), "
                          "or without root `make syslibs` in kvtier's checkout, or point $KVTIER_SYSLIB_DIR at a "
                          "directory holding them")
    os.execve(path, [path, *rest], env)  # replaces this process: signals reach the master itself
    return 0  # not reached
