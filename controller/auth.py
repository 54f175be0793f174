"""The credential that mutating scale RPCs require (known weakness 20: an unauthenticated scale API).

With ``scale_api_token`` (or ``scale_api_read_tokens``) configured, ScaleOut,
ScaleIn, CancelOperation, CancelOperations and SetAutoscalerEnabled need the
call metadata ``authorization: Bearer TOKEN``: no or an unknown credential ->
UNAUTHENTICATED; a read-only credential -> PERMISSION_DENIED. Tokens are
compared in constant time. Read-only RPCs need no credential.

On a server with mutual TLS (:mod:`mesh_runtime.authorization`), an operator
certificate allows these RPCs without a token, and the token lets a caller
with any other mesh certificate call them; a replica agent acts only for the
node its certificate names (:func:`require_own_node`).
"""

from __future__ import annotations

import hmac

import grpc

from mesh_runtime.errors import PermissionDenied, Unauthenticated
from mesh_runtime.identity import current_identity
from mesh_runtime.reasons import Reason

from .config import ControllerConfig


def _same(a: str, b: str) -> bool:
    return bool(b) and hmac.compare_digest(a.encode(), b.encode())


def _authorization(context: grpc.aio.ServicerContext) -> str:
    """The call's ``authorization`` metadata value ("" without one)."""
    metadata = {k.lower(): v for k, v in (context.invocation_metadata() or ())}
    value = metadata.get("authorization", "")
    return value if isinstance(value, str) else ""   # (bytes only for "-bin" keys)


def has_scale_token(context: grpc.aio.ServicerContext, config: ControllerConfig) -> bool:
    """Whether the call carries ``scale_api_token`` as a bearer token (the operator's alternative to an
    operator certificate on a server with mutual TLS)."""
    scheme, _, token = _authorization(context).partition(" ")
    return scheme.lower() == "bearer" and _same(token.strip(), config.scale_api_token)


def require_own_node(node_id: str, method: str) -> None:
    """A replica agent may register, report and deregister only the node its certificate names."""
    identity = current_identity()
    if identity is not None and identity.role == "replica-agent" and identity.name != node_id:
        raise PermissionDenied(f"{method}: {identity} may act only for node {identity.name!r}, "
                               f"not {node_id[:64]!r}", reason=Reason.NOT_YOUR_NODE)


def require_scale_credential(context: grpc.aio.ServicerContext, config: ControllerConfig, method: str) -> None:
    """Raise unless the call carries the credential that may change the mesh (no-op when none is configured,
    and for a caller whose certificate says it is an operator)."""
    identity = current_identity()
    if identity is not None and identity.role == "operator":
        return
    if not config.scale_api_token and not config.scale_api_read_tokens:
        return
    value = _authorization(context)
    if not value:
        raise Unauthenticated(f"{method} changes the mesh and needs a credential: send the metadata "
                              "'authorization: Bearer TOKEN'", reason=Reason.CREDENTIAL_MISSING)
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("the authorization metadata must be 'Bearer TOKEN'", reason=Reason.MALFORMED_CREDENTIAL)
    token = token.strip()
    if _same(token, config.scale_api_token):
        return
    if any(_same(token, t) for t in config.scale_api_read_tokens):
        raise PermissionDenied(f"this credential is read-only and may not call {method}",
                               reason=Reason.READ_ONLY_CREDENTIAL)
    raise Unauthenticated("the credential is not valid for this controller", reason=Reason.INVALID_CREDENTIAL)
