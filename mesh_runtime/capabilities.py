"""Explicit bookkeeping of which RPCs a server implements.

A servicer class lists the RPCs of capabilities that have not landed yet with
:func:`pending`. Each such RPC answers ``UNIMPLEMENTED`` with reason
``CAPABILITY_NOT_IMPLEMENTED`` and a message naming the capability, instead of
the generated stub's anonymous "Method not implemented!". Tests use
:func:`unaccounted_methods` to check that every RPC in the contract is either
implemented or declared pending.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from google.protobuf.descriptor import ServiceDescriptor

from .errors import Unimplemented

PENDING_ATTR = "__rollmesh_pending__"


def _pending_method(service: str, method: str, capability: str):
    async def handler(self, request, context):
        raise Unimplemented(
            f"{service}/{method} belongs to the capability '{capability}', which this server "
            "does not implement yet", metadata={"capability": capability, "method": method})
    handler.__name__ = method
    handler.__doc__ = f"Not implemented yet: part of '{capability}'."
    return handler


def pending(descriptor: ServiceDescriptor, capabilities: Mapping[str, Iterable[str]]):
    """Class decorator: make the listed RPCs answer UNIMPLEMENTED naming their capability."""
    def decorate(cls):
        marks: dict[str, str] = dict(getattr(cls, PENDING_ATTR, {}))
        for capability, methods in capabilities.items():
            for method in methods:
                if descriptor.methods_by_name.get(method) is None:
                    raise ValueError(f"{descriptor.full_name} has no RPC named {method}")
                if method in cls.__dict__:
                    raise ValueError(f"{cls.__name__}.{method} is implemented but also marked pending")
                setattr(cls, method, _pending_method(descriptor.full_name, method, capability))
                marks[method] = capability
        setattr(cls, PENDING_ATTR, marks)
        return cls
    return decorate


def pending_methods(servicer: object) -> dict[str, str]:
    """RPC name -> capability for the RPCs ``servicer`` declares not implemented yet."""
    return dict(getattr(servicer, PENDING_ATTR, {}))


def unaccounted_methods(servicer: object, base: type, descriptor: ServiceDescriptor) -> list[str]:
    """RPCs neither overridden from the generated ``base`` nor declared pending."""
    marks = pending_methods(servicer)
    missing = []
    for method in descriptor.methods:
        impl = getattr(type(servicer), method.name, None)
        if method.name in marks:
            continue
        if impl is None or impl is getattr(base, method.name, None):
            missing.append(method.name)
    return missing
