"""Parsing and formatting of ``HOST:PORT`` addresses (IPv4, ``[IPv6]``, names)."""

from __future__ import annotations

import ipaddress
import socket


class AddressError(ValueError):
    """An address string is not of the form HOST:PORT."""


def parse_host_port(text: str, *, allow_zero_port: bool = True) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:50051`` for IPv6) into host and port."""
    if not isinstance(text, str) or not text.strip():
        raise AddressError("expected HOST:PORT, got an empty string")
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise AddressError(f"expected [IPV6]:PORT, got {text!r}")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(f"{host!r} is not an IPv6 address in {text!r}") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise AddressError(f"expected HOST:PORT, got {text!r}")
        if ":" in host:
            raise AddressError(f"IPv6 hosts must be bracketed, as in [::1]:PORT; got {text!r}")
    if not port_text.isdigit():
        raise AddressError(f"port must be a number, got {port_text!r} in {text!r}")
    port = int(port_text)
    low = 0 if allow_zero_port else 1
    if not low <= port <= 65535:
        raise AddressError(f"port must be in {low}..65535, got {port} in {text!r}")
    return host, port


def format_host_port(host: str, port: int) -> str:
    """Join a host and port, bracketing IPv6 literals."""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means "every interface" (``0.0.0.0``, ``::``): bindable, not connectable."""
    return host in ("", "0.0.0.0", "::", "[::]")


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:10.0.0.3:41000``, ``ipv6:[::1]:5``; '' for others)."""
    family, _, rest = (peer or "").partition(":")
    if family not in ("ipv4", "ipv6"):
        return ""
    try:
        return parse_host_port(rest)[0]
    except AddressError:
        return ""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) is reachable only from this machine."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for a listener that must be named before it binds)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
