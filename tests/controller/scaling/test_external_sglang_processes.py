"""External scale-out of running SGLang servers given by URL, as the elastic-scaling reference describes.

A replica agent of the sglang backend (registered with the controller, no
replica of its own) attaches one replica per URL; the balancer routes them;
scale-in by URL stops the replica and leaves the server running. The SGLang
servers are the fake of tests/engines/fake_sglang.py, as processes.
"""

from __future__ import annotations

import grpc
import pytest

from rollmesh.common.v1 import types_pb2
from rollmesh.controller.v1 import scaling_pb2
from tests.controller.scaling.helpers import scale_in, scale_out
from tests.controller.scaling.helpers import (
    Procs, agent_states, controller_stub, event_states, finished, generate, lb_stub, replicas, routed, until)
from tests.engines.fake_sglang import FakeSglangProcess, write_model

pytestmark = pytest.mark.timeout(240)
CONTROLLER = """load_balancer_address: {lb}
lease_ttl_s: 3
load_report_interval_s: 0.2
state_dir: {state}
"""
SGLANG_AGENT = """node_id: s
slots: 1
backend: sglang
model: {model}
controller_address: {controller}
engine_options: {{weight_backend: gloo, metrics_interval_s: 0.2}}
"""


async def test_scale_out_attaches_sglang_servers_by_url_and_scale_in_detaches_them(tmp_path):
    model = write_model(tmp_path / "model", {"lm_head.weight": (32, 8)})
    servers = [FakeSglangProcess(model), FakeSglangProcess(model)]
    procs = Procs(tmp_path)
    try:
        lb = procs.start("lb", "lb", "")
        ctl_addr = procs.start("controller", "controller", CONTROLLER.format(lb=lb, state=tmp_path / "state"))
        agent = procs.start("s", "replica-agent", SGLANG_AGENT.format(model=model, controller=ctl_addr))
        async with grpc.aio.insecure_channel(ctl_addr) as cch, grpc.aio.insecure_channel(lb) as lch:
            ctl, bal = controller_stub(cch), lb_stub(lch)
            await until(lambda: _registered(ctl), 60, what="the sglang agent to register")
            urls = [s.url for s in servers]

            op = await scale_out(ctl, engine_addresses=urls)
            op = await finished(ctl, op.operation_id)
            assert op.state == scaling_pb2.OPERATION_STATE_ACTIVE, op.error_message
            assert await event_states(ctl, op.operation_id) == [
                "PENDING", "CONNECTING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "READY", "ACTIVE"]
            records = {r.engine_url: r for r in (await replicas(ctl)).values()}
            assert sorted(records) == sorted(urls)
            assert all(r.node_id == "s" and list(r.slots) == [] for r in records.values())
            routed_ids = sorted(r.replica_id for r in records.values())
            assert sorted(await routed(bal)) == routed_ids

            finals = [await generate(bal, f"g{i}", 6) for i in range(6)]
            assert all(f.usage.completion_tokens == 6 and f.replica_id in routed_ids for f in finals)
            assert sum(s.state()["generated"] for s in servers) == 6

            # A URL already attached is skipped; a URL that is not http://HOST:PORT is refused.
            again = await scale_out(ctl, engine_addresses=[urls[0]])
            assert again.state == scaling_pb2.OPERATION_STATE_NOOP
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await scale_out(ctl, engine_addresses=["http://nohost"])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "http://HOST:PORT" in info.value.details()
            # No sglang agent serves that model: FAILED, saying so.
            op = await finished(ctl, (await scale_out(ctl, 
                model_name="other", engine_addresses=["http://127.0.0.1:9"])).operation_id)
            assert op.state == scaling_pb2.OPERATION_STATE_FAILED and "sglang backend" in op.error_message

            # Scale-in by URL: the replica stops, the server keeps running.
            gone = records[urls[0]].replica_id
            op = await scale_in(ctl, engine_addresses=[urls[0]])
            assert list(op.replica_ids) == [gone]
            op = await finished(ctl, op.operation_id)
            assert op.state == scaling_pb2.OPERATION_STATE_COMPLETED
            assert (await agent_states(agent))[gone] == types_pb2.REPLICA_STATE_STOPPED
            assert await routed(bal) == [records[urls[1]].replica_id]
            assert servers[0].process.poll() is None and servers[0].state()["running"] == []
    finally:
        procs.close()
        for server in servers:
            server.stop()


async def _registered(ctl) -> bool:
    from rollmesh.controller.v1 import registry_pb2

    nodes = (await ctl.ListNodes(registry_pb2.ListNodesRequest())).nodes
    return any(n.node_id == "s" for n in nodes)
