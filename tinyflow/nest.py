"""Nested structures: the lists, tuples, namedtuples and dicts around values.

`Session.run` takes its fetches, and a traced function (`tf.function`) its arguments
and results, as any nesting of these containers around the things it works on (Nodes,
Tensors). Both open the nesting into a flat list of leaves, work on the list, and
build the same nesting back around the results: tf.nest's flatten / pack_sequence_as,
JAX's pytrees. Which containers are opened is fixed here, once: a list, a tuple, a
namedtuple (rebuilt as its own class) and a dict (rebuilt in its key order); anything
else, a tuple subclass with its own constructor included, is a leaf.

A nesting is None for a leaf, else (the container's class, its items' nestings), a
dict's items as (key, nesting) pairs. It is hashable when the dict keys are, so a
traced function uses it in its cache key.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def opens(value: Any) -> bool:
    """Whether `flatten` opens `value` (a list, tuple, namedtuple or dict)."""
    kind = type(value)
    return kind in (list, tuple, dict) or (isinstance(value, tuple) and
                                           hasattr(kind, "_fields"))


def flatten(value: Any, leaves: list) -> Any:
    """The nesting of `value`; its leaves are appended to `leaves`, left to right."""
    if not opens(value):
        leaves.append(value)
        return None
    if isinstance(value, dict):
        return (dict, tuple((key, flatten(item, leaves)) for key, item in value.items()))
    return (type(value), tuple(flatten(item, leaves) for item in value))


def unflatten(nesting: Any, leaves: Iterator) -> Any:
    """`nesting` built back around the next values of `leaves`."""
    if nesting is None:
        return next(leaves)
    kind, items = nesting
    if kind is dict:
        return {key: unflatten(item, leaves) for key, item in items}
    values = [unflatten(item, leaves) for item in items]
    if kind is list:
        return values
    return tuple(values) if kind is tuple else kind(*values)   # a namedtuple


def paths(nesting: Any, prefix: str) -> list[str]:
    """Where each leaf sits, in `flatten`'s order: `prefix`, then an index or key
    per level ("argument 1[0]['w']"), for messages that name a leaf."""
    if nesting is None:
        return [prefix]
    kind, items = nesting
    found: list[str] = []
    for position, item in enumerate(items):
        key, inner = item if kind is dict else (position, item)
        found += paths(inner, f"{prefix}[{key!r}]")
    return found


def describe(nesting: Any) -> str:
    """A nesting as text: x for each leaf ("tuple(x, x)", "dict(w=x)")."""
    if nesting is None:
        return "x"
    kind, items = nesting
    if kind is dict:
        inner = ", ".join(f"{key}={describe(item)}" for key, item in items)
    else:
        inner = ", ".join(describe(item) for item in items)
    return f"{kind.__name__}({inner})"
