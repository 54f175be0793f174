"""One controller per etcd store (real processes, real etcd): a second controller waits, takes over when the
owner dies or shuts down, and an owner paused past its lease is fenced off and stops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from pathlib import Path

import grpc
import pytest

from controller.store_backends import parse_store
from launcher.processes import ServerProcess, start_server
from mesh_runtime.errors import error_info
from rollmesh.controller.v1 import controller_pb2, controller_pb2_grpc, events_pb2, observability_pb2, registry_pb2
from tests.etcd_server import etcd_cluster, needs_etcd
from tests.processes import clean_env
from tests.waiting import wait_until

pytestmark = [needs_etcd, pytest.mark.timeout(120)]


async def controller(tmp: Path, name: str, store: str, ttl_s: int) -> ServerProcess:
    config = tmp / f"{name}.yaml"
    config.write_text(f"store: {store}\nstore_lease_ttl_s: {ttl_s}\nnode_id: {name}\n")
    return await start_server("controller", ["--config", str(config), "--listen", "127.0.0.1:0"], env=clean_env(),
                              log_path=tmp / f"{name}.log", ready_timeout_s=90)


async def register(address: str, node: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await controller_pb2_grpc.ControllerServiceStub(channel).RegisterNode(registry_pb2.RegisterNodeRequest(
            node_id=node, address="127.0.0.1:40001", slots_total=1), timeout=10)


async def nodes(address: str) -> list[str]:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await controller_pb2_grpc.ControllerServiceStub(channel).ListNodes(registry_pb2.ListNodesRequest(),
                                                                                    timeout=10)
    return sorted(n.node_id for n in reply.nodes)


async def stop(start: asyncio.Task) -> None:
    """End a controller started in the background, whether it is still waiting for the store or serving."""
    start.cancel()   # a start still waiting kills its child (launcher.processes.start_server)
    results = await asyncio.gather(start, return_exceptions=True)
    if isinstance(results[0], ServerProcess):
        await results[0].kill()


async def history(address: str) -> list:
    """Every lifecycle event the controller holds, oldest first."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        newest = (await stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=10)).last_event_sequence
        events = []
        call = stub.WatchEvents(observability_pb2.WatchEventsRequest(include_history=True), timeout=30)
        async for message in call:
            events.append(message.event)
            if message.event.sequence >= newest:
                break
        call.cancel()
    return events


@contextlib.asynccontextmanager
async def owner_and_waiting(tmp: Path, store: str, ttl_s: int):
    """``first`` owning ``store`` and the start of ``second``, yielded once the second waits for the store;
    both ended after."""
    first = await controller(tmp, "first", store, ttl_s)
    second_start = asyncio.create_task(controller(tmp, "second", store, ttl_s))
    try:
        await wait_until(lambda: waiting(tmp / "second.log"), 60, what="the second controller to wait")
        yield first, second_start
    finally:
        await stop(second_start)
        with contextlib.suppress(ProcessLookupError):
            first.process.send_signal(signal.SIGCONT)   # a paused one must wake to be killed and reaped
        await first.kill()


def waiting(log: Path) -> bool:
    return log.exists() and "waiting to take over" in log.read_text()


def stored_nodes(store: str) -> list[str]:
    backend = parse_store(store, "")
    try:
        documents = [json.loads(v) for v in backend.load_prefix("registry/node/")]
        return sorted(d["node"]["node_id"] for d in documents if d.get("node"))
    finally:
        backend.close()


async def test_a_second_controller_waits_and_takes_over_when_the_owner_dies(tmp_path):
    with etcd_cluster(tmp_path / "etcd") as etcd:
        store = etcd.url("/owned")
        async with owner_and_waiting(tmp_path, store, ttl_s=2) as (first, second_start):
            await register(first.address, "n1")
            assert not second_start.done()   # it serves nothing while the first owns the store
            assert "owned by first at" in (tmp_path / "second.log").read_text()
            await first.kill()   # kill -9: its lease runs out in 2 s
            second = await asyncio.wait_for(second_start, 60)
            assert await nodes(second.address) == ["n1"]   # what the first acknowledged
            changes = [e for e in await history(second.address) if e.type == events_pb2.EVENT_TYPE_LEADER_CHANGED]
            assert [(e.from_state.split(" at ")[0], e.to_state.split(" at ")[0]) for e in changes] == [
                ("", "first"), ("first", "second")]   # both takeovers, in the one event log of the store
            assert changes[-1].details["waited_s"] > 0 and changes[-1].details["fence_revision"] > 0
            await register(second.address, "n2")
            assert stored_nodes(store) == ["n1", "n2"]
            await second.terminate()


