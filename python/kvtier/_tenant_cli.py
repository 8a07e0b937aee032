"""``kvtier keys`` (a keyring for encryption at rest) and ``kvtier erase`` (one tenant's pages out of every
namespace of a store directory, out of the cluster, and the tenant kept erased in its keyring). See
docs/SECURITY.md.

An erase checks everything it needs before it changes anything (the store directory, every namespace it
must open, the keyring, the cluster's master), then does all of it, and says what it did at each step."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from typing import Any

from ._errors import KvtierError
from .namespace import Namespace


def add_parsers(sub: Any) -> None:
    keys = sub.add_parser("keys", help="create, list or re-allow tenants in a keyring for encryption at rest "
                          "(docs/SECURITY.md)")
    keys.add_argument("action", choices=["init", "list", "allow"], help="init: a new keyring with a random master "
                      "key (never overwrites one); list: its id, the tenants with a key and the erased ones "
                      "(by their keyed tags); allow: let an erased tenant (--tenant-file, --tenant or --tag) "
                      "have a key again")
    keys.add_argument("keyring", metavar="KEYRING-DIR")
    _who(keys, required=False)
    er = sub.add_parser("erase", help="remove one tenant's pages from a store directory (every namespace), the "
                        "cluster tier, and keep it erased in its keyring; says what it would do unless --yes")
    er.add_argument("path", nargs="?", help="a store directory (every namespace in it); optional with --cluster "
                    "or --keyring")
    _who(er, required=True)
    er.add_argument("--keyring", metavar="DIR", help="the tenant is erased in this keyring: its key destroyed, "
                    "and no process sharing the keyring gives it a key again until `kvtier keys allow`. "
                    "Required when the directory holds sealed namespaces")
    er.add_argument("--cluster", metavar="MASTER", help="also remove its objects from this Mooncake cluster "
                    "(host:port of the master)")
    er.add_argument("--yes", action="store_true", help="erase (without it, only say what would be erased)")


def _who(p: Any, required: bool) -> None:
    who = p.add_mutually_exclusive_group(required=required)
    who.add_argument("--tenant-file", metavar="FILE", help="read the tenant's salt from FILE ('-': standard "
                     "input), so that it never shows on a command line")
    who.add_argument("--tenant", metavar="SALT", help="the tenant's salt (shows in the process list: prefer "
                     "--tenant-file)")
    who.add_argument("--tag", help="the tenant's 32-hex-digit tag (kvtier.tenant_tag(salt))")


_SALT_FILE_MAX = 4096  # bytes of a salt file read at most: a salt is one short line


def _read_salt_file(path: str) -> bytes:
    """The first bytes of a regular file, opened without blocking: a FIFO, a device or a directory named as
    the salt file is refused, never waited on or read without end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file (a salt file is a file holding one line)")
        return os.read(fd, _SALT_FILE_MAX + 1)
    finally:
        os.close(fd)


def _tag_of(args: argparse.Namespace) -> str:
    from .tenants import erase_tag

    if args.tenant_file is not None:
        try:
            if args.tenant_file == "-":
                if sys.stdin is None:
                    raise OSError("standard input is closed")
                raw = sys.stdin.buffer.readline(_SALT_FILE_MAX + 1)
            else:
                raw = _read_salt_file(args.tenant_file)
            if len(raw) > _SALT_FILE_MAX and b"\n" not in raw:
                raise KvtierError(f"--tenant-file: no line end in its first {_SALT_FILE_MAX} bytes: a salt is "
                                  "one short line")
            salt = raw.split(b"\n", 1)[0].rstrip(b"\r").decode("utf-8")
        except OSError as exc:
            raise KvtierError(f"--tenant-file: {exc}") from exc
        except UnicodeDecodeError:
            raise KvtierError("--tenant-file: the first line is not UTF-8 text (a salt is text)") from None
        salt = salt.removeprefix("\ufeff")  # an editor's byte-order mark is not the salt
        if not salt:
            raise KvtierError("--tenant-file: the first line is empty: it must hold the tenant's salt")
        return erase_tag(salt, None)
    return erase_tag(args.tenant, args.tag)


