"""Class-level traits declared as class keywords, the pattern of every registry in diffret (readouts, stages)."""

from __future__ import annotations

from typing import Any


class Declared:
    """A subclass declares the traits its bases annotate as class keywords: ``class X(Base, name="x", flag=True)``.

    >>> class Shape(Declared):
    ...     sides: int
    >>> class Square(Shape, sides=4):
    ...     pass
    >>> Square.sides
    4
    """

    def __init_subclass__(cls, **traits: Any) -> None:
        super().__init_subclass__()
        known = {name for base in cls.__mro__ for name in getattr(base, "__annotations__", {})}
        unknown = set(traits) - known
        if unknown:
            raise TypeError(f"{cls.__name__}: unknown trait(s) {sorted(unknown)}; known: {sorted(known)}")
        for key, value in traits.items():
            setattr(cls, key, value)
