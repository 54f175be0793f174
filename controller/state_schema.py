"""The schema of the controller's durable state: each document of the state store is a message of
``proto/rollmesh/controller/state/v1/documents.proto``, stored in the proto3 JSON mapping with the proto field
names (readable with sqlite3 or etcdctl, parseable by any language's generated classes).

The controller's components keep handing the store plain dicts (``state_dict()``); this module is the
boundary where they meet the schema. :meth:`DocumentSchema.encode` stamps a document with its
``schema_version``; :meth:`DocumentSchema.check` (in the store's writer thread) refuses to write a document
its message does not describe, so a component that drifts from the schema fails its tests rather than
writing what the next release cannot read; :meth:`DocumentSchema.decode` checks what it reads the same way
and refuses a document of a newer version than this controller knows. Documents written before the schema
(no ``schema_version``) have the shape of version 1 and are read as they are.

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

    def encode(self, key: str, document: Mapping[str, Any]) -> str:
        """``document`` as stored: JSON with its ``schema_version``; checked by :meth:`check` when written."""
        self.message_of(key)
        return json.dumps({"schema_version": SCHEMA_VERSION, **document})

    def check(self, key: str, text: str) -> None:
        """Raise :class:`DocumentMismatch` unless ``text`` is a document of ``key``'s message."""
        self._parse(key, text)

    def decode(self, key: str, text: str) -> dict[str, Any]:
        """The document as its component wrote it (without ``schema_version``), once checked."""
        document = self._parse(key, text)
        version = document.pop("schema_version", 0)
        if version > SCHEMA_VERSION:
            raise NewerDocument(f"state document {key[:_SHOWN]!r} has schema version {version}, newer than this "
                                f"controller's {SCHEMA_VERSION}: a newer rollmesh wrote the state store; run that "
                                "release or a newer one")
        return document

    def _parse(self, key: str, text: str) -> dict[str, Any]:
        message = self.message_of(key)
        try:
            document = json.loads(text)
            if not isinstance(document, dict):
                raise ValueError(f"a JSON object is expected, not {type(document).__name__}")
            json_format.ParseDict(document, message())
        except (ValueError, json_format.ParseError) as err:   # JSONDecodeError is a ValueError
            raise DocumentMismatch(
                f"state document {key[:_SHOWN]!r} is not a {message.DESCRIPTOR.full_name}: {str(err)[:200]} "
                f"(document starts {text[:_SHOWN]!r})") from err
        return document
