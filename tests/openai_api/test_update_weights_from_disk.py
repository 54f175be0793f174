"""SGLang's ``update_weights_from_disk`` through SMG's RL control plane on a real mesh (a controller, a balancer
registered with it, three replica agents running the torch engine: two on tiny-llama, one on tiny-qwen2 that no
llama checkpoint fits), called with SMG 1.13's own client and as raw HTTP: one fleet-wide flip through the
controller's LoadWeights. The worker that cannot load the checkpoint leaves routing and the version commits on
the rest (207 naming it); the replicas then compute the checkpoint's model; a generation in flight across the
flip is aborted and resumes on the new weights, none lost; a rollback changes nothing; bad input is refused with
SMG's error shape, nothing changed. And the same through a trainer's own process group
(``init_weights_update_group`` / ``update_weights_from_distributed`` / ``destroy_weights_update_group``)."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest
import torch

from modeling.presets import build_preset_model, save_preset
from rollmesh.controller.v1 import controller_pb2_grpc, weight_sync_pb2
from tests.controller.scaling.helpers import Procs, until
from tests.processes import free_port
from trainer_agent.training.grpo import Sample, completion_logprobs

pytestmark = pytest.mark.timeout(300)
CONTROLLER = "lease_ttl_s: 3\nload_report_interval_s: 0.2\nstate_dir: {state}\n"
AGENT = """node_id: {node}
slots: 1
backend: torch
model: {preset}
controller_address: {controller}
stream_interval: 4
flush_interval_s: 0.05
engine_options: {{max_batch_size: 8, num_threads: 1}}
replicas:
  - {{replica_id: {node}-s0, kind: STANDALONE}}
"""
PROMPT = [5, 72, 101, 108, 108, 111]


async def _call(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.request(method, url, json=body) as response:
        return response.status, await response.json()


async def _workers(router: str) -> dict[str, dict]:
    return {w["id"]: w for w in (await _call("GET", f"{router}/v1/rl/workers"))[1]["workers"]}


async def _mesh(procs: Procs, tmp_path, presets: tuple[str, ...]) -> tuple[str, str]:
    """A controller, a balancer with its HTTP front, and one torch agent per preset (nodes a, b, c, ...), all
    routed; the front's URL and the controller's address."""
    controller = procs.start("controller", "controller", CONTROLLER.format(state=tmp_path / "state"))
    http = free_port()
    procs.start("lb", "lb", f"controller_address: {controller}\nhttp_listen: 127.0.0.1:{http}\n"
                            "model: tiny-llama\nno_replica_wait_s: 30\n")
    nodes = "abcdefgh"[:len(presets)]
    for node, preset in zip(nodes, presets):
        procs.start(node, "replica-agent", AGENT.format(node=node, preset=preset, controller=controller))
    router = f"http://127.0.0.1:{http}"

    async def all_routed() -> bool:
        return sorted(await _workers(router)) == [f"{n}-s0" for n in nodes]
    await until(all_routed, 90, every_s=0.3, what=f"{len(nodes)} routed workers")
    return router, controller


def _gap(model, out: dict) -> float:
    """Largest difference between the logprobs an answer reports and ``model``'s recomputation."""
    triples = out["meta_info"]["output_token_logprobs"]
    ids, logprobs = [t[1] for t in triples], [t[0] for t in triples]
    with torch.no_grad():
        mine, mask = completion_logprobs(model.eval(), [Sample(PROMPT, ids, logprobs)], torch.device("cpu"), 1.0)
    return float((torch.tensor(logprobs) - mine[0][mask[0]]).abs().max())