def cmd_keys(args: argparse.Namespace) -> int:
    from .tenants import Keyring

    if args.action == "init":
        kr = Keyring.init(args.keyring)
        print(f"created keyring {os.path.abspath(kr.path)} (id {kr.id}); keep master.key secret. Back up "
              "master.key alone if you back anything up: a backup of tenants/ would let an erased tenant's "
              "pages open again (docs/SECURITY.md)")
        return 0
    kr = Keyring(args.keyring)
    if args.action == "allow":
        if args.tenant is None and args.tag is None and args.tenant_file is None:
            raise KvtierError("kvtier keys allow: name the tenant (--tenant-file, --tenant or --tag)")
        tag = _tag_of(args)
        was = kr.allow(tag=tag)
        print(f"tenant {kr.stored_tag(tag=tag)} (keyed tag): " + ("allowed again: its next write makes a new key (nothing sealed before its "
                                   "erasure opens)" if was else "was not erased here (nothing changed)"))
        return 0
    tenants, erased = kr.tenants(), kr.erased_tenants()
    print(f"keyring {os.path.abspath(kr.path)}: id {kr.id}, {len(tenants)} tenant key(s), {len(erased)} erased "
          "tenant(s) (keyed tags: `kvtier.Keyring(...).stored_tag(salt)` names one)")
    for t in tenants:
        print(f"  {t}")
    for t in erased:
        print(f"  {t} (erased)")
    return 0


def _sealed_id(ns: str | None) -> str | None:
    """The keyring id a namespace string is sealed with, or None for a clear one."""
    parsed = Namespace.parse_or_none(ns)
    return parsed.sealed if parsed is not None else None


