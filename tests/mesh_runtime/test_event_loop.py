"""Server processes run on uvloop (or the standard loop when asked), with the collector set for a server."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest
import uvloop

from launcher.cli import main
from mesh_runtime import event_loop


@pytest.fixture
def collector():
    """Give the test process its collector back as it was."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_servers_run_on_uvloop_with_the_collector_tuned(collector):
    assert event_loop.run(_loop_type(), {}) is uvloop.Loop
    assert gc.get_threshold() == event_loop.GC_THRESHOLDS and gc.get_freeze_count() > 0


def test_the_standard_loop_when_asked(collector):
    chosen = event_loop.run(_loop_type(), {"ROLLMESH_EVENT_LOOP": "asyncio"})
    assert chosen is not uvloop.Loop and issubclass(chosen, asyncio.AbstractEventLoop)


def test_an_unknown_loop_is_refused_naming_the_variable(collector, monkeypatch, capsys):
    coroutine = _loop_type()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the coroutine is closed, not left "never awaited"
        with pytest.raises(ValueError, match=r"ROLLMESH_EVENT_LOOP must be one of uvloop, asyncio, got 'trio'"):
            event_loop.run(coroutine, {"ROLLMESH_EVENT_LOOP": "trio"})
    assert coroutine.cr_frame is None
    monkeypatch.setenv("ROLLMESH_EVENT_LOOP", "tokio-for-python-please")
    assert main(["lb", "--listen", "127.0.0.1:0"]) == 2   # refused before anything starts
    assert "rollmesh lb: error: ROLLMESH_EVENT_LOOP must be one of uvloop, asyncio, got 'tokio-for-python-ple'" in (
        capsys.readouterr().err)
