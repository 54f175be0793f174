"""systemd's readiness protocol (``sd_notify``): a ``Type=notify`` unit knows when a server is serving.

Under systemd with ``Type=notify`` the variable ``NOTIFY_SOCKET`` names a
Unix datagram socket (a path, or ``@name`` in the abstract namespace); a
server sends ``READY=1`` once it serves and ``STOPPING=1`` when it begins to
shut down. Without the variable nothing is sent.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


def notify(state: str, env: Mapping[str, str]) -> bool:
    """Send ``state`` (``KEY=VALUE`` lines) to systemd; False when not run under it or the send failed."""
    address = env.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as err:
        log.warning("could not notify systemd at %s: %s", env.get("NOTIFY_SOCKET"), err)
        return False
    return True
