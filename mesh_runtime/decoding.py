"""Request decoding, written once for every server: malformed input is INVALID_ARGUMENT, never UNKNOWN.

:class:`~mesh_runtime.pipeline.ServerPipeline`, the one interceptor of every
rollmesh server, hands gRPC a handler that receives the request's raw bytes,
decodes them with :func:`decode` (the method's own deserializer) and, before
the servicer sees anything:

* bytes that do not parse as the request message -> ``INVALID_ARGUMENT``
  (reason ``MALFORMED_REQUEST``) naming the message type. gRPC Python would
  otherwise answer ``UNKNOWN: Unexpected DecodeError``;
* an enum field (at any depth, repeated or in a map) holding a number its enum
  does not define -> ``INVALID_ARGUMENT`` (reason ``UNKNOWN_ENUM_VALUE``)
  naming the field path and the enum. proto3 keeps such numbers, and a
  servicer converting them would raise ``KeyError`` / ``ValueError``, i.e.
  ``INTERNAL``;
* and, with :func:`check_required` (the last step, after authorization), a field the contract marks
  ``(google.api.field_behavior) = REQUIRED`` (at any depth of what was sent)
  left unset or empty -> ``INVALID_ARGUMENT`` (reason
  ``REQUIRED_FIELD_MISSING``) naming its path: the contract's annotation is
  the check, not a copy of it in each servicer.

Client-streaming requests are decoded message by message; a bad one ends the
call with the same status. Nothing reaches a servicer, so nothing changes state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

from google.api import field_behavior_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from .errors import InvalidArgument
from .reasons import Reason

_MAX_QUOTE = 100


def _short(text: str) -> str:
    return text if len(text) <= _MAX_QUOTE else text[:_MAX_QUOTE] + "..."


def _type_name(deserializer: Callable[[bytes], Any]) -> str:
    cls = getattr(deserializer, "__self__", None)
    descriptor = getattr(cls, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "the request message")


def _of(field: FieldDescriptor) -> Descriptor:
    """The message type of a message-typed field."""
    message_type = field.message_type
    assert message_type is not None, field.full_name
    return message_type


def _descriptor(message: Message) -> Descriptor:
    return message.DESCRIPTOR  # type: ignore[return-value]  # upb's Descriptor is the same class at runtime


def _held(field: FieldDescriptor, value: Any, name: str) -> Iterator[tuple[str, Message]]:
    """The messages one message-typed field holds, with their paths (a map's values when they are messages)."""
    if _of(field).GetOptions().map_entry:
        if _of(field).fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
            yield from ((f"{name}[{_short(str(k))!r}]", v) for k, v in value.items())
    elif field.is_repeated:
        yield from ((f"{name}[{i}]", v) for i, v in enumerate(value))
    else:
        yield name, value


def _plan(descriptor: Descriptor, plans: dict, relevant: Callable[[FieldDescriptor], bool]) -> tuple:
    """The fields of ``descriptor`` worth visiting: those ``relevant`` says so of, and the message-typed ones
    whose types have such fields at any depth (map entries included). Computed once per type; a recursive
    type is visited conservatively while its own plan is being made."""
    plan = plans.get(descriptor)
    if plan is None:
        plans[descriptor] = tuple(f for f in descriptor.fields if relevant(f) or f.type == FieldDescriptor.TYPE_MESSAGE)
        plans[descriptor] = plan = tuple(
            f for f in descriptor.fields
            if relevant(f) or (f.type == FieldDescriptor.TYPE_MESSAGE and _plan(_of(f), plans, relevant)))
    return plan


_ENUM_PLANS: dict[Descriptor, tuple[FieldDescriptor, ...]] = {}
_REQUIRED_PLANS: dict[Descriptor, tuple[FieldDescriptor, ...]] = {}


def _is_enum(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_ENUM


def _is_required(field: FieldDescriptor) -> bool:
    return field in required_fields(field.containing_type)


def _sent(message: Message, field: FieldDescriptor) -> bool:
    """Whether a message-typed field holds anything to look into."""
    if field.is_repeated:
        return len(getattr(message, field.name)) > 0
    return message.HasField(field.name)


def unknown_enum_value(message: Message, path: str = "") -> str | None:
    """``"field.path: 99 is not a value of pkg.Enum"`` for the first unknown enum number, else None."""
    for field in _plan(_descriptor(message), _ENUM_PLANS, _is_enum):
        name = f"{path}.{field.name}" if path else field.name
        if field.type == FieldDescriptor.TYPE_ENUM:
            value = getattr(message, field.name)
            values = value if field.is_repeated else [value]
            for index, number in enumerate(values):
                if number not in field.enum_type.values_by_number:
                    where = f"{name}[{index}]" if field.is_repeated else name
                    known = ", ".join(v.name for v in field.enum_type.values)
                    return f"{where}: {number} is not a value of {field.enum_type.full_name} ({_short(known)})"
            continue
        if not _sent(message, field):
            continue
        value = getattr(message, field.name)
        value_field = field.message_type.fields_by_name.get("value")
        if field.message_type.GetOptions().map_entry and value_field.type == FieldDescriptor.TYPE_ENUM:
            for key, number in value.items():
                if number not in value_field.enum_type.values_by_number:
                    return (f"{name}[{_short(str(key))!r}]: {number} is not a value of "
                            f"{value_field.enum_type.full_name}")
        for sub_path, sub in _held(field, value, name):
            problem = unknown_enum_value(sub, sub_path)
            if problem:
                return problem
    return None


@functools.cache
def required_fields(descriptor: Descriptor) -> tuple[FieldDescriptor, ...]:
    """The fields of a message type the contract marks ``(google.api.field_behavior) = REQUIRED``."""
    return tuple(field for field in descriptor.fields
                 if field_behavior_pb2.REQUIRED in field.GetOptions().Extensions[field_behavior_pb2.field_behavior])


def _is_set(message: Message, field: FieldDescriptor) -> bool:
    if field.is_repeated:
        return len(getattr(message, field.name)) > 0
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message.HasField(field.name)
    return bool(getattr(message, field.name))   # "" / b"" / 0 / the enum's UNSPECIFIED are unset


def missing_required(message: Message, path: str = "") -> str | None:
    """The path of the first REQUIRED field left unset (in ``message`` or any message it holds), else None."""
    for field in required_fields(message.DESCRIPTOR):
        if not _is_set(message, field):
            return f"{path}.{field.name}" if path else field.name
    for field in _plan(_descriptor(message), _REQUIRED_PLANS, _is_required):
        if field.type == FieldDescriptor.TYPE_MESSAGE and _sent(message, field):
            name = f"{path}.{field.name}" if path else field.name
            for sub_path, sub in _held(field, getattr(message, field.name), name):
                missing = missing_required(sub, sub_path)
                if missing:
                    return missing
    return None


def decode(deserializer: Callable[[bytes], Any], data: bytes, method: str) -> Any:
    """The request message, or :class:`InvalidArgument` saying why the bytes are not one."""
    try:
        message = deserializer(data)
    except Exception as err:  # noqa: BLE001 - DecodeError, or whatever a custom deserializer raises
        raise InvalidArgument(f"{method}: the request is not a valid {_type_name(deserializer)} "
                              f"({_short(str(err)) or type(err).__name__}); nothing was changed",
                              reason=Reason.MALFORMED_REQUEST) from None
    if isinstance(message, Message):
        problem = unknown_enum_value(message)
        if problem:
            raise InvalidArgument(f"{method}: {problem}; nothing was changed", reason=Reason.UNKNOWN_ENUM_VALUE,
                                  metadata={"field": problem.split(":", 1)[0]})
    return message


def check_required(message: Any, method: str) -> Any:
    """``message``, or :class:`InvalidArgument` (``REQUIRED_FIELD_MISSING``) naming its first unset REQUIRED
    field."""
    missing = missing_required(message) if isinstance(message, Message) else None
    if missing:
        raise InvalidArgument(f"{method}: {missing} is required; nothing was changed",
                              reason=Reason.REQUIRED_FIELD_MISSING, metadata={"field": missing})
    return message
