"""A store or tier namespace: the one place its string is built and read.

A namespace string is a scheme followed by ``|key=value`` fields in a fixed order, e.g.
``kvtier-v1|model=M|tp=0/2|pp=0/1|cp=0/1|dtype=bfloat16|layout=page_first|page=64|layers=32|heads=8|k=128|v=128``.
It names a store directory (``ns-<hash>``), a Mooncake record's fingerprint and a vLLM row store, so its
bytes never change: :meth:`Namespace.format` writes exactly what the builders wrote before it existed, and
:meth:`Namespace.parse` reads one back. A value may hold ``|`` only where the piece after it holds no ``=``
(SGLang's MLA model names end in ``|mla``); such a piece is read as part of the value before it. A value whose
``|`` piece holds ``key=`` is refused when the namespace is made (it would read back as a field of its own:
a model name holding ``|sealed=k`` would name a sealed namespace), so ``parse(format(ns)) == ns`` always; and
:meth:`parse` refuses a string that repeats a field or has fields after ``sealed`` (every builder writes the
seal last), such as a store made before that check whose model name planted ``|sealed=k``: the CLI keeps such
a namespace and names it instead of reading it as sealed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ._errors import InvalidArgumentError
from .config import check_ints, check_ranks

__all__ = ["Namespace", "Ranks", "check_value", "fields_of", "rank_fields"]


@dataclasses.dataclass(frozen=True)
class Namespace:
    """A namespace: its scheme (``kvtier-v1``, ``kvtier-vllm-v1``, ``kvtier-mooncake-v1``) and its ordered
    fields. Build one with :meth:`build`, extend it with :meth:`with_fields`, write it with :meth:`format`
    (or ``str()``), read one with :meth:`parse`."""

    scheme: str
    fields: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, str) or not self.scheme or "|" in self.scheme or "=" in self.scheme:
            raise InvalidArgumentError(f"invalid argument `scheme`: a non-empty string without '|' or '=', "
                                       f"got {self.scheme!r}")
        for key, value in self.fields:
            if not isinstance(key, str) or not key or "|" in key or "=" in key:
                raise InvalidArgumentError(f"invalid argument `fields`: key {key!r} must be a non-empty string "
                                           "without '|' or '='")
            if not isinstance(value, str):
                raise InvalidArgumentError(f"invalid argument `fields`: the value of {key!r} must be a string, "
                                           f"got {type(value).__name__}")
            check_value("fields", value, key)
        keys = [k for k, _ in self.fields]
        if len(set(keys)) != len(keys) or ("sealed" in keys and keys[-1] != "sealed"):
            raise InvalidArgumentError(f"invalid argument `fields`: each key once and `sealed` last, got {keys}")

    @classmethod
    def build(cls, scheme: str, fields: Mapping[str, Any] | None = None, /, **more: Any) -> Namespace:
        """``scheme`` with ``fields`` then ``more`` in order, each value written with ``str()``; a value of
        ``None`` leaves its field out (the optional fields of older stores)."""
        return cls(scheme, _pairs({**(fields or {}), **more}))

    def with_fields(self, fields: Mapping[str, Any] | None = None, /, **more: Any) -> Namespace:
        """This namespace with ``fields`` then ``more`` appended (``None`` values left out)."""
        return Namespace(self.scheme, self.fields + _pairs({**(fields or {}), **more}))

    def format(self) -> str:
        """The namespace string (the on-disk and wire form)."""
        return self.scheme + "".join(f"|{k}={v}" for k, v in self.fields)

    def __str__(self) -> str:
        return self.format()

    def get(self, key: str) -> str | None:
        """The value of field ``key`` (its last one), or None."""
        found = None
        for k, v in self.fields:
            if k == key:
                found = v
        return found

    @property
    def model(self) -> str | None:
        """The model the namespace names."""
        return self.get("model")

    @property
    def sealed(self) -> str | None:
        """The keyring id the namespace is sealed with, or None for a clear one."""
        return self.get("sealed")

    @property
    def mla(self) -> bool:
        """Whether the namespace names an MLA geometry (one object per page)."""
        return self.get("mla") is not None

    @classmethod
    def parse(cls, text: str) -> Namespace:
        """The namespace a string names; :class:`InvalidArgumentError` naming ``text`` when it is not one."""
        if not isinstance(text, str) or not text:
            raise InvalidArgumentError(f"invalid argument `text`: a namespace string must be a non-empty string, "
                                       f"got {text!r}")
        scheme, *pieces = text.split("|")
        if not scheme or "=" in scheme:
            raise InvalidArgumentError(f"invalid argument `text`: {text!r} does not start with a scheme "
                                       "(`kvtier-v1|key=value|...`)")
        fields: list[tuple[str, str]] = []
        for piece in pieces:
            key, eq, value = piece.partition("=")
            if eq and key:
                fields.append((key, value))
            elif fields:  # (a piece with no key: part of the value before it, as a model name may hold `|` or `|=`)
                fields[-1] = (fields[-1][0], fields[-1][1] + "|" + piece)
            else:
                raise InvalidArgumentError(f"invalid argument `text`: {text!r} has a field {piece!r} that is not "
                                           "`key=value`")
        try:  # (each key once and the seal last, as every builder writes: a string otherwise was not written by
            return cls(scheme, tuple(fields))  # one, e.g. a store whose model name planted `|sealed=k` before
        except InvalidArgumentError as exc:  # model names were checked)
            raise InvalidArgumentError(f"invalid argument `text`: {text!r} is not a namespace kvtier writes "
                                       f"({exc})") from None

    @classmethod
    def parse_or_none(cls, text: str | None) -> Namespace | None:
        """:meth:`parse`, or None for a missing or unreadable string (a damaged namespace directory)."""
        try:
            return cls.parse(text) if text else None
        except InvalidArgumentError:
            return None


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where a store or tier sits in the engine's parallel layout: the tensor-, pipeline- and
    context-parallel rank and size, the data-parallel rank and the decode context-parallel shard. One value
    in place of the rank keywords of :class:`kvtier.PageStore` and :class:`kvtier.tiers.MooncakeTier`
    (``ranks=Ranks(tp_rank=1, tp_size=4)``); checked when made (InvalidArgumentError naming ``<name>_rank``)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dp_rank: int = 0
    dcp_rank: int = 0
    dcp_size: int = 1

    def __post_init__(self) -> None:
        check_ints(dp_rank=(self.dp_rank, 0))
        check_ranks(tp=(self.tp_rank, self.tp_size), pp=(self.pp_rank, self.pp_size), cp=(self.cp_rank, self.cp_size),
                    dcp=(self.dcp_rank, self.dcp_size))

    def table(self) -> dict[str, tuple[int, int]]:
        """``{"tp": (rank, size), "pp": ..., "cp": ..., "dcp": ..., "dp": (rank, 0)}``: a store's ``ranks``."""
        return dict(tp=(self.tp_rank, self.tp_size), pp=(self.pp_rank, self.pp_size), cp=(self.cp_rank, self.cp_size),
                    dcp=(self.dcp_rank, self.dcp_size), dp=(self.dp_rank, 0))

    @classmethod
    def pick(cls, ranks: Ranks | None, **given: int) -> tuple[int, ...]:
        """The values of the rank keywords ``given`` (in their order): those given when ``ranks`` is None,
        else ``ranks``'s. Passing ``ranks`` with a rank keyword set too is an InvalidArgumentError, as is a
        ``ranks`` that sets a field the caller has no keyword for."""
        if ranks is None:
            return tuple(given.values())
        if not isinstance(ranks, Ranks):
            raise InvalidArgumentError(f"invalid argument `ranks`: a kvtier.namespace.Ranks, got {type(ranks).__name__}")
        default = cls()
        for name, value in given.items():
            if value != getattr(default, name):
                raise InvalidArgumentError(f"invalid argument `{name}`: pass `ranks` or the rank keywords, not both")
        for f in dataclasses.fields(cls):
            if f.name not in given and getattr(ranks, f.name) != getattr(default, f.name):
                raise InvalidArgumentError(f"invalid argument `ranks`: {f.name} is not a rank of this tier")
        return tuple(getattr(ranks, name) for name in given)


