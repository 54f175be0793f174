"""The main job across network namespaces, with partitions while it trains.

Run inside the operator's namespace (``python -m tests.multihost.job SPEC``,
``SPEC`` a JSON file written by the test): it is ``rollmesh train``'s own
:class:`~launcher.train_job.TrainJob` with every process placed on its host,
configured as a deployment would be (the inference nodes listen on every
interface and advertise their own address; mutual TLS with certificates for
each host's address). With ``faults`` it cuts, while training runs,

1. the balancer from inference node 0 (its requests must resume on the other
   nodes; after the heal its replicas return to routing), then
2. inference node 1 from the controller (its lease must expire and its
   replicas leave routing; after the heal they come back, with current
   weights, without an operator), then
3. makes the weight path from the trainer to inference node 0 slow and
   lossy,

then ends training after the step it is in (StopTraining, as a first Ctrl-C
of ``rollmesh train`` does: the job's step count is only a ceiling, so the
test's length is the partitions', not a guess of how many steps outlast
them),

and writes what it saw to ``RUN_DIR/multihost.json``. Exit code: the job's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from launcher.job_config import load_job_config
from launcher.train_job import TrainJob
from mesh_runtime.channels import open_channel
from rollmesh.controller.v1 import controller_pb2_grpc, registry_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc
from tests.multihost.netns import Network

AGENT_PORT = 50053


class MultiHostJob(TrainJob):
    def __init__(self, *args, network: Network, placement: dict[str, str], faults: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.network = network
        self.placement = placement
        self.faults = faults
        self.record: dict[str, Any] = {"phases": [], "placement": placement}
        self._plan: asyncio.Task | None = None

    def host_of(self, name: str) -> str:
        return self.network.addresses[self.placement[name] if name != "launcher" else "operator"]

    def prefix_of(self, name: str) -> list[str]:
        return self.network.prefix(self.placement[name])

    async def _start(self, name: str, server: str, config: dict[str, Any] | None, env: dict[str, str]) -> None:
        if config is not None and name.startswith("rollout-"):
            # a node agent as deployed: every interface, and the address the others reach it at
            config = {**config, "listen": f"0.0.0.0:{AGENT_PORT}",
                      "advertise_address": f"{self.host_of(name)}:{AGENT_PORT}"}
        if config is not None and name == "lb":
            config = {**config, "stall_timeout_s": 3.0}   # a silent (partitioned) attempt moves on after 3 s
        await super()._start(name, server, config, env)

    async def _start_mesh(self, env: dict[str, str]) -> dict[str, dict]:
        configs = await super()._start_mesh(env)
        if self.faults:
            self._plan = asyncio.create_task(self._partitions(), name="partitions")
        return configs

    async def _follow_training(self, trainer):
        progress = await super()._follow_training(trainer)
        if self._plan is not None:
            if not self._plan.done():
                self._plan.cancel()
                self.record["error"] = "training reached its step ceiling before the partitions were done"
            else:
                error = self._plan.exception()
                if error is not None:
                    self.record["error"] = f"{type(error).__name__}: {error}"
        self.record["progress"] = {k: int(progress[k]) for k in ("global_step", "weight_version") if k in progress}
        await self._final_state()
        return progress

    # -- the partitions -------------------------------------------------------------------------------

    def _channels(self):
        tls = self._client_tls()
        return (open_channel(self.processes["controller"].address, tls=tls),
                open_channel(self.processes["lb"].address, tls=tls))

    async def _until(self, what: str, check, timeout_s: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if await check():
                return time.monotonic() - started
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{what}: not within {timeout_s:g} s")

    async def _partitions(self) -> None:
        ctl_channel, lb_channel = self._channels()
        controller = controller_pb2_grpc.ControllerServiceStub(ctl_channel)
        lb = loadbalancer_pb2_grpc.LoadBalancerServiceStub(lb_channel)

        async def every_replica() -> list:
            return list((await controller.ListReplicas(registry_pb2.ListReplicasRequest(), timeout=10)).replicas)

        async def replicas_of(node: str) -> list:
            return [r for r in await every_replica() if r.node_id == node]

        async def routed(node: str) -> set[str]:
            reply = await lb.ListReplicas(loadbalancer_pb2.ListReplicasRequest(routable_only=True), timeout=10)
            return {r.endpoint.replica_id for r in reply.replicas if r.endpoint.node_id == node}

        async def stats():
            return (await lb.GetStats(loadbalancer_pb2.GetStatsRequest(), timeout=10)).stats

        try:
            await self._until("mesh serving", lambda: self._serving(routed), 120)
            # 1. the balancer cannot reach inference node 0
            before = await stats()
            self.network.cut("lb", self.placement["rollout-0"])
            await asyncio.sleep(6)
            during = await stats()
            self.network.heal("lb", self.placement["rollout-0"])
            node0 = {r.replica_id for r in await replicas_of("rollout-0")}
            back = await self._until("node 0 back in routing", lambda: _contains(routed("rollout-0"), node0), 60)
            self.record["phases"].append({
                "cut": "lb|rollout-0", "retries": during.retries - before.retries,
                "resumes": during.resumes - before.resumes, "ejections": during.outlier_ejections
                - before.outlier_ejections, "failed": during.failed - before.failed,
                "back_in_routing_s": round(back, 2)})
            # 2. inference node 1 cannot reach the controller
            node1 = {r.replica_id for r in await replicas_of("rollout-1")}
            self.network.cut("controller", self.placement["rollout-1"])
            cut_at = time.monotonic()

            async def out() -> bool:
                states = {r.replica_id: r.state for r in await replicas_of("rollout-1")}
                return not (await routed("rollout-1")) and all(states.get(r) != 4 for r in node1)   # not ACTIVE
            await self._until("node 1's replicas out of routing", out, 60)
            expired_s = time.monotonic() - cut_at
            self.network.heal("controller", self.placement["rollout-1"])

            async def returned() -> bool:
                states = [r.state for r in await replicas_of("rollout-1")]
                return bool(states) and all(s == 4 for s in states) and await _contains(routed("rollout-1"), node1)
            back = await self._until("node 1 back (ACTIVE and routed)", returned, 90)
            snapshot = await every_replica()
            self.record["phases"].append({
                "cut": "controller|rollout-1", "out_of_routing_after_s": round(expired_s, 2), "back_s": round(back, 2),
                "node_versions": [r.weight_version for r in snapshot if r.node_id == "rollout-1"],
                "other_versions": [r.weight_version for r in snapshot if r.node_id != "rollout-1"]})
            # 3. the weight path from the trainer to inference node 0 slow and lossy
            await self._slow_weight_path(every_replica, replicas_of)
        finally:
            # the job's step count is only a ceiling: training ends once the partitions are done or have
            # failed (their error is the record's, at once, not after thousands of steps)
            try:
                self.record["stopped_after_step"] = await self.stop_training()
            except Exception as err:  # noqa: BLE001 - recorded; the plan's own error, if any, comes first
                self.record["stop_error"] = f"StopTraining failed: {err!r}"
            await ctl_channel.close()
            await lb_channel.close()

    async def _slow_weight_path(self, every_replica, replicas_of) -> None:
        trainer, node = self.placement["trainer-agent"], self.placement["rollout-0"]
        first_event = len(self.events)
        seen: list[int] = []
        self.network.shape(trainer, node, rate="4mbit", queue_packets=16)
        try:
            ends = time.monotonic() + 10
            ports: set[tuple[int, int]] = set()
            while time.monotonic() < ends:
                seen += [r.weight_version for r in await replicas_of("rollout-0")]
                ports |= {(local, peer) for local, _, peer in await asyncio.to_thread(self.network.connections, trainer)}
                await asyncio.sleep(0.25)
        finally:
            self.network.unshape(node)
        ids = {r.replica_id for r in await replicas_of("rollout-0")}

        async def current() -> bool:   # one snapshot: node 0's versions against everyone else's
            snapshot = await every_replica()
            mine = [r.weight_version for r in snapshot if r.node_id == "rollout-0"]
            others = [r.weight_version for r in snapshot if r.node_id != "rollout-0"]
            return bool(mine) and min(mine) >= max(others) - 1
        caught_up = await self._until("node 0 current again after the slow link", current, 90)
        window = self.events[first_event:]
        self.record["phases"].append({
            "shaped": f"{trainer}->{node}", "versions_seen": seen, "caught_up_s": round(caught_up, 2),
            "trainer_ports": sorted({p for pair in ports for p in pair}),
            "syncs_completed": sum(1 for e in window if e["type"] == "WEIGHT_SYNC_COMPLETED"),
            "node_syncs_failed": [e["reason"][:200] for e in window
                                  if e["type"] == "WEIGHT_SYNC_FAILED" and e["replica_id"] in ids]})

    async def _serving(self, routed) -> bool:
        return all([await routed(n) for n in ("rollout-0", "rollout-1")])

    async def _final_state(self) -> None:
        ctl_channel, lb_channel = self._channels()
        try:
            controller = controller_pb2_grpc.ControllerServiceStub(ctl_channel)
            lb = loadbalancer_pb2_grpc.LoadBalancerServiceStub(lb_channel)
            stats = (await lb.GetStats(loadbalancer_pb2.GetStatsRequest(), timeout=10)).stats
            replicas = (await controller.ListReplicas(registry_pb2.ListReplicasRequest(), timeout=10)).replicas
            self.record["lb"] = {"requests": stats.requests_total, "completed": stats.completed,
                                 "failed": stats.failed, "cancelled": stats.cancelled, "retries": stats.retries, "resumes": stats.resumes,
                                 "outlier_ejections": stats.outlier_ejections}
            self.record["replicas"] = {r.replica_id: {"node": r.node_id, "state": r.state, "address": r.address,
                                                      "weight_version": r.weight_version} for r in replicas}
        finally:
            await ctl_channel.close()
            await lb_channel.close()


async def _contains(found, wanted: set[str]) -> bool:
    return wanted <= await found


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    network = Network.attach(spec["network"])
    run_dir = Path(spec["run_dir"])
    job = load_job_config(spec["job_config"])
    runner = MultiHostJob(job, run_dir, dict(spec["env"]), network=network, placement=spec["placement"],
                          faults=spec["faults"])
    code = asyncio.run(runner.run())
    (run_dir / "multihost.json").write_text(json.dumps(runner.record, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
