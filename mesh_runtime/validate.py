"""Input checks every server applies the same way: ids, addresses, numbers; errors quote a short prefix.

Each check raises :class:`~mesh_runtime.errors.InvalidArgument` naming the
field and what is allowed, quoting at most :data:`QUOTE_LIMIT` characters of
the bad value, and changes nothing. Ids are what the mesh names nodes and
replicas by: 1 to :data:`ID_MAX_LENGTH` characters, starting with a letter or
digit, then letters, digits and ``. _ - : / @ #``.
"""

from __future__ import annotations

import math
import re

from .errors import InvalidArgument
from .net import AddressError, is_loopback, is_wildcard, parse_host_port, peer_host
from .reasons import Reason

ID_MAX_LENGTH = 128
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@#-]*")
QUOTE_LIMIT = 100


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr`` of ``value``, cut to ``limit`` characters with the full length said when longer."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def check_id(value: str, field: str) -> None:
    """A node, replica or operation id: see the module docstring."""
    if not value:
        raise InvalidArgument(f"{field} must not be empty", reason=Reason.INVALID_ID, metadata={"field": field})
    if len(value) > ID_MAX_LENGTH or not ID_PATTERN.fullmatch(value):
        raise InvalidArgument(f"{field} must be 1-{ID_MAX_LENGTH} characters: a letter or digit, then letters, "
                              f"digits and . _ - : / @ #; got {quote(value)}", reason=Reason.INVALID_ID,
                              metadata={"field": field})


SESSION_ID_MAX_LENGTH = 256


def check_session_id(value: str, field: str, *, required: bool = True) -> None:
    """A session id (any text): present where ``required``, at most 256 characters."""
    if (required and not value) or len(value) > SESSION_ID_MAX_LENGTH:
        raise InvalidArgument(f"{field} must be 1-{SESSION_ID_MAX_LENGTH} characters, got {quote(value)}",
                              reason=Reason.INVALID_SESSION_ID, metadata={"field": field})


def check_address(value: str, field: str) -> None:
    """``HOST:PORT`` with a port in 1..65535."""
    try:
        parse_host_port(value, allow_zero_port=False)
    except (AddressError, ValueError) as err:
        raise InvalidArgument(f"{field} must be HOST:PORT, got {quote(value)} ({err})", reason=Reason.INVALID_ADDRESS,
                              metadata={"field": field}) from None


def is_engine_url(value: str) -> bool:
    """Whether ``value`` names an engine server by URL (``http://`` or ``https://``) rather than an agent."""
    return value.startswith(("http://", "https://"))


def check_engine_url(value: str, field: str) -> None:
    """``http(s)://HOST:PORT`` (an optional trailing slash), the URL of a running engine server."""
    scheme, _, rest = value.partition("://")
    rest = rest.removesuffix("/")
    try:
        if scheme not in ("http", "https") or "/" in rest:
            raise AddressError("expected http(s)://HOST:PORT")
        parse_host_port(rest, allow_zero_port=False)
    except (AddressError, ValueError) as err:
        raise InvalidArgument(f"{field} must be http://HOST:PORT, got {quote(value)} ({err})",
                              reason=Reason.INVALID_ENGINE_URL, metadata={"field": field}) from None


def check_number(value: float, field: str, *, low: float | None = None, high: float | None = None) -> None:
    """A finite number in ``[low, high]`` (either bound optional)."""
    if not math.isfinite(value):
        raise InvalidArgument(f"{field} must be a finite number, got {value}", reason=Reason.INVALID_NUMBER,
                              metadata={"field": field})
    if (low is not None and value < low) or (high is not None and value > high):
        raise InvalidArgument(f"{field} must be in [{'-inf' if low is None else low}, "
                              f"{'inf' if high is None else high}], got {value}", reason=Reason.INVALID_NUMBER,
                              metadata={"field": field})


def check_reachable(address: str, peer: str, who: str) -> None:
    """INVALID_ARGUMENT when ``address``, which ``who`` advertises for others to connect to, cannot be
    reached: a wildcard host, or a loopback host advertised by a caller on another machine (``peer``,
    the gRPC peer of the call, is not loopback). A malformed address is left to :func:`check_address`."""
    try:
        host, _ = parse_host_port(address)
    except (AddressError, ValueError):
        return
    if is_wildcard(host):
        raise InvalidArgument(f"{who} advertises {quote(address)}: a wildcard host is an address to listen on, "
                              "not to connect to; set its advertise_address to the address others reach it at",
                              reason=Reason.UNREACHABLE_ADDRESS, metadata={"address": address[:64]})
    caller = peer_host(peer)
    if is_loopback(host) and caller and not is_loopback(caller):
        raise InvalidArgument(f"{who} advertises {quote(address)}, a loopback address, but calls from {caller}: "
                              "other machines cannot reach it there; set its advertise_address",
                              reason=Reason.LOOPBACK_ADVERTISED, metadata={"address": address[:64], "peer": caller})
