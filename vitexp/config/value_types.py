"""Whether a plain config value has the type an annotation declares, and the type in words:
the predicates :mod:`vitexp.config.schema` checks every key with (strict Python types: an integer is a
float, a float is no integer, only ``true``/``false`` a boolean; a ``Literal`` is a list of choices;
a string that converts losslessly to the number expected, as ``${oc.env:...}`` gives, is that
number)."""

from __future__ import annotations

import collections.abc as cabc
import dataclasses
import re
import types
import typing
from typing import Any, Literal, Mapping, Union

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _number(value: Any, annotation: Any) -> int | float | None:
    """``value``, a string, as the integer or float ``annotation`` expects when it converts
    losslessly (``'3'`` to 3, ``'0.001'`` to 0.001; ``'3.5'`` is no integer), else None."""
    if not isinstance(value, str):
        return None
    members = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    text = value.strip()
    if int in members and _INT.fullmatch(text):
        return int(text)
    if float in members and _FLOAT.fullmatch(text):
        return float(text)
    return None


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Union, types.UnionType)


def conforms(value: Any, annotation: Any) -> bool:
    """Whether a plain config value has type ``annotation`` (module docstring: strict types)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True
    if annotation is type(None):
        return value is None
    if _is_union(annotation):
        return any(conforms(value, a) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple, cabc.Sequence) or annotation in (list, tuple):
        item = args[0] if args else Any
        return isinstance(value, (list, tuple)) and all(conforms(v, item) for v in value)
    if (
        origin in (dict, cabc.Mapping)
        or annotation in (dict, Mapping)
        or dataclasses.is_dataclass(annotation)
    ):
        item = args[1] if len(args) == 2 else Any
        return isinstance(value, Mapping) and all(conforms(v, item) for v in value.values())
    if isinstance(
        annotation, type
    ):  # a class a config cannot hold (an Accelerator): never the config's value
        return isinstance(value, annotation)
    return True  # a TypeVar or a string annotation: unchecked


_NAMES = {bool: "true or false", int: "an integer", float: "a float", str: "a string", type(None): "null"}
_PLURALS = {bool: "booleans", int: "integers", float: "floats", str: "strings"}


def describe(annotation: Any) -> str:
    """The type ``annotation`` in words, as an error message says what was expected."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in _NAMES:
        return _NAMES[annotation]
    if _is_union(annotation) or origin is Literal:
        members = args if _is_union(annotation) else (annotation,)
        choices, others = [], []
        for a in members:  # every Literal of a union in one "one of [...]"
            if typing.get_origin(a) is Literal:
                choices += list(typing.get_args(a))
            elif a is not type(None):
                others.append(describe(a))
        nullable = ["null"] if type(None) in members else []
        return " or ".join(([f"one of {choices}"] if choices else []) + others + nullable)
    if origin in (list, tuple, cabc.Sequence) or annotation in (list, tuple):
        item = args[0] if args else Any
        return (
            f"a list of {_PLURALS.get(item, 'items')}"
            if item in _PLURALS or item is Any
            else f"a list of items each {describe(item)}"
        )
    if (
        origin in (dict, cabc.Mapping)
        or annotation in (dict, Mapping)
        or dataclasses.is_dataclass(annotation)
    ):
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))