async def test_a_checkpoint_flips_the_fleet_through_smgs_rl_api(tmp_path):
    from smg.rl import RL, RlError, paused

    v7, v9 = save_preset("tiny-llama", 7, tmp_path / "v7"), save_preset("tiny-llama", 9, tmp_path / "v9")
    procs = Procs(tmp_path)
    try:
        router, controller = await _mesh(procs, tmp_path, ("tiny-llama", "tiny-llama", "tiny-qwen2"))
        rl = RL(router, timeout=120)
        assert all(w["capabilities"]["weight_updates"] for w in (await _workers(router)).values())

        # a generation in flight across the flip: aborted by the load, resumed on the new weights
        body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 480,
                                                                                 "temperature": 1.0}}
        headers = {"X-SMG-Routing-Key": "long"}
        async with aiohttp.ClientSession() as session:
            long = asyncio.create_task(session.post(f"{router}/generate", json=body, headers=headers))

            async def running() -> bool:
                return (await _call("GET", f"{router}/v1/loads"))[1]["loads"][0]["num_running_reqs"] > 0
            await until(running, 30, every_s=0.02, what="the long generation to start")
            status, flipped = await _call("POST", f"{router}/v1/rl/engine/update_weights_from_disk?selector=all",
                                          {"model_path": str(v7), "weight_version": "5", "abort_all_requests": True})
            response = await asyncio.wait_for(long, 120)
            long_out = await response.json()
        assert status == 207 and flipped["committed"] and not flipped["rolled_back"], flipped
        assert flipped["weight_version"] == "5" and flipped["total"] == 3 and flipped["succeeded"] == 2
        assert [f["worker_id"] for f in flipped["failed"]] == ["c-s0"]
        assert "does not fit the served model" in flipped["failed"][0]["message"]
        assert all(r["body"]["success"] and r["status"] == 200 for r in flipped["results"].values())
        workers = await _workers(router)
        assert sorted(workers) == ["a-s0", "b-s0"]                       # c left routing
        assert {w["weight_version"] for w in workers.values()} == {"5"}
        assert response.status == 200 and len(long_out["output_ids"]) == 480    # not lost
        assert long_out["meta_info"]["spans_versions"] and long_out["meta_info"]["weight_versions"] == [0, 5]

        model7 = build_preset_model("tiny-llama", 7)
        for i in range(4):
            status, out = await _call("POST", f"{router}/generate", {
                "input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 10, "temperature": 1.0}})
            assert status == 200 and out["meta_info"]["weight_version"] == "5"
            assert _gap(model7, out) < 1e-4                               # the checkpoint's model serves

        # rollback: c (still registered, a stale qwen2) cannot load it, so a and b stay where they were
        async with grpc.aio.insecure_channel(controller) as channel:
            reply = await controller_pb2_grpc.ControllerServiceStub(channel).LoadWeights(
                weight_sync_pb2.LoadWeightsRequest(
                    checkpoint_path=str(v9), replica_ids=["a-s0", "b-s0", "c-s0"],
                    on_failure=weight_sync_pb2.WEIGHT_UPDATE_ON_FAILURE_ROLLBACK), timeout=120)
        assert reply.rolled_back and not reply.committed and not any(r.ok for r in reply.result.replica_results)
        assert reply.result.weight_version == 6                          # unset: one above the highest
        assert {w["weight_version"] for w in (await _workers(router)).values()} == {"5"}
        status, out = await _call("POST", f"{router}/generate", {
            "input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 10,
                                                                              "temperature": 1.0}})
        assert status == 200 and _gap(model7, out) < 1e-4

        # SMG's own client, unchanged: a paused update of the routed fleet
        with paused(rl, "all") as result:
            assert result.succeeded == 2
            done = await asyncio.to_thread(rl.fanout, "update_weights_from_disk", {"model_path": str(v9)},
                                           selector="engine=torch")
            assert done.succeeded == done.total == 2 and not done.failed
        workers = await asyncio.to_thread(rl.workers)
        assert {(w.weight_version, w.health) for w in workers} == {("6", "healthy")}
        single = await asyncio.to_thread(rl.call, "a-s0", "get_weight_version", {})
        assert single.body == {"weight_version": "6"}

        # bad input: SMG's error shape, nothing changed
        for bad, code in (({}, "invalid_argument"), ({"model_path": str(v7), "weight_version": "v1"}, "invalid_argument"),
                          ({"model_path": str(v7), "load_format": "pt"}, "invalid_argument"),
                          ({"model_path": str(v7), "on_failure": "shrug"}, "invalid_argument"),
                          ({"model_path": str(v7), "lora": 1}, "invalid_argument"),
                          ({"model_path": str(tmp_path / "nowhere")}, "failed_precondition")):
            with pytest.raises(RlError) as err:
                await asyncio.to_thread(rl.fanout, "update_weights_from_disk", bad, selector="all")
            assert err.value.status == 400 and err.value.code == code, (bad, err.value)
        with pytest.raises(RlError) as err:
            await asyncio.to_thread(rl.call, "a-s0", "update_weights_from_tensor", {"serialized_named_tensors": []})
        assert err.value.status == 501
        assert {w.weight_version for w in await asyncio.to_thread(rl.workers)} == {"6"}
    finally:
        procs.close()


def _trainer_group(port: int, world_size: int, name: str):
    """Rank 0 of a trainer's weight group, built as a trainer that drives SGLang engines builds it."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout)
    group, _ = _new_process_group_helper(world_size, 0, [], "gloo", dist.PrefixStore(name, store), group_name=name,
                                         timeout=timeout)
    return store, group


async def test_a_trainers_own_group_sends_weights_as_smgs_distributed_update(tmp_path):
    """SGLang's init_weights_update_group / update_weights_from_distributed / destroy_weights_update_group through
    SMG's RL API: two replicas join the test's rank-0 group, receive its broadcast and serve the new version;
    the third, in no group, fails and leaves routing (207)."""
    import threading

    import torch.distributed as dist
    from smg.rl import RL, RlError

    procs = Procs(tmp_path)
    try:
        router, _ = await _mesh(procs, tmp_path, ("tiny-llama",) * 3)
        rl = RL(router, timeout=120)

        port, made = free_port(), {}
        trainer = threading.Thread(target=lambda: made.update(group=_trainer_group(port, 3, "g")))
        trainer.start()
        joins = [asyncio.to_thread(rl.call, worker, "init_weights_update_group",
                                   {"master_address": "127.0.0.1", "master_port": port, "rank_offset": rank,
                                    "world_size": 3, "group_name": "g", "backend": "gloo"})
                 for worker, rank in (("a-s0", 1), ("b-s0", 2))]
        joined = await asyncio.gather(*joins)
        trainer.join(60)
        assert all(j.status == 200 and j.body["success"] for j in joined), joined
        store, group = made["group"]

        model7 = build_preset_model("tiny-llama", 7)
        named = [(n, p.detach().contiguous()) for n, p in model7.named_parameters()]
        body = {"names": [n for n, _ in named], "dtypes": ["float32"] * len(named),
                "shapes": [list(p.shape) for _, p in named], "group_name": "g", "weight_version": "3"}

        def broadcast() -> None:
            for _, tensor in named:
                dist.broadcast(tensor, group=group, group_src=0)
        sender = threading.Thread(target=broadcast)
        sender.start()
        status, sent = await _call("POST", f"{router}/v1/rl/engine/update_weights_from_distributed?selector=all",
                                   body)
        sender.join(60)
        assert status == 207 and sent["succeeded"] == 2 and sent["committed"], sent
        assert [f["worker_id"] for f in sent["failed"]] == ["c-s0"] and "no group" in sent["failed"][0]["message"]
        workers = await _workers(router)
        assert sorted(workers) == ["a-s0", "b-s0"] and {w["weight_version"] for w in workers.values()} == {"3"}
        for _ in range(3):
            status, out = await _call("POST", f"{router}/generate", {
                "input_ids": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": 10,
                                                                                  "temperature": 1.0}})
            assert status == 200 and out["meta_info"]["weight_version"] == "3" and _gap(model7, out) < 1e-4

        left = await asyncio.to_thread(rl.fanout, "destroy_weights_update_group", {"group_name": "g"},
                                       selector="all")
        assert left.succeeded == left.total == 2
        for bad in ({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 0, "world_size": 3},
                    {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1, "world_size": 3}):
            with pytest.raises(RlError) as err:
                await asyncio.to_thread(rl.call, "a-s0", "init_weights_update_group", bad)
            assert err.value.status == 400, bad
        with pytest.raises(RlError) as err:
            await asyncio.to_thread(rl.fanout, "update_weights_from_distributed",
                                    {**body, "dtypes": ["float32"]}, selector="all")
        assert err.value.status == 400
        del store
    finally:
        procs.close()
