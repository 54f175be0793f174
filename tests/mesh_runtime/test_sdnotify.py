"""A server run by systemd (Type=notify) tells it when it serves and when it stops."""

from __future__ import annotations

import socket

import pytest

from tests.processes import clean_env, running_server

pytestmark = pytest.mark.timeout(60)


def test_a_server_sends_ready_once_serving_and_stopping_on_sigterm(tmp_path):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(path))
        systemd.settimeout(30)
        with running_server("lb", ["--listen", "127.0.0.1:0"], log_path=tmp_path / "lb.log",
                            env=clean_env(NOTIFY_SOCKET=str(path))) as (address, _):
            ready = systemd.recv(4096).decode()
            assert ready.splitlines() == ["READY=1", f"STATUS=serving on {address}"]
        assert systemd.recv(4096).decode() == "STOPPING=1"


def test_without_notify_socket_nothing_is_sent():
    from mesh_runtime.sdnotify import notify

    assert notify("READY=1", {}) is False
    assert notify("READY=1", {"NOTIFY_SOCKET": "/nonexistent/socket"}) is False
