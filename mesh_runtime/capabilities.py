"""Which RPCs of a contract a servicer implements.

Every RPC in a server's contract must be implemented by its servicer class:
:func:`unaccounted_methods` lists those still inherited from the generated
base class (which would answer an anonymous "Method not implemented!"), and
the test suite requires that list to be empty for every server.
"""

from __future__ import annotations

from google.protobuf.descriptor import ServiceDescriptor


def unaccounted_methods(servicer: object, base: type, descriptor: ServiceDescriptor) -> list[str]:
    """RPCs of ``descriptor`` that ``servicer`` does not override from the generated ``base``."""
    missing = []
    for method in descriptor.methods:
        impl = getattr(type(servicer), method.name, None)
        if impl is None or impl is getattr(base, method.name, None):
            missing.append(method.name)
    return missing
