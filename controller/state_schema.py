"""The schema of the controller's durable state: each document of the state store is a message of
``proto/rollmesh/controller/state/v1/documents.proto``, stored in the proto3 JSON mapping with the proto field
names (readable with sqlite3 or etcdctl, parseable by any language's generated classes).

The controller's components hand the store these messages (each component's ``to_document()``) and are
restored from them (``from_document()`` / ``restore()``); no dict form lies between. :meth:`DocumentSchema.encode`
refuses a message of the wrong type for its key and stamps the document with its ``schema_version``;
:meth:`DocumentSchema.decode` parses what it reads into the key's message, refusing a document its message
does not describe (edited by hand, or written by a release that drifted) and one of a newer version than this
controller knows. Documents written before the schema (no ``schema_version``) have the shape of version 1
and are read as they are.

The stored JSON is the form the controller has always written (:func:`stored_form`): every field by its proto
name, integers as JSON numbers and absent values as null, which proto3 JSON parsers accept; so a store written
by this release is read by the release before it too (a rollback finds its state).

A change to a document is a change to its message first (``buf breaking`` holds it to the FILE rules, as
it does the wire): a new field is compatible both ways; a change that is not bumps :data:`SCHEMA_VERSION`
and teaches :meth:`DocumentSchema.decode` to read the older version.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from mesh_runtime.errors import FailedPrecondition, Internal
from mesh_runtime.json_values import from_struct
from rollmesh.controller.state.v1 import documents_pb2 as state_pb2

SCHEMA_VERSION = 1
"""The version of every document this controller writes."""

EVENT = "events/"
"""The schema key of the rows of the events table (events are not documents of their own key)."""

DOCUMENTS: Mapping[str, type[Message]] = {
    "registry/node": state_pb2.NodeDocument,   # a collection: one document per node, "registry/node/<id>"
    "registry": state_pb2.RegistryDocument,    # the format before one document per node (read, then deleted)
    "scheduler": state_pb2.SchedulerDocument,
    "metrics": state_pb2.MetricsDocument,
    "events": state_pb2.EventsDocument,
    EVENT: state_pb2.Event,
    "operations": state_pb2.OperationsDocument,
    "autoscaler": state_pb2.AutoscalerDocument,
    "balancers": state_pb2.BalancersDocument,
}
"""Store key (a collection's key for its members) -> the message its documents are."""

_SHOWN = 80
"""Characters of a bad document quoted in an error."""


class UnknownDocument(Internal):
    """A component persisted a key the schema does not know (a programming error)."""


class DocumentMismatch(Internal):
    """A document the schema does not describe: written by a component that drifted, or edited by hand."""


class NewerDocument(FailedPrecondition):
    """A document written by a newer rollmesh than this one."""


class DocumentSchema:
    """Encodes, checks and decodes the store's documents by key; ``documents`` maps keys to messages."""

    def __init__(self, documents: Mapping[str, type[Message]] = DOCUMENTS) -> None:
        self.documents = dict(documents)

    def message_of(self, key: str) -> type[Message]:
        """The message of document ``key`` (a collection member: the collection's; an event row: ``events/``)."""
        found = self.documents.get(key) or self.documents.get(key.rpartition("/")[0])
        if found is None:
            raise UnknownDocument(f"state document {key[:_SHOWN]!r} has no message in the state schema; add one to "
                                  "proto/rollmesh/controller/state/v1/documents.proto and controller/state_schema.py")
        return found

    def encode(self, key: str, document: Message) -> str:
        """``document`` as stored: its JSON (proto field names) with its ``schema_version``."""
        message = self.message_of(key)
        if not isinstance(document, message):
            raise DocumentMismatch(f"state document {key[:_SHOWN]!r} must be a {message.DESCRIPTOR.full_name}, "
                                   f"not {type(document).__name__}")
        if "schema_version" in message.DESCRIPTOR.fields_by_name:   # the components hand over fresh messages
            document.schema_version = SCHEMA_VERSION   # type: ignore[attr-defined]
        return json.dumps(stored_form(document))

    def decode(self, key: str, text: str) -> Message:
        """The document of ``key`` stored as ``text``, parsed into its message."""
        message = self.message_of(key)
        try:
            document = json_format.Parse(text, message())
        except (ValueError, json_format.ParseError) as err:   # JSONDecodeError is a ValueError
            raise DocumentMismatch(
                f"state document {key[:_SHOWN]!r} is not a {message.DESCRIPTOR.full_name}: {str(err)[:200]} "
                f"(document starts {text[:_SHOWN]!r})") from err
        version = getattr(document, "schema_version", 0)
        if version > SCHEMA_VERSION:
            raise NewerDocument(f"state document {key[:_SHOWN]!r} has schema version {version}, newer than this "
                                f"controller's {SCHEMA_VERSION}: a newer rollmesh wrote the state store; run that "
                                "release or a newer one")
        return document


def stored_form(message: Message) -> dict[str, Any]:
    """``message`` as the JSON object stored: every field by its proto name; integers as numbers (proto3 JSON
    writes 64-bit ones as strings, which the release before the schema would misread); an unset message or
    optional field as null; a ``Struct`` as its object, whole numbers as integers."""
    plain: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            plain[field.name] = {key: _stored_value(value_field, item) for key, item in value.items()}
        elif field.is_repeated:
            plain[field.name] = [_stored_value(field, item) for item in value]
        elif field.has_presence and not message.HasField(field.name):
            plain[field.name] = None
        else:
            plain[field.name] = _stored_value(field, value)
    return plain


def _stored_value(field: Any, value: Any) -> Any:
    """One value of ``field`` (a field descriptor) in its stored form."""
    if field.message_type is None:
        return value   # str, int, float, bool (the state schema has no enums)
    if field.message_type.full_name == "google.protobuf.Struct":
        return from_struct(value)
    return stored_form(value)
