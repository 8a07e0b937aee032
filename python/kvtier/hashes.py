"""SGLang-compatible page keys (no torch needed: a storage host may not have it)."""

from __future__ import annotations

from collections.abc import Sequence

from . import _native
from ._errors import InvalidArgumentError


def page_hashes(token_ids: Sequence[int], page_size: int, prior_hash: str | None = None, *,
                salt: str | None = None) -> list[str]:
    """SGLang HiCache's chained SHA-256 page keys (64 lowercase hex characters each) of ``token_ids``: page i
    hashes the previous page's digest followed by its token ids as 4-byte little-endian integers; a trailing
    partial page is hashed over the tokens it has, exactly as SGLang's ``get_hash_str``. Computed in Rust.

    With ``salt`` (a tenant: e.g. the request's ``cache_salt``), the keys are that tenant's
    (:func:`kvtier.tenants.tenant_keys`): they never match another tenant's, in any tier."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise InvalidArgumentError(f"invalid argument `page_size`: must be a positive int, got {page_size!r}")
    if hasattr(token_ids, "tolist") and not isinstance(token_ids, (list, tuple)):  # a tensor or an array
        token_ids = token_ids.tolist()
    try:
        keys = _native.page_hashes(list(token_ids), page_size, prior_hash)
    except OverflowError:
        raise InvalidArgumentError("invalid argument `token_ids`: token ids must be in [0, 2**32)") from None
    if salt is None:
        return keys
    from .tenants import tenant_keys

    return tenant_keys(salt, keys)
