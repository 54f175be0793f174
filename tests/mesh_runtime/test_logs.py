"""Server log lines: JSON or text, with the trace and span ids of the span they were emitted in."""

from __future__ import annotations

import io
import json
import logging
import subprocess

import pytest
from opentelemetry.sdk.trace import TracerProvider

from controller.core.events import EventLog, EventType, log_event
from mesh_runtime import logs
from launcher.processes import server_command
from tests.processes import clean_env, running_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def captured():
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)

    def use(fmt: str) -> io.StringIO:
        logs.configure("lb", level="INFO", fmt=fmt, stream=stream)
        return stream

    yield use
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in saved[0]:
        root.addHandler(handler)
    root.setLevel(saved[1])


def test_a_json_line_carries_the_current_span_and_the_calls_fields(captured):
    stream = captured("json")
    tracer = TracerProvider().get_tracer("test")
    log = logging.getLogger("loadbalancer.balancer")
    with tracer.start_as_current_span("lb.attempt") as span:
        log.info("request %s: try %d", "r1", 2, extra={"request_id": "r1", "replica_id": "a"})
    log.warning("outside any span")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    first, second, third = (json.loads(line) for line in stream.getvalue().splitlines())
    context = span.get_span_context()
    assert first["message"] == "request r1: try 2" and first["level"] == "INFO" and first["server"] == "lb"
    assert first["logger"] == "loadbalancer.balancer" and first["time"].endswith("Z")
    assert (first["trace_id"], first["span_id"]) == (format(context.trace_id, "032x"), format(context.span_id, "016x"))
    assert (first["request_id"], first["replica_id"]) == ("r1", "a")
    assert "trace_id" not in second and second["level"] == "WARNING"
    assert "RuntimeError: boom" in third["exception"]


def test_a_text_line_ends_with_the_trace_ids_inside_a_span_only(captured):
    stream = captured("text")
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("x") as span:
        logging.getLogger("t").info("inside", extra={"replica_id": "a"})
    logging.getLogger("t").info("outside")
    inside, outside = stream.getvalue().splitlines()
    assert inside.endswith(f"lb INFO t: inside trace_id={format(span.get_span_context().trace_id, '032x')} "
                           f"span_id={format(span.get_span_context().span_id, '016x')}")
    assert outside.endswith("lb INFO t: outside")


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="text, json"):
        logs.configure("lb", fmt="xml")


def test_each_lifecycle_event_is_one_line_at_info_and_losses_at_warning(caplog):
    events = EventLog(lambda: 1.0, max_events=10)
    log = logging.getLogger("controller.mesh")
    with caplog.at_level(logging.INFO, logger="controller.mesh"):
        log_event(events.append(EventType.REPLICA_STATE_CHANGED, replica_id="h0", node_id="n0",
                                from_state="REPLICA_STATE_SLEEPING", to_state="REPLICA_STATE_SYNCING",
                                reason="weight sync to version 3 before activation", weight_version=3), log)
        log_event(events.append(EventType.LEASE_EXPIRED, node_id="n1", reason="no load report for 10 s"), log)
        log_event(events.append(EventType.REPLICA_STATE_CHANGED, replica_id="s0", to_state="REPLICA_STATE_FAILED",
                                reason="engine died"), log)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "REPLICA_STATE_CHANGED replica h0 SLEEPING -> SYNCING: weight sync to version 3 before activation"),
        ("WARNING", "LEASE_EXPIRED node n1: no load report for 10 s"),
        ("WARNING", "REPLICA_STATE_CHANGED replica s0 -> FAILED: engine died")]
    assert caplog.records[0].weight_version == 3 and caplog.records[0].event_type == "REPLICA_STATE_CHANGED"


def test_a_server_started_with_log_format_json_writes_only_json_lines(tmp_path):
    log_path = tmp_path / "lb.log"
    with running_server("lb", ["--listen", "127.0.0.1:0", "--log-format", "json"], log_path=log_path):
        pass
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert lines and all(line["server"] == "lb" for line in lines)
    assert any("shutdown requested" in line["message"] for line in lines)


def test_a_bad_log_format_in_the_environment_exits_2_naming_it(tmp_path):
    done = subprocess.run(server_command("lb", ["--listen", "127.0.0.1:0"]), capture_output=True, text=True,
                          env=clean_env(ROLLMESH_LOG_FORMAT="yaml"), timeout=60)
    assert done.returncode == 2 and "ROLLMESH_LOG_FORMAT must be one of text, json, got 'yaml'" in done.stderr
