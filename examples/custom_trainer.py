"""A trainer of one's own driving a rollmesh mesh through the client library (trainer_client).

The mesh (controller, load balancer, replica agents) generates; this process trains. Each step it

1. asks the controller to begin the step (``MeshClient.begin_step``) with the counters it keeps; when told
   to, it waits for its buffer and releases the hybrid replicas (``release_hybrids``);
2. collects samples through the load balancer and trains on them (here: rollmesh's GRPO on the copy task,
   standing in for your training code);
3. publishes the new weights for the trainer agent (``published_weights.publish``; the agent runs with
   ``weight_source: trainer_agent.published_weights:DirectoryWeightSource`` on the same directory) and
   completes the step (``complete_step``): the controller broadcasts that version to the replicas.

    python examples/custom_trainer.py --controller HOST:PORT --lb HOST:PORT --weights-dir DIR --steps 3

Prints one JSON line per step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc

from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2
from weight_transfer.published import publish
from trainer_agent.training import task
from trainer_agent.training.grpo import GrpoConfig, GrpoTrainer, Sample
from trainer_client import Counters, MeshClient


async def collect(mesh: MeshClient, lb: grpc.aio.Channel, prompts, group_size: int, step: int) -> list[list[Sample]]:
    """One group of ``group_size`` completions per prompt, from the load balancer (each its result only, all
    of them on one GenerateMany stream: MeshClient.generate)."""
    async def one(prompt: list[int], request_id: str) -> Sample:
        request = loadbalancer_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt,
            sampling_params=generation_pb2.SamplingParams(max_tokens=task.max_completion_tokens(prompt),
                                                          logprobs=True))
        final = await mesh.generate(lb, request, timeout_s=60)
        tokens, logprobs = list(final.token_ids), list(final.logprobs)
        return Sample(prompt, tokens, logprobs, reward=task.reward(prompt, tokens))

    groups = []
    for p, (prompt, _) in enumerate(prompts):
        groups.append(list(await asyncio.gather(*(one(prompt, f"s{step}-p{p}-{i}") for i in range(group_size)))))
    return groups


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--controller", required=True)
    parser.add_argument("--lb", required=True)
    parser.add_argument("--weights-dir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from modeling.presets import build_preset_model

    model = build_preset_model(args.model, args.seed)   # the weights the replicas start from
    trainer = GrpoTrainer(model, GrpoConfig(lr=3e-3))
    prompts_per_step, group_size = 4, 4
    counters = Counters(required_samples=prompts_per_step, trigger_parameter_sync_step=1)
    async with MeshClient(args.controller) as mesh, grpc.aio.insecure_channel(args.lb) as lb:
        for step in range(1, args.steps + 1):
            begin = await mesh.begin_step(step, counters)
            if begin.deactivate:   # nothing is buffered here: samples are collected on demand
                await mesh.release_hybrids(step, buffered_samples=0, waited_s=0.0, wait_expired=False)
            started = time.perf_counter()
            groups = await collect(mesh, lb, task.make_prompts(prompts_per_step, seed=step), group_size, step)
            result = await asyncio.to_thread(trainer.step, groups)
            counters.generated_samples += prompts_per_step
            counters.consumed_samples = prompts_per_step
            counters.timing_s = {"gen_and_train": time.perf_counter() - started}
            version = result.weight_version
            await asyncio.to_thread(publish, args.weights_dir, dict(trainer.named_weights()), version)
            done = await mesh.complete_step(step, version, counters)
            print(json.dumps({"step": step, "weight_version": version, "bytes_sent": done.bytes_sent,
                              "reward_mean": result.metrics["critic/rewards/mean"],
                              "hybrid_activated": done.hybrid_activated}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
