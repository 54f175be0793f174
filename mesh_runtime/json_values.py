"""JSON values carried in ``google.protobuf.Struct``: a Struct holds every number as a double, so a whole
number written as ``3`` reads back as ``3.0``. :func:`from_struct` gives them back as the integers they were
(within a double's exact range), so a value that went through a Struct equals the one put in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format, struct_pb2

_EXACT = 2**53
"""Whole doubles below this are exact integers."""


def integral(value: Any) -> Any:
    """``value`` (a JSON value) with its whole-number floats as ints, in nested lists and objects too."""
    if isinstance(value, float) and value.is_integer() and abs(value) < _EXACT:
        return int(value)
    if isinstance(value, list):
        return [integral(v) for v in value]
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    return value


def to_struct(values: Mapping[str, Any]) -> struct_pb2.Struct:
    """``values`` (str keys, JSON values) as a Struct."""
    struct = struct_pb2.Struct()
    struct.update(dict(values))
    return struct


def from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    """A Struct's values as JSON values, whole numbers as ints."""
    return integral(json_format.MessageToDict(struct))
