"""Tenants: keys that never match across tenants, and the keyring that seals their pages at rest.

A tenant is named by a **salt**: the engine's per-request ``cache_salt`` where it has one, or a per-deployment
salt set in kvtier's configuration. :func:`tenant_keys` turns an engine's page keys into the tenant's:
``t<tag>.<mac>``, where ``tag`` (16 hex digits, :func:`tenant_tag`) names the tenant for erasure and ``mac``
is an HMAC-SHA256 of the engine's key under a key derived from the salt — two tenants never share a key,
and the names on disk or in the cluster do not reveal the engine's token hashes. A key already carrying a
tenant tag is left as it is (:func:`scope_keys`), so a per-request salt wins over a deployment's.

A :class:`Keyring` seals every object of the disk and cluster tiers with AES-256-GCM under a key per tenant
(docs/SECURITY.md). No torch needed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from . import _native
from ._errors import InvalidArgumentError


def _salt(salt: Any) -> str:
    if not isinstance(salt, str) or not salt:
        raise InvalidArgumentError(f"invalid argument `salt`: a non-empty string, got {salt!r}")
    return salt


def _key_list(keys: Sequence[str]) -> list[str]:
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise InvalidArgumentError("invalid argument `keys`: a sequence of str")
    return list(keys)


def tenant_tag(salt: str) -> str:
    """The 16-hex-digit tag that names tenant ``salt`` in its keys, key file and erasure."""
    return _native.tenant_tag(_salt(salt))


def tenant_keys(salt: str, keys: Sequence[str]) -> list[str]:
    """Tenant ``salt``'s form of each of ``keys`` (see the module docs)."""
    return _native.tenant_keys(_salt(salt), _key_list(keys))


def tenant_of(key: str) -> str | None:
    """The tenant tag ``key`` carries, or None (a key of no tenant)."""
    return _native.tenant_of(key)


def scope_keys(salt: str | None, keys: Sequence[str]) -> list[str]:
    """``keys`` scoped to tenant ``salt``: keys that already carry a tenant tag stay as they are; with
    ``salt=None`` every key stays as it is."""
    keys = _key_list(keys)
    if salt is None:
        return keys
    bare = [i for i, k in enumerate(keys) if _native.tenant_of(k) is None]
    if bare:
        mapped = _native.tenant_keys(_salt(salt), [keys[i] for i in bare])
        for i, m in zip(bare, mapped):
            keys[i] = m
    return keys


class Keyring:
    """A deployment's keys for encryption at rest: a directory holding ``master.key`` (mode 0600) and one
    key file per tenant, created at the tenant's first write (docs/SECURITY.md).

    Args:
        path: the keyring directory (create one with :meth:`init` or ``kvtier keys init PATH``).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise InvalidArgumentError(f"invalid argument `keyring`: a keyring directory, got {path!r}")
        self.path = os.fspath(path)
        self._native = _native.Keyring(self.path)

    @classmethod
    def init(cls, path: str | os.PathLike[str]) -> Keyring:
        """Create a keyring directory with a new random master key (never overwrites one) and open it."""
        _native.Keyring.init(os.fspath(path))
        return cls(path)

    @property
    def native(self) -> Any:
        """The Rust keyring (``kvtier._native.Keyring``) that the disk and cluster tiers seal with."""
        return self._native

    @property
    def id(self) -> str:
        """16 hex digits naming the master key (not secret: sealed namespaces carry it)."""
        return self._native.id

    def tenants(self) -> list[str]:
        """Tags of the tenants that have a key."""
        return list(self._native.tenants())

    def erase(self, salt: str | None = None, *, tag: str | None = None) -> bool:
        """Destroy a tenant's key (by ``salt`` or by ``tag``): nothing sealed under it can be opened again,
        by this process or any other. Returns whether there was a key."""
        return bool(self._native.erase_tenant(_tag(salt, tag)))

    def __repr__(self) -> str:
        return f"Keyring({self.path!r}, id={self.id})"


def _tag(salt: str | None, tag: str | None) -> str:
    if (salt is None) == (tag is None):
        raise InvalidArgumentError("invalid argument `salt`: give the tenant's salt or its tag, not both or neither")
    if tag is not None:
        if not isinstance(tag, str) or len(tag) != 16 or any(c not in "0123456789abcdef" for c in tag):
            raise InvalidArgumentError(f"invalid argument `tag`: 16 lowercase hex digits, got {tag!r}")
        return tag
    return tenant_tag(salt)  # type: ignore[arg-type]


def erase_tag(salt: str | None = None, tag: str | None = None) -> str:
    """The tag of the tenant named by ``salt`` or ``tag`` (exactly one), validated."""
    return _tag(salt, tag)


def open_keyring(keyring: Keyring | str | os.PathLike[str] | None) -> Keyring | None:
    """``keyring`` as a :class:`Keyring` (a path is opened); None stays None."""
    if keyring is None or isinstance(keyring, Keyring):
        return keyring
    return Keyring(keyring)
