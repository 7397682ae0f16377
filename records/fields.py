"""Field descriptors: each field of a record declared once, by where it is and what it reads as.

A record is plain JSON; its objects (the record, a leg, a leg's load, a comparison, …) are read
through *views* (:mod:`records.reader`) whose attributes are declared here as fields::

    class Leg(View):
        ttft_s = number(doc="t0 → first output-bearing event (s)")
        in_flight = number("load", "in_flight")

A field knows its path under the view's object and its **kind** — the vocabulary the wide
columns use (:mod:`records.wide`): ``key`` (text, ``""`` when absent), ``str``, ``num`` (a finite
number as ``float``, never ``bool``), ``int``, ``flag`` (``bool`` or ``None``), ``truth`` (``bool``,
absent is ``False``), ``keys`` (a list of text), ``ids`` (a list of ``int``), ``list`` (a list
kept as it came), ``map`` (an object kept as it came: one whose keys are data — backend names,
timing names — or an engine's own report), ``view`` (an object read through another view) and
``views`` (a list of objects, each read through a view). From that one declaration
come the lazy typed attribute (:meth:`Field.__get__`), the wide row's typed column and its SQL
expression (:func:`records.wide.Column.of`), and the list of every path a record may hold
(:func:`declared_paths`, which a test holds the writer to). A value of the wrong type reads as
``None`` (or ``""``, ``False``, ``()`` for the kinds that have no ``None``): a record is data,
never trusted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, Literal, TypeVar, overload

__all__ = [
    "EMPTY",
    "Field",
    "Kind",
    "View",
    "boolean",
    "declared_paths",
    "fields_of",
    "flag",
    "ids",
    "integer",
    "items",
    "key",
    "mapping",
    "name",
    "number",
    "opaque_paths",
    "strings",
    "text",
    "view",
    "views",
]

T = TypeVar("T")
V = TypeVar("V", bound="View")

Kind = Literal[
    "key", "str", "num", "int", "flag", "truth", "keys", "ids", "list", "map", "view", "views"
]

EMPTY: Mapping[str, Any] = {}


class View:
    """One JSON object of a record, read through declared fields (and computed properties)."""

    __slots__ = ("raw",)

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.raw!r})"


class Field(Generic[T]):
    """One declared field of a view: ``path`` under the view's object (default: the attribute's
    name), ``kind``, how a raw value reads (``convert``) and, for ``view`` fields, the view class
    its object is read through."""

    __slots__ = ("convert", "doc", "kind", "name", "nested", "path")

    def __init__(
        self,
        kind: Kind,
        path: tuple[str, ...],
        convert: Callable[[Any], T],
        *,
        doc: str = "",
        nested: type[View] | None = None,
    ) -> None:
        self.kind = kind
        self.path = path
        self.convert = convert
        self.doc = doc
        self.nested = nested
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        if not self.path:
            self.path = (name,)

    def raw_value(self, obj: Mapping[str, Any]) -> Any:
        v: Any = obj
        for k in self.path:
            v = v.get(k) if isinstance(v, Mapping) else None
        return v

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Field[T]: ...
    @overload
    def __get__(self, obj: View, owner: type | None = None) -> T: ...
    def __get__(self, obj: View | None, owner: type | None = None) -> Field[T] | T:
        if obj is None:
            return self
        return self.convert(self.raw_value(obj.raw))

    def __repr__(self) -> str:
        return f"Field({self.kind}, {'.'.join(self.path)})"


# -- readers of one raw value, one per kind ------------------------------------------------------


def as_number(value: Any) -> float | None:
    """A finite JSON number as ``float``; anything else (``bool``, NaN, text, null) is ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def as_key(value: Any) -> str:
    """A name as text, ``""`` when absent (the wide row's ``key`` kind)."""
    return "" if value is None else str(value)


def as_flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def as_map(value: Any) -> Mapping[str, Any] | None:
    return value if isinstance(value, Mapping) else None


