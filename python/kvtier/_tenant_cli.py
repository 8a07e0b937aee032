"""``kvtier keys`` (a keyring for encryption at rest) and ``kvtier erase`` (one tenant's pages out of every
namespace of a store directory, out of the cluster, and its key destroyed). See docs/SECURITY.md."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ._errors import KvtierError


def add_parsers(sub: Any) -> None:
    keys = sub.add_parser("keys", help="create or list a keyring for encryption at rest (docs/SECURITY.md)")
    keys.add_argument("action", choices=["init", "list"], help="init: a new keyring with a random master key "
                      "(never overwrites one); list: its id and the tenants that have a key")
    keys.add_argument("keyring", metavar="KEYRING-DIR")
    er = sub.add_parser("erase", help="remove one tenant's pages from a store directory (every namespace), the "
                        "cluster tier and its key; says what it would do unless --yes")
    er.add_argument("path", nargs="?", help="a store directory (every namespace in it); optional with --cluster "
                    "or --keyring")
    who = er.add_mutually_exclusive_group(required=True)
    who.add_argument("--tenant", metavar="SALT", help="the tenant's salt (cache_salt, or the deployment's tenant)")
    who.add_argument("--tag", help="the tenant's 16-hex-digit tag (what kvtier shows in keys and key files)")
    er.add_argument("--keyring", metavar="DIR", help="also destroy the tenant's key in this keyring: what any copy "
                    "or crash kept of its sealed pages becomes unreadable")
    er.add_argument("--cluster", metavar="MASTER", help="also remove its objects from this Mooncake cluster "
                    "(host:port of the master)")
    er.add_argument("--yes", action="store_true", help="erase (without it, only say what would be erased)")


def cmd_keys(args: argparse.Namespace) -> int:
    from .tenants import Keyring

    if args.action == "init":
        kr = Keyring.init(args.keyring)
        print(f"created keyring {os.path.abspath(kr.path)} (id {kr.id}); keep master.key secret and backed up: "
              "without it nothing sealed with it can be read")
        return 0
    kr = Keyring(args.keyring)
    tenants = kr.tenants()
    print(f"keyring {os.path.abspath(kr.path)}: id {kr.id}, {len(tenants)} tenant key(s)")
    for t in tenants:
        print(f"  {t}")
    return 0


def _erase_disk(path: str, tag: str, yes: bool) -> tuple[int, int]:
    """(objects erased or found, namespaces refused)."""
    from . import _native
    from ._store_cli import list_namespaces
    from .tenants import tenant_of

    found = refused = 0
    info = list_namespaces(path)
    listed = {e["dir"] for e in info["namespaces"]}
    for d in sorted(os.listdir(path)):
        full = os.path.join(path, d)
        if d not in listed and os.path.isdir(full) and any(
                os.path.exists(os.path.join(full, f)) for f in ("journal.log", "NAMESPACE")):
            refused += 1  # a copy or a move inside the store directory: its pages are out of any namespace's reach
            print(f"kept {d}: a store namespace's files under a name kvtier does not open; it may hold the "
                  f"tenant's pages: remove it (rm -r {full})")
    for e in info["namespaces"]:
        ns = e["namespace"]
        if ns is None or e["problem"]:
            # a namespace that cannot be opened by its name may still hold the tenant: never pass it by silently
            refused += 1
            print(f"kept {e['dir']}: {e['problem'] or 'no readable NAMESPACE file'}; it may hold the tenant's pages: "
                  f"remove it (`kvtier remove {path} {e['dir']} --yes`)")
            continue
        if e["live"]:
            refused += 1
            who = f"pid {e['pid']}" if e["pid"] else "a running process"
            print(f"kept {e['dir']}: open by {who}; erase through it (PageStore.erase_tenant / "
                  "TierController.erase_tenant), or stop it and run this again")
            continue
        try:
            s = _native.PageStore(path, ns, 1 << 62, 4, None, not yes)
        except OSError as exc:  # taken by a writer since it was listed
            refused += 1
            print(f"kept {e['dir']}: {exc}")
            continue
        try:
            mine = [k for k in s.keys() if tenant_of(k) == tag]
            if mine and yes:
                s.delete(mine)
        finally:
            s.close()
        found += len(mine)
        if mine:
            print(f"{'erased' if yes else 'would erase'} {len(mine)} object(s) in {e['dir']} ({ns})")
    return found, refused


def cmd_erase(args: argparse.Namespace) -> int:
    from .tenants import Keyring, erase_tag

    if not (args.path or args.cluster or args.keyring):
        raise KvtierError("kvtier erase: name a store directory, --cluster MASTER or --keyring DIR")
    tag = erase_tag(args.tenant, args.tag)
    print(f"tenant {tag}")
    refused = 0
    if args.path:
        if not os.path.isdir(args.path):
            raise KvtierError(f"{args.path}: no such store directory")
        found, refused = _erase_disk(args.path, tag, args.yes)
        print(f"{args.path}: {found} object(s) of the tenant {'erased' if args.yes else 'found'}")
    if args.cluster:
        if args.yes:
            from .tiers.mooncake import MooncakeTier

            with MooncakeTier(args.cluster, model_name="kvtier-erase") as t:
                print(f"cluster {args.cluster}: {t.erase_tenant(tag=tag)} object(s) removed")
        else:
            print(f"would remove every object of the tenant from the cluster at {args.cluster}")
    if args.keyring:
        kr = Keyring(args.keyring)
        if args.yes:
            print(f"keyring {kr.path}: the tenant's key {'destroyed' if kr.erase(tag=tag) else 'was not there'}")
        else:
            print(f"would destroy the tenant's key in {kr.path}"
                  + ("" if tag in kr.tenants() else " (it has none)"))
    if not args.yes:
        print("(nothing erased: add --yes to erase)")
    return 1 if refused else 0
