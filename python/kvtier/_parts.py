"""What a component of :class:`kvtier.TierController` reads of it, and its attributes the controller forwards."""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar, cast, overload

from .host_pages import Stats

T = TypeVar("T")


class Owner(Protocol):
    """What a component reads of its controller at each use (either may be swapped: an integration gives the
    controller fresh counters, a test another store)."""

    store: Any
    stats: Stats


class Part(Generic[T]):
    """A :class:`kvtier.TierController` attribute or method that is one of its components': read there, and (a
    setting such as ``restore_deadline``) written there. ``component``: the controller's attribute that holds the
    component; ``of``: its class (a method's documentation is that class's)."""

    def __init__(self, component: str, of: type, doc: str | None = None) -> None:
        self.component, self.of, self.__doc__ = component, of, doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        if self.__doc__ is None:
            self.__doc__ = getattr(self.of, name).__doc__

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> Part[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: object, objtype: type | None = None) -> Part[T] | T:
        return self if obj is None else cast(T, getattr(getattr(obj, self.component), self.name))

    def __set__(self, obj: object, value: T) -> None:
        setattr(getattr(obj, self.component), self.name, value)