async def test_a_clean_shutdown_hands_the_store_over_without_waiting_out_the_lease(tmp_path):
    with etcd_cluster(tmp_path / "etcd") as etcd:
        store = etcd.url("/handover")
        # a 300 s lease, which no test would wait out
        async with owner_and_waiting(tmp_path, store, ttl_s=300) as (first, second_start):
            assert await first.terminate() == 0   # SIGTERM: it revokes its lease on the way out
            second = await asyncio.wait_for(second_start, 60)
            assert await nodes(second.address) == []
            await second.terminate()


async def test_an_owner_paused_past_its_lease_cannot_write_and_stops(tmp_path):
    with etcd_cluster(tmp_path / "etcd") as etcd:
        store = etcd.url("/fenced")
        async with owner_and_waiting(tmp_path, store, ttl_s=2) as (first, second_start):
            await register(first.address, "n1")
            first.process.send_signal(signal.SIGSTOP)   # frozen past its lease: the second takes over
            second = await asyncio.wait_for(second_start, 60)
            await register(second.address, "n2")
            first.process.send_signal(signal.SIGCONT)   # it wakes up believing it still owns the store
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await register(first.address, "intruder")
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            detail = error_info(info.value)   # fenced (or, if its renewal noticed first, already gone)
            assert detail is None or detail.reason == "STORE_FENCED"
            assert await asyncio.wait_for(first.process.wait(), 30) == 3   # it stops by itself
            assert "lost the state store" in (tmp_path / "first.log").read_text()
            assert stored_nodes(store) == ["n1", "n2"]   # nothing of the deposed owner landed
            assert await nodes(second.address) == ["n1", "n2"]
            await second.terminate()


def running_with(argument: str) -> list[int]:
    """Pids of the live processes whose command line holds ``argument``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and argument in (proc / "cmdline").read_bytes().decode(errors="replace") \
                    and (proc / "stat").read_text().split(") ")[-1].split()[0] != "Z":
                found.append(int(proc.name))
        except OSError:
            continue
    return found


async def test_a_start_given_up_on_leaves_no_waiting_controller_behind(tmp_path):
    with etcd_cluster(tmp_path / "etcd") as etcd:
        store = etcd.url("/abandoned")
        async with owner_and_waiting(tmp_path, store, ttl_s=60) as (_, start):
            assert running_with(str(tmp_path / "second.yaml"))   # it is there, waiting for the store
            start.cancel()
            with pytest.raises(asyncio.CancelledError):
                await start
            assert running_with(str(tmp_path / "second.yaml")) == []   # and gone with the start that gave up


def test_the_fence_refuses_every_write_of_a_deposed_owner(tmp_path):
    from controller.store_backends import StoreFenced
    from controller.store_owner import StoreOwnership

    with etcd_cluster(tmp_path / "etcd") as etcd:
        lost: list[str] = []
        old_backend, new_backend = parse_store(etcd.url("/fence"), ""), parse_store(etcd.url("/fence"), "")
        old = StoreOwnership(old_backend, owner="old", ttl_s=60, on_lost=lost.append)
        old_backend.on_fenced = old.lose
        old.acquire()
        old_backend.write([("doc", '"old"')], [], [])
        old._stop.set()                  # frozen: it renews nothing more ...
        old._revoke(old._lease_id)       # ... and its lease runs out (at once here, instead of after 60 s)
        new = StoreOwnership(new_backend, owner="new", ttl_s=60, on_lost=lost.append)
        new.acquire(deadline_s=10)
        new_backend.write([("doc", '"new"')], [], [])
        with pytest.raises(StoreFenced) as info:   # the old owner wakes up and writes: nothing lands
            old_backend.write([("doc", '"stale"'), ("other", '"stale"')], [], [(1, '"stale event"')])
        assert "no longer owns the state store" in str(info.value)
        assert lost == ["a write was fenced off"]   # and it is told it lost the store
        assert new_backend.load("doc") == '"new"' and new_backend.load("other") is None
        assert new_backend.load_events(10) == []
        assert new.holder() == "new"
        new.release()
        assert new.holder() == ""
        old_backend.close()
        new_backend.close()


async def test_owning_the_store_is_a_span_and_an_event(tmp_path):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from controller.config import ControllerConfig
    from controller.core.events import EventType
    from controller.mesh import Mesh
    from mesh_runtime.config import load_config

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with etcd_cluster(tmp_path / "etcd") as etcd:
        config = load_config(ControllerConfig, None, overrides={"store": etcd.url("/traced"), "node_id": "solo"})
        mesh = Mesh(config, provider, on_store_lost=lambda why: None)
        try:
            span = next(s for s in exporter.get_finished_spans() if s.name == "store.acquire")
            assert span.attributes["rollmesh.store"] == etcd.url("/traced")
            assert span.attributes["rollmesh.owner"].startswith("solo at ")
            changed = [e for e in mesh.events.since(0)[0] if e.type is EventType.LEADER_CHANGED]
            assert len(changed) == 1 and changed[0].from_state == "" and changed[0].to_state.startswith("solo")
        finally:
            await mesh.close()
