"""verl's own clients and weight update on a rollmesh fleet, against rollmesh's own, on one machine (the verl plugin).

Run from verl's environment (``scripts/install --pins verl``); the fleet runs from ``./.venv`` as in the plugin's
tests (:mod:`tests.integrations.verl.fleet`): 2 replica agents of one torch replica each, serving ``--model`` (a
rollmesh preset written as a Hugging Face directory; default small-llama, 4.5 M parameters, 18 MB in fp32).

1. **Weight update.** verl's ``CheckpointEngineManager.update_weights`` with the ``rollmesh`` backend (its abort
   and resume of the replicas, rank 0 copying the version to host memory and serving it from its own process, the
   controller's broadcast from there and commit; ``--weights-dir``: rank 0 writes the version for the fleet's
   trainer agent instead) against rollmesh's own sync of the same model: ``SyncWeights`` of a new version the trainer agent
   holds in memory, as after rollmesh's built-in trainer's step (a second fleet whose trainer agent steps its
   weights in place the same way the verl side's stand-in optimizer does, :class:`SteppedWeightSource`, so both
   sides broadcast versions that differ equally: same delta attempt, same bytes). Median and spread of
   ``--syncs`` updates each.
2. **Per-request cost.** The same requests (``--requests`` of 16 prompt tokens and 16 sampled, ``--concurrency``
   at once) through verl's ``FullyAsyncLLMServerClient`` (verl's Ray load-balancer actor, the replica's server
   actor, then the balancer) and through rollmesh's ``MeshClient`` (straight to the balancer): wall time and the
   CPU seconds of the client side's processes per request (this process, plus for verl its Ray actors'), read
   from ``/proc``.

    .venv-verl/bin/python -m benchmarks.bench_verl [--model small-llama] [--syncs 7] [--requests 512] [--weights-dir]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _cpu(pids: list[int]) -> float:
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / ticks   # utime + stime
    return total


def _ray_pids(name: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().startswith(f"ray::{name}".encode()):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _config(f: Any, replicas: int) -> Any:
    from tests.integrations.verl.conftest import verl_config

    return verl_config(f, replicas=replicas)


async def _mesh_requests(f: Any, n: int, concurrency: int) -> tuple[float, float]:
    from rollmesh.common.v1 import generation_pb2
    from rollmesh.loadbalancer.v1 import loadbalancer_pb2
    from trainer_client import MeshClient

    async with MeshClient(f.controller) as mesh:
        channel = await mesh.generation_channel(f.lb)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                await mesh.generate(channel, loadbalancer_pb2.GenerateRequest(
                    request_id=f"m{i}-{time.monotonic_ns()}", prompt_token_ids=[5 + (i + j) % 200 for j in range(16)],
                    sampling_params=generation_pb2.SamplingParams(max_tokens=16, temperature=1.0, logprobs=True)))
        await one(-1)   # connect first
        cpu0, t0 = _cpu([os.getpid()]), time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall, cpu = time.perf_counter() - t0, _cpu([os.getpid()]) - cpu0
        await channel.close()
    return wall, cpu


async def _verl_requests(client: Any, n: int, concurrency: int) -> tuple[float, float]:
    gate = asyncio.Semaphore(concurrency)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
              "max_tokens": 16}

    async def one(i: int) -> None:
        async with gate:
            await client.generate(f"v{i}", prompt_ids=[5 + (i + j) % 200 for j in range(16)], sampling_params=params)
    await one(-1)
    pids = [os.getpid(), *_ray_pids("RollmeshServer"), *_ray_pids("GlobalRequestLoadBalancer")]
    cpu0, t0 = _cpu(pids), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0, _cpu(pids) - cpu0


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:.0f} ms (min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small-llama")
    parser.add_argument("--syncs", type=int, default=7)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--weights-dir", action="store_true", help="rank 0 hands versions to the fleet's trainer "
                                                                   "agent through files (the plugin's weights_dir)")
    args = parser.parse_args()

    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncLLMServerManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    from tests.integrations.verl.fleet import fleet, write_model
    from tests.integrations.verl.trainer_worker import CpuTrainerWorker

    print(f"machine: {os.cpu_count()} cores; model {args.model}")
    # the versions go through /dev/shm, as the docs deploy it (a disk-backed directory adds its writeback)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        model = write_model(Path(tmp) / "model", preset=args.model)
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        with fleet(Path(tmp) / "verl", model=model) as f:
            config = _config(f, 2)
            manager = FullyAsyncLLMServerManager.create(config=config, worker_group=None)
            pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
            trainer = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(CpuTrainerWorker), model_path=model,
                engine_kwargs=f.engine_kwargs(**({"weights_dir": f.weights_dir} if args.weights_dir else {}))),
                use_gpu=False)
            checkpoints = CheckpointEngineManager(
                config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine), actor_wg=trainer,
                replicas=manager.get_replicas())
            verl_syncs, inner, writes = [], [], []
            for step in range(1, args.syncs + 1):
                trainer.train_a_step(seed=step)
                t0 = time.perf_counter()
                metrics = checkpoints.update_weights(global_steps=step)
                verl_syncs.append(time.perf_counter() - t0)
                inner.append(metrics["rollmesh/publish_s"] + metrics["rollmesh/sync_s"])
                writes.append(metrics["rollmesh/publish_s"])
                assert metrics["rollmesh/replicas_synced"] == 2
            client = manager.get_client(client_cls=FullyAsyncLLMServerClient)
            verl_wall, verl_cpu = asyncio.run(_verl_requests(client, args.requests, args.concurrency))
            mesh_wall, mesh_cpu = asyncio.run(_mesh_requests(f, args.requests, args.concurrency))
        own = _own_syncs(Path(tmp) / "own", model, args.syncs)
        ray.shutdown()

    print("\n1. weight update of the same model to 2 replicas (gloo on loopback)")
    how = "writing it for the trainer agent" if args.weights_dir else "handing it to its own weight server"
    print(f"   verl CheckpointEngineManager.update_weights, rollmesh backend: {_spread(verl_syncs)}")
    print(f"     of which rank 0's send_weights (copy, hand-over, the controller's broadcast): {_spread(inner)}")
    print(f"       of which rank 0 copying the version to host memory and {how}: {_spread(writes)}")
    print(f"   rollmesh's own sync (SyncWeights from the trainer agent's in-memory model): {_spread(own)}")
    print(f"   ratio of medians: {statistics.median(verl_syncs) / statistics.median(own):.2f}x")
    print(f"\n2. {args.requests} requests (16 tokens in, 16 sampled), {args.concurrency} at once")
    print(f"   verl FullyAsyncLLMServerClient: {args.requests / verl_wall:.0f} req/s, client-side CPU "
          f"{verl_cpu / args.requests * 1000:.2f} ms per request (this process + verl's Ray actors)")
    print(f"   rollmesh MeshClient:            {args.requests / mesh_wall:.0f} req/s, client-side CPU "
          f"{mesh_cpu / args.requests * 1000:.2f} ms per request")
    print(f"   verl's client adds {(verl_cpu - mesh_cpu) / args.requests * 1000:.2f} ms of CPU per request")


def _stepped_weight_source() -> type:
    import torch

    from trainer_agent.weight_source import TorchWeightSource

    class Stepped(TorchWeightSource):
        """The model in memory, stepped in place to version ``v`` when version ``v`` is asked for: every weight
        moves by N(0, 0.05) drawn from seed ``v``, as ``CpuTrainerWorker.train_a_step`` moves verl's side. The
        steps are drawn at load, so a sync times the broadcast alone, as after an optimizer step."""

        def __init__(self, model: str, *, steps: int = 8, **kwargs: object) -> None:
            super().__init__(model, **kwargs)   # type: ignore[arg-type]
            self._steps_wanted = steps
            self._moves: dict[int, dict[str, torch.Tensor]] = {}

        def _load(self) -> None:
            super()._load()
            live = dict(self._named_tensors())
            for version in range(1, self._steps_wanted + 1):
                generator = torch.Generator().manual_seed(version)
                self._moves[version] = {n: torch.randn(live[n].shape, generator=generator).to(live[n].dtype) * 0.05
                                        for n in sorted(live)}

        def snapshot(self, weight_version: int = 0):   # type: ignore[no-untyped-def]
            if weight_version > self.weight_version and weight_version in self._moves:
                with self.updating(weight_version), torch.no_grad():
                    live = dict(self._named_tensors())
                    for name, move in self._moves[weight_version].items():
                        live[name].add_(move)
            return super().snapshot(weight_version)

    return Stepped


def __getattr__(name: str) -> type:
    """``SteppedWeightSource``, made on first use: the trainer agent imports it from rollmesh's environment, and
    this module also runs in verl's, which lacks the agent."""
    if name == "SteppedWeightSource":
        return _stepped_weight_source()
    raise AttributeError(name)


def _own_syncs(tmp: Path, model: str, n: int) -> list[float]:
    """rollmesh's own sync: a fleet whose trainer agent steps the model in memory (:class:`SteppedWeightSource`)
    and broadcasts each new version."""
    import grpc

    from mesh_runtime.durations import set_seconds
    from rollmesh.controller.v1 import controller_pb2_grpc, weight_sync_pb2
    from tests.integrations.verl.fleet import fleet

    trainer = ("model: {model}\nweight_source: benchmarks.bench_verl:SteppedWeightSource\n"
               f"weight_source_options: {{{{steps: {n}}}}}\n")
    with fleet(tmp, model=model, trainer=trainer) as f:
        times = []
        with grpc.insecure_channel(f.controller) as channel:
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            for i in range(n):
                request = weight_sync_pb2.SyncWeightsRequest(request_id=f"own-{i}", weight_version=i + 1)
                set_seconds(request.timeout, 120)
                t0 = time.perf_counter()
                reply = stub.SyncWeights(request, timeout=180)
                times.append(time.perf_counter() - t0)
                assert all(r.ok for r in reply.result.replica_results) and len(reply.result.replica_results) == 2
    return times


if __name__ == "__main__":
    main()