def _plan_disk(path: str, kr: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """The namespaces to erase from (each with its tenant's object count) and the reasons others are kept."""
    from ._store_cli import list_namespaces

    info = list_namespaces(path)
    listed = {e["dir"] for e in info["namespaces"]}
    todo: list[dict[str, Any]] = []
    kept: list[str] = []
    for d in sorted(os.listdir(path)):
        full = os.path.join(path, d)
        if d not in listed and os.path.isdir(full) and any(
                os.path.exists(os.path.join(full, f)) for f in ("journal.log", "NAMESPACE")):
            kept.append(f"{d}: a store namespace's files under a name kvtier does not open; it may hold the tenant's "
                        f"pages: remove it (rm -r {full})")
    for e in info["namespaces"]:
        ns = e["namespace"]
        if ns is None or e["problem"]:
            kept.append(f"{e['dir']}: {e['problem'] or 'no readable NAMESPACE file'}; it may hold the tenant's "
                        f"pages: remove it (`kvtier remove {path} {e['dir']} --yes`)")
            continue
        if e["live"]:
            who = f"pid {e['pid']}" if e["pid"] else "a running process"
            kept.append(f"{e['dir']}: open by {who}; erase through it (PageStore.erase_tenant / "
                        "TierController.erase_tenant), or stop it and run this again")
            continue
        if Namespace.parse_or_none(ns) is None:  # (never erased as clear: it may be sealed)
            kept.append(f"{e['dir']}: its namespace string does not parse ({ns!r}); it may hold the tenant's "
                        f"pages: remove it (`kvtier remove {path} {e['dir']} --yes`)")
            continue
        sid = _sealed_id(ns)
        if sid is not None and kr is None:
            kept.append(f"{e['dir']}: sealed (keyring id {sid}); give its keyring with --keyring, which erases "
                        "the tenant there too")
            continue
        if sid is not None and sid != kr.id:
            kept.append(f"{e['dir']}: sealed with another keyring (id {sid}, not {kr.id}); erase with that "
                        f"keyring, or remove the namespace (`kvtier remove {path} {e['dir']} --yes`)")
            continue
        todo.append({"dir": e["dir"], "namespace": ns, "sealed": sid is not None})
    return todo, kept


def _count(path: str, ns: str, kr: Any, tag: str) -> int:
    from . import _native
    from .tenants import tenant_of

    s = _native.PageStore(path, ns, 1 << 62, 4, None, True, None, kr.native if kr is not None else None)
    try:
        mine = kr.stored_tag(tag=tag) if kr is not None else tag
        return sum(1 for k in s.keys() if tenant_of(k) == mine)
    finally:
        s.close()


def _erase_namespace(path: str, ns: str, kr: Any, tag: str) -> int:
    from . import _native

    # opened for maintenance: the counters and capacity the engine left in STATS are kept
    s = _native.PageStore(path, ns, 1 << 62, 4, None, False, None, kr.native if kr is not None else None,
                          maintenance=True)
    try:
        return int(s.erase_tenant(tag))
    finally:
        s.close()


def _open_cluster(master: str, kr: Any) -> Any:
    try:
        from .tier import TierContext, build_tier
        from .tiers.mooncake import MooncakeTier  # noqa: F401 - its packages are checked before anything is erased
    except ImportError as exc:
        raise KvtierError(f"--cluster needs the cluster tier's packages (torch and mooncake-transfer-engine: "
                          f"`pip install kvtier[mooncake]`): {exc}") from exc
    try:
        return build_tier({"mooncake": {"master_server_address": master}},
                          TierContext(model_name="kvtier-erase", keyring=kr))
    except Exception as exc:  # noqa: BLE001 - any failure to reach the master stops the erase before it starts
        raise KvtierError(f"--cluster {master}: the cluster's master cannot be reached ({exc}); nothing was "
                          "erased") from exc


def cmd_erase(args: argparse.Namespace) -> int:
    from .tenants import Keyring

    if not (args.path or args.cluster or args.keyring):
        raise KvtierError("kvtier erase: name a store directory, --cluster MASTER or --keyring DIR")
    tag = _tag_of(args)
    # everything this erase needs, checked before anything changes
    if args.path and not os.path.isdir(args.path):
        raise KvtierError(f"{args.path}: no such store directory; nothing was erased")
    kr = Keyring(args.keyring) if args.keyring else None
    todo, kept = _plan_disk(args.path, kr) if args.path else ([], [])
    counts = {t["dir"]: _count(args.path, t["namespace"], kr if t["sealed"] else None, tag) for t in todo}
    cluster = _open_cluster(args.cluster, kr) if args.cluster else None
    # with a keyring, its keyed tag: the plain tag is a function of the salt, worth nothing in a log
    print(f"tenant {kr.stored_tag(tag=tag)} (keyed tag)" if kr is not None else f"tenant {tag}")
    for why in kept:
        print(f"kept {why}")
    try:
        if not args.yes:
            for t in todo:
                if counts[t["dir"]]:
                    print(f"would erase {counts[t['dir']]} object(s) in {t['dir']} ({t['namespace']})")
            if args.path:
                print(f"{args.path}: {sum(counts.values())} object(s) of the tenant found")
            if cluster is not None:
                print(f"would remove every object of the tenant from the cluster at {args.cluster} (its master "
                      "answers)")
            if kr is not None:
                state = "erased already" if kr.erased(tag=tag) else (
                    "has a key" if kr.has_key(tag=tag) else "has no key")
                print(f"would erase the tenant in keyring {kr.path} ({state}): its key destroyed, no new one "
                      "until `kvtier keys allow`")
            print("(nothing erased: add --yes to erase)")
            return 1 if kept else 0
        # the keyring first: from here on no process sharing it seals or opens the tenant's pages
        left = [f"namespace {t['dir']}" for t in todo] + ([f"the cluster at {args.cluster}"] if cluster else [])
        try:
            if kr is not None:
                had = kr.erase(tag=tag)
                print(f"keyring {kr.path}: tenant erased (its key {'destroyed' if had else 'was not there'}; no "
                      "new one until `kvtier keys allow`)")
            total = 0
            for t in todo:
                n = _erase_namespace(args.path, t["namespace"], kr if t["sealed"] else None, tag)
                left.remove(f"namespace {t['dir']}")
                total += n
                if n:
                    print(f"erased {n} object(s) in {t['dir']} ({t['namespace']}): bytes overwritten, names "
                          "compacted out of the journal")
            if args.path:
                print(f"{args.path}: {total} object(s) of the tenant erased")
            if cluster is not None:
                print(f"cluster {args.cluster}: {cluster.erase_tenant(tag=tag)} object(s) removed")
                left.pop()
        except BaseException:
            if left:  # say exactly what this erase did not reach; running it again finishes it
                print("not erased (stopped before): " + "; ".join(left) + ". Run the same command again to "
                      "finish", file=sys.stderr)
            raise
    finally:
        if cluster is not None:
            cluster.close()
    return 1 if kept else 0