def as_ids(value: Any) -> list[int] | None:
    """A list of token ids as stored; None unless every item is an ``int``."""
    if not isinstance(value, list) or not all(as_int(x) is not None for x in value):
        return None
    return value


def as_strings(value: Any) -> tuple[str, ...]:
    return tuple(str(x) for x in value if x is not None) if isinstance(value, list) else ()


# -- the declarations ----------------------------------------------------------------------------


def number(*path: str, doc: str = "") -> Field[float | None]:
    return Field("num", path, as_number, doc=doc)


def integer(*path: str, doc: str = "") -> Field[int | None]:
    return Field("int", path, as_int, doc=doc)


def text(*path: str, doc: str = "") -> Field[str | None]:
    return Field("str", path, as_str, doc=doc)


def key(*path: str, doc: str = "") -> Field[str]:
    return Field("key", path, as_key, doc=doc)


def flag(*path: str, doc: str = "") -> Field[bool | None]:
    return Field("flag", path, as_flag, doc=doc)


def boolean(*path: str, doc: str = "") -> Field[bool]:
    """``True`` only for a truthy value; absent is ``False``."""
    return Field("truth", path, bool, doc=doc)


def strings(*path: str, doc: str = "") -> Field[tuple[str, ...]]:
    return Field("keys", path, as_strings, doc=doc)


def ids(*path: str, doc: str = "") -> Field[list[int] | None]:
    return Field("ids", path, as_ids, doc=doc)


def name(*path: str, doc: str = "") -> Field[str | None]:
    """Text that names something: ``None`` when absent or empty."""
    return Field("str", path, lambda v: as_str(v) or None, doc=doc)


def items(*path: str, doc: str = "") -> Field[list[Any] | None]:
    """A list kept as it came (a sketch, per-position rates)."""
    return Field("list", path, lambda v: v if isinstance(v, list) else None, doc=doc)


def mapping(*path: str, doc: str = "") -> Field[Mapping[str, Any] | None]:
    """An object kept as it came (an engine's own report, a latency table, …)."""
    return Field("map", path, as_map, doc=doc)


def view(cls: type[V], *path: str, doc: str = "") -> Field[V | None]:
    """An object read through view ``cls``; None when absent (or not an object)."""

    def convert(value: Any) -> V | None:
        return cls(value) if isinstance(value, Mapping) else None

    return Field("view", path, convert, doc=doc, nested=cls)


def views(cls: type[V], *path: str, doc: str = "") -> Field[tuple[V, ...]]:
    """A list of objects, each read through view ``cls`` (items that are not objects skipped)."""

    def convert(value: Any) -> tuple[V, ...]:
        if not isinstance(value, list | tuple):
            return ()
        return tuple(cls(x) for x in value if isinstance(x, Mapping))

    return Field("views", path, convert, doc=doc, nested=cls)


# -- what is declared ----------------------------------------------------------------------------


def fields_of(cls: type[View]) -> Iterator[Field[Any]]:
    """Every field declared on ``cls`` and its bases, in declaration order."""
    seen: set[str] = set()
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Field) and name not in seen:
                seen.add(name)
                yield value


def declared_paths(cls: type[View], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every path a record object read by ``cls`` may hold (nested views included; a list of
    objects is one path, its items' fields below it)."""
    for f in fields_of(cls):
        path = prefix + f.path
        yield path
        if f.nested is not None:
            yield from declared_paths(f.nested, (*path, "[]") if f.kind == "views" else path)


def opaque_paths(cls: type[View], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The declared paths whose contents are data, not fields (``map``, ``list``, ``ids``)."""
    for f in fields_of(cls):
        path = prefix + f.path
        if f.kind in ("map", "list", "ids", "keys"):
            yield path
        if f.nested is not None:
            yield from opaque_paths(f.nested, (*path, "[]") if f.kind == "views" else path)
