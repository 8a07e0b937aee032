"""Object-store machinery any tier that keeps pages as objects builds on (the Mooncake cluster tier does):

- :mod:`~kvtier.tiers.objects.pages`: :class:`PageObjects`, a registered host pool's pages as named objects
  (their addresses and sizes in the pool's buffers) and the geometry fingerprint their records carry;
- :mod:`~kvtier.tiers.objects.records`: a page's integrity record (``record_bytes``, ``parse_record``), the
  check of a read against it (``check_read``) and the keys served without one (``Taint``);
- :mod:`~kvtier.tiers.objects.seal`: :class:`SealedCopies`, sealing at rest (docs/SECURITY.md).

Nothing here talks to a store: a tier moves the objects these name (docs/ARCHITECTURE.md, "A new tier")."""
