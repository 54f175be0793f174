"""``rollmesh top`` against a real controller and agent: driven in a pseudo-terminal, and ``--once``."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from launcher.top import Snapshot, render
from tests.processes import clean_env, running_server

pytestmark = pytest.mark.timeout(180)

AGENT = """node_id: n1
slots: 2
backend: synthetic
controller_address: {controller}
engine_options: {{tokens_per_second: 40}}
replicas:
  - {{replica_id: top-s0, kind: STANDALONE}}
  - {{replica_id: top-h0, kind: HYBRID}}
"""


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("top")
    (tmp / "autoscaler.yaml").write_text("enabled: false\nmin_engines: 1\nmax_engines: 3\n")
    (tmp / "controller.yaml").write_text(f"state_dir: {tmp / 'state'}\nload_report_interval_s: 0.2\n"
                                         f"autoscaler_config: {tmp / 'autoscaler.yaml'}\n")
    with running_server("controller", ["--config", str(tmp / "controller.yaml"), "--listen", "127.0.0.1:0"],
                        log_path=tmp / "controller.log") as (address, _):
        (tmp / "agent.yaml").write_text(AGENT.format(controller=address))
        with running_server("replica-agent", ["--config", str(tmp / "agent.yaml"), "--listen", "127.0.0.1:0"],
                            log_path=tmp / "agent.log"):
            _wait_registered(address)
            yield address


def _top(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", "top", *args], capture_output=True,
                          text=True, env=clean_env(), timeout=60, **kw)


def _wait_registered(address: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = _top(address, "--once").stdout
        if "top-s0" in out and "top-h0" in out:
            return
        time.sleep(0.3)
    raise AssertionError("the agent's replicas never showed up")


def test_once_prints_replicas_scheduler_and_sections(controller):
    result = _top(controller, "--once")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"rollmesh top - controller {controller}")
    s0 = next(line for line in lines if line.startswith("top-s0"))
    h0 = next(line for line in lines if line.startswith("top-h0"))
    assert s0.split()[1:3] == ["standalone", "ACTIVE"]
    assert h0.split()[1:3] == ["hybrid", "SLEEPING"]
    assert any(line.startswith("scheduler ") for line in lines)
    auto = lines.index(next(line for line in lines if line.startswith("autoscaler:")))
    assert lines[auto].startswith("autoscaler: disabled   engines 1 (min 1, max 3)")
    block = lines[auto + 1:lines.index("", auto)]
    conditions = [line[4:].split()[0] for line in block if line[:4] in ("    ", "  * ")]
    assert len(conditions) >= 4, lines  # the reference's scale-out and scale-in conditions
    assert "recent operations:" in lines and "  (none)" in lines


def test_pseudo_terminal_shows_replicas_refreshes_and_quits_on_q(controller):
    leader, follower = pty.openpty()
    env = clean_env(TERM="xterm", LINES="40", COLUMNS="140")
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "top", controller, "--interval", "60"],
                            stdin=follower, stdout=follower, stderr=follower, env=env, start_new_session=True)
    os.close(follower)
    try:
        screen = _read_until(leader, b"top-h0", timeout_s=60)
        assert b"top-s0" in screen and b"REPLICA" in screen
        os.write(leader, b"r")  # refresh now (long before the 60 s interval): the whole screen is drawn again
        assert b"rollmesh top" in _read_until(leader, b"top-h0", timeout_s=30)
        os.write(leader, b"q")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)


def _read_until(fd: int, needle: bytes, timeout_s: float) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout_s
    while needle not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{needle!r} not shown; screen so far: {seen[-2000:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:
                break
    return seen


def test_unreachable_controller_is_shown_not_raised():
    lines = render(Snapshot(address="127.0.0.1:1", taken_at=0.0, errors={"status": "UNAVAILABLE: refused"}))
    assert lines[1] == "controller unreachable: UNAVAILABLE: refused"
    result = _top("127.0.0.1:1", "--once", "--timeout", "0.5")
    assert result.returncode == 1
    assert "controller unreachable: UNAVAILABLE" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["not-an-address", "--once"], "address"),
    (["127.0.0.1:5", "--interval", "0"], "must be > 0"),
    (["127.0.0.1:5", "--interval", "x"], "is not a number"),
])
def test_bad_arguments_exit_2_naming_them(args, message):
    result = _top(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_balancers_are_shown_with_those_clients_are_not_sent_to():
    from rollmesh.controller.v1 import controller_pb2, registry_pb2  # noqa: PLC0415

    balancers = [registry_pb2.BalancerRecord(balancer_id="lb-1", lease_held=True, routing_ready=True),
                 registry_pb2.BalancerRecord(balancer_id="lb-2", lease_held=True, routing_ready=False)]
    lines = render(Snapshot(address="127.0.0.1:1", taken_at=0.0, status=controller_pb2.GetStatusResponse(),
                            balancers=balancers))
    assert "balancers lb-1   lb-2 NOT READY" in lines
    assert not any(line.startswith("balancers") for line in render(Snapshot(
        address="127.0.0.1:1", taken_at=0.0, status=controller_pb2.GetStatusResponse(), balancers=[])))
