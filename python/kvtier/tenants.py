"""Tenants: keys that never match across tenants, and the keyring that seals their pages at rest.

A tenant is named by a **salt**: the engine's per-request ``cache_salt`` where it has one, or a per-deployment
salt set in kvtier's configuration (taken in Unicode NFC: two spellings of one name are one tenant).
:func:`tenant_keys` turns an engine's page keys into the tenant's: ``t<tag>.<mac>``, where ``tag`` (32 hex
digits, :func:`tenant_tag`) names the tenant for erasure and ``mac`` is an HMAC-SHA256 of the engine's key
under a key derived from the salt, so two tenants never share a key. Both are functions of the salt alone:
whoever guesses a salt computes them. With a :class:`Keyring`, the disk and cluster tiers store every object
under a name keyed by the master key instead (:meth:`Keyring.stored_names`), so their names show no engine
key and no tenant to anyone without the keyring.

A deployment's tenant (:func:`scope_keys`) scopes every key that does not already carry that same tenant:
a key carrying another tenant's tag (a request's own salt) is scoped again, inside the deployment, so no key
escapes its deployment by looking scoped.

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
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError("invalid argument `salt`: not valid Unicode text (a lone surrogate); a salt "
                                   "is text, read from a file as UTF-8") from None
    return salt


def _key_list(keys: Any) -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence) or not all(isinstance(k, str) for k in keys):
        raise InvalidArgumentError(f"invalid argument `keys`: a sequence of str, got {type(keys).__name__}")
    if not all(keys):
        raise InvalidArgumentError("invalid argument `keys`: an empty key names no page")
    return list(keys)


def _dir(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str) or not os.fspath(path) \
            or "\0" in os.fspath(path):
        raise InvalidArgumentError(f"invalid argument `keyring`: a keyring directory, got {path!r}")
    return os.fspath(path)


def tenant_tag(salt: str) -> str:
    """The 32-hex-digit tag that names tenant ``salt`` (in Unicode NFC) in its keys and erasure."""
    return _native.tenant_tag(_salt(salt))


def tenant_keys(salt: str, keys: Sequence[str]) -> list[str]:
    """Tenant ``salt``'s form of each of ``keys`` (see the module docs)."""
    return _native.tenant_keys(_salt(salt), _key_list(keys))


def tenant_of(key: str) -> str | None:
    """The tenant tag ``key`` carries, or None (a key of no tenant)."""
    if not isinstance(key, str):
        raise InvalidArgumentError(f"invalid argument `key`: a str, got {type(key).__name__}")
    return _native.tenant_of(key)


def scope_keys(salt: str | None, keys: Sequence[str]) -> list[str]:
    """``keys`` scoped to the deployment tenant ``salt``: keys that already carry this tenant's tag stay as
    they are, every other key (one of no tenant, or of another tenant, such as a request's own salt) becomes
    this tenant's; with ``salt=None`` every key stays as it is."""
    keys = _key_list(keys)
    if salt is None:
        return keys
    mine = tenant_tag(salt)
    bare = [i for i, k in enumerate(keys) if _native.tenant_of(k) != mine]
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
        self.path = _dir(path)
        self._native = _native.Keyring(self.path)

    @classmethod
    def init(cls, path: str | os.PathLike[str]) -> Keyring:
        """Create a keyring directory with a new random master key (never overwrites one) and open it."""
        _native.Keyring.init(_dir(path))
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
        """Stored tags of the tenants that have a key (keyed by the master key: they do not show which
        tenant they belong to; :meth:`stored_tag` maps a tenant's tag to its stored one)."""
        return list(self._native.tenants())

    def erased_tenants(self) -> list[str]:
        """Stored tags of the erased tenants (see :meth:`erase`)."""
        return list(self._native.erased_tenants())

    def stored_tag(self, salt: str | None = None, *, tag: str | None = None) -> str:
        """The tag a tenant (by ``salt`` or ``tag``) has in stored names and in this keyring's files."""
        return str(self._native.stored_tag(_tag(salt, tag)))

    def stored_names(self, keys: Sequence[str]) -> list[str]:
        """The name each of ``keys`` is stored under in a sealed store or cluster tier: keyed by the master
        key, so no engine key and no tenant tag shows."""
        return list(self._native.stored_names(_key_list(keys)))

    def erase(self, salt: str | None = None, *, tag: str | None = None) -> bool:
        """Erase a tenant (by ``salt``, or by ``tag=``: a positional string is always a salt): it is marked erased, so that no process sharing this
        keyring gives it a key again (its writes fail, its reads miss) until :meth:`allow`; then its key is
        destroyed, so nothing sealed under it opens with this keyring again. Returns whether there was a
        key."""
        return bool(self._native.erase_tenant(_tag(salt, tag)))

    def erased(self, salt: str | None = None, *, tag: str | None = None) -> bool:
        """Whether the tenant is erased here (see :meth:`erase`)."""
        return bool(self._native.erased(_tag(salt, tag)))

    def has_key(self, salt: str | None = None, *, tag: str | None = None) -> bool:
        """Whether the tenant has a key file here."""
        return bool(self._native.has_key(_tag(salt, tag)))

    def allow(self, salt: str | None = None, *, tag: str | None = None) -> bool:
        """Let an erased tenant have a key again: its next write makes a new one (nothing sealed before the
        erasure opens with it). Returns whether it was erased."""
        return bool(self._native.allow_tenant(_tag(salt, tag)))

    def __repr__(self) -> str:
        return f"Keyring({self.path!r}, id={self.id})"


def _tag(salt: str | None, tag: str | None) -> str:
    if (salt is None) == (tag is None):
        raise InvalidArgumentError("invalid argument `salt`: give the tenant's salt or its tag, not both or neither")
    if tag is not None:
        if not isinstance(tag, str) or len(tag) != 32 or any(c not in "0123456789abcdef" for c in tag):
            raise InvalidArgumentError(f"invalid argument `tag`: 32 lowercase hex digits, got {tag!r}")
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


def check_keys(keys: Sequence[str]) -> list[str]:
    """``keys`` as a list, each a non-empty str (else an error naming `keys`)."""
    if isinstance(keys, str):
        raise InvalidArgumentError("invalid argument `keys`: expected a sequence of str, got one str")
    out = list(keys)
    for k in out:
        if not isinstance(k, str) or not k:
            raise InvalidArgumentError(f"invalid argument `keys`: every key must be a non-empty str, got {k!r}")
    return out