def check_value(arg: str, value: str, key: str = "model") -> str:
    """``value``, or InvalidArgumentError naming ``arg`` when it could not be a namespace field's value: a ``|``
    piece of it that holds ``key=`` would read back as a field of its own (a model name holding ``|sealed=k``
    would name a sealed namespace)."""
    control = next((c for c in value if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if control is not None:  # (a newline in a model name forged lines of the CLI's reports)
        raise InvalidArgumentError(f"invalid argument `{arg}`: the value of {key!r} ({value!r}) holds the control "
                                   f"character {control!r}")
    planted = next((p for p in value.split("|")[1:] if "=" in p and p.partition("=")[0]), None)
    if planted is not None:
        raise InvalidArgumentError(
            f"invalid argument `{arg}`: the value of {key!r} ({value!r}) holds `|{planted}`, which a namespace "
            "would read back as a field of its own; a value may hold '|' only before a piece without '=' (as "
            "`model|mla`)")
    return value


def fields_of(fragment: str) -> dict[str, str]:
    """The fields of a ``key=value|key=value`` fragment (e.g. :func:`kvtier.page_layout.heads_of`'s)."""
    return dict(Namespace.parse("x|" + fragment).fields)


def rank_fields(ranks: Mapping[str, tuple[int, int]], tp: tuple[int, int] | None = None) -> dict[str, Any]:
    """A page store's rank fields: ``tp``, ``pp``, ``cp`` as ``rank/size``; the DP rank only when set and a
    decode context-parallel shard only when split (stores written before they existed keep their names).
    ``tp`` overrides the store's TP rank (a pool replicated over ranks is named as rank 0 of 1)."""
    t = ranks["tp"] if tp is None else tp
    dp, dcp = ranks["dp"], ranks["dcp"]
    return {"tp": f"{t[0]}/{t[1]}", "pp": f"{ranks['pp'][0]}/{ranks['pp'][1]}",
            "cp": f"{ranks['cp'][0]}/{ranks['cp'][1]}", "dp": dp[0] if dp[0] else None,
            "dcp": f"{dcp[0]}/{dcp[1]}" if dcp[1] > 1 else None}


def _pairs(fields: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple((k, str(v)) for k, v in fields.items() if v is not None)
