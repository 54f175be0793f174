"""Prefix-aware routing on a modelled GPU engine, side by side with SMG's ``cache_aware``, in one run.

``--replicas`` (16) replicas run the same engine model (:mod:`replica_agent.engines.engine_model`:
Llama-3.1-8B on an H100 by default; prefill of uncached prompt tokens, a block prefix cache, decode that
slows with batch and context, KV admission), at ``--speed`` (2: twice the modelled GPU's pace, so a run takes
minutes): for rollmesh, replica agents of one synthetic replica each behind ``rollmesh lb``; for SMG 1.13.0,
as many fake SGLang workers (``benchmarks.fake_sglang_worker --engine-model``). Two workloads, each from cold
caches under every policy, with enough in flight to keep every replica's batch full:

* **GRPO**: groups of ``--n`` (16) responses to one prompt, all sent at once as a rollouter does; prompts of
  1,024-4,096 different tokens, responses of 256-1,024 tokens (uniform, fixed per request); ``--groups``
  groups with ``--group-concurrency`` of them in flight, a new group as soon as one completes.
* **multi-turn**: ``--trajectories`` agentic trajectories of 8 turns (``--traj-concurrency`` in flight);
  every turn resends the whole context (a 512-token system prompt shared by all, a 256-1,024-token task,
  then each turn's response of 128-512 tokens and an observation of 64-512), as a harness does.
* **shared document** (``--workload document`` or ``all``): ``--trajectories`` trajectories of 1-24 turns
  (Zipf: most are short, a few long), 30% of them starting with one 4,096-token document and the rest with a
  task of their own: a prefix shared by part of the traffic, where cache affinity by request counts piles the
  document onto a few replicas.
* **hot system prompt** (``--workload system`` or ``all``): ``--trajectories`` trajectories of 1-8 turns,
  every one starting with one 6,144-token system prompt (deeper than the 2,048 tokens the prefix index used
  to stop at with KV events on), then a task of its own.
* **tool pauses** (``--workload tools`` or ``all``): ``--trajectories`` trajectories of 4-12 turns; each turn
  but the last ends in a tool call that takes a lognormal time (median 2 s, sigma 1: p99 about 20 s, divided
  by ``--speed`` like every engine duration) before its result (64-512 tokens) is appended; the engines' KV
  fills with trajectories waiting on tools.
* **coding agent** (``--workload agent`` or ``all``): ``--trajectories`` trajectories behind one 2,048-token
  system prompt and a task of 512-2,048 tokens, 8-32 turns of 64-512 tokens each ending in a tool call whose
  output (256-2,048 tokens) is appended after a lognormal wait (median 2 s over ``--speed``): contexts of
  10-60K tokens, more than the engines' KV holds at the concurrency of the others.
* **replicas joining** (``--workload join`` or ``all``): the multi-turn workload on half the replicas, the
  other half added ``--join-after`` seconds in (a scale-out while trajectories hold their caches where they
  are); for SMG with ``POST /workers``.

Policies: rollmesh ``least_loaded`` without session ids; ``least_loaded`` with session ids (the group, the
trajectory: today's group stickiness); ``prefix_aware`` and ``prefix_cost`` (with session ids, as the trainer
sends them; ``prefix_cost`` pins none, it keeps a trajectory where its context is cached by cost); ``programs``:
``prefix_aware`` with ``program_admission`` on (a session's turns stay where its KV is, new trajectories wait
for KV room, oldest first), and ``programs prefix_cost`` the same under the default policy; SMG
``cache_aware`` and ``round_robin``. rollmesh's clients send on the balancer's GenerateMany stream with
``final_only``, as the trainer's rollouter does; SMG's send ``POST /generate`` with ``input_ids`` on keep-alive
connections (SMG's cache-aware tree matches token ids), with its admission limit off
(``--max-concurrent-requests 0``: its default bound, 4,096 requests here plus 100 queued, answers the rest
429). Printed per workload and policy: fleet completion tokens/s, latency p50/p99 (of a GRPO group, of a
turn, and of a whole trajectory), and the prefix hit rate (cached over prompt tokens, from each result's
``cached_tokens``).

    .venv/bin/python -m benchmarks.bench_prefix_routing [--replicas 16] [--speed 2] [--workload grpo]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_loadbalancer import pct
from benchmarks.routing_workloads import (
    Call, Result, grpo, run_agent, run_document, run_grpo, run_join, run_multiturn, run_system, run_tools,
)
from benchmarks.bench_vs_smg import free_port, smg_binary
from launcher.processes import start_server
from mesh_runtime.channels import open_channel
from mesh_runtime.generate_many import BalancerGenerations
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc, routing_pb2

AGENT = """node_id: {node}
slots: 1
backend: synthetic
engine_options: {{engine_model: {model}, max_batch_size: 256, tokens_per_step: 16, vocab_size: 32000}}
replicas: [{{replica_id: {node}-0}}]
"""


# ------------------------------------------------------------------------------------------------- rollmesh

class Mesh:
    """4 replica agents on the engine model behind one balancer of the given policy."""

    def __init__(self, tmp: Path, model: dict, replicas: int, policy: str, sessions: bool, lb_yaml: str = "",
                 start_with: int | None = None) -> None:
        self.tmp, self.model, self.replicas, self.policy, self.sessions = tmp, model, replicas, policy, sessions
        self.lb_yaml = lb_yaml
        self.start_with = replicas if start_with is None else start_with
        self.procs: list = []
        self.generations: BalancerGenerations | None = None

    async def __aenter__(self) -> "Mesh":
        agents = []
        for i in range(self.replicas):
            node = f"n{i}"
            (self.tmp / f"{node}.yaml").write_text(AGENT.format(node=node, model=json.dumps(self.model)))
            agents.append(await start_server("replica-agent", ["--config", str(self.tmp / f"{node}.yaml"),
                                                               "--listen", "127.0.0.1:0"],
                                             log_path=self.tmp / f"{node}.log"))
        (self.tmp / "lb.yaml").write_text(f"routing_policy: {self.policy}\n{self.lb_yaml}\n")
        lb = await start_server("lb", ["--config", str(self.tmp / "lb.yaml"), "--listen", "127.0.0.1:0"],
                                log_path=self.tmp / "lb.log")
        self.procs = [lb, *agents]
        self.channel = open_channel(lb.address)
        self.agents = agents
        await self._add(range(self.start_with))
        self.generations = BalancerGenerations(self.channel)
        await self.generations.check()
        return self

    async def __aexit__(self, *exc) -> None:
        if self.generations is not None:
            await self.generations.close()
        await self.channel.close()
        await asyncio.gather(*(p.terminate() for p in self.procs))

    async def _add(self, indices) -> None:
        await loadbalancer_pb2_grpc.LoadBalancerServiceStub(self.channel).AddReplicas(
            loadbalancer_pb2.AddReplicasRequest(replicas=[
                routing_pb2.ReplicaEndpoint(replica_id=f"n{i}-0", address=self.agents[i].address) for i in indices]))

    async def join(self) -> None:
        """The replicas held back at the start join the balancer."""
        await self._add(range(self.start_with, self.replicas))

    async def close(self, session: str) -> None:
        if self.sessions:
            await loadbalancer_pb2_grpc.LoadBalancerServiceStub(self.channel).CloseSession(
                loadbalancer_pb2.CloseSessionRequest(session_id=session))

    async def send(self, call: Call) -> bool:
        assert self.generations is not None
        request = loadbalancer_pb2.GenerateRequest(
            request_id=f"{call.key}", prompt_token_ids=call.prompt, final_only=True,
            session_id=call.session if self.sessions else "",
            sampling_params=generation_pb2.SamplingParams(max_tokens=call.max_tokens, ignore_eos=True))
        started = time.perf_counter()
        try:
            async for msg in self.generations.call(request, timeout_s=3600):
                if msg.finish_reason:
                    call.output = list(msg.token_ids)
                    call.cached = msg.usage.cached_tokens
        except Exception as err:  # noqa: BLE001 - counted as failed
            _report_failure(call, err)
            return False
        call.seconds = time.perf_counter() - started
        return len(call.output) == call.max_tokens


_FAILURES_SHOWN = [0]


def _report_failure(call: Call, err: BaseException) -> None:
    """Print the first few failures of a run (all are counted)."""
    if _FAILURES_SHOWN[0] < 5:
        _FAILURES_SHOWN[0] += 1
        print(f"  {call.key} failed: {err!r}"[:240], flush=True)


# ------------------------------------------------------------------------------------------------------ SMG

class HttpPool:
    """Keep-alive HTTP/1.1 connections to one address, one request at a time on each."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, body: dict, path: str = "/generate") -> dict:
        conn = self.idle.pop() if self.idle else await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = conn
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(data)}\r\n\r\n".encode() + data)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            payload = await reader.readexactly(length)
        except BaseException:
            writer.close()
            raise
        self.idle.append(conn)
        if head.split(b" ", 2)[1] not in (b"200", b"202"):
            raise RuntimeError(payload[:200].decode(errors="replace"))
        return json.loads(payload)

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


class Smg:
    """4 fake SGLang workers on the engine model behind SMG with the given policy."""

    def __init__(self, tmp: Path, model: dict, replicas: int, policy: str, start_with: int | None = None) -> None:
        self.tmp, self.model, self.replicas, self.policy = tmp, model, replicas, policy
        self.start_with = replicas if start_with is None else start_with

    async def __aenter__(self) -> "Smg":
        self.workers = []
        for _ in range(self.replicas):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "benchmarks.fake_sglang_worker", "--engine-model", json.dumps(self.model),
                stdout=asyncio.subprocess.PIPE)
            assert proc.stdout is not None
            self.workers.append((proc, int((await proc.stdout.readline()).split()[1])))
        port = free_port()
        self.smg = subprocess.Popen(
            [str(smg_binary()), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", self.policy,
             "--max-concurrent-requests", "0",   # its default (4,096 here, 100 queued) refuses this load with 429
             "--log-level", "warn", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--worker-urls", *[f"http://127.0.0.1:{p}" for _, p in self.workers[:self.start_with]]],
            stdout=(self.tmp / f"smg-{self.policy}.log").open("wb"), stderr=subprocess.STDOUT)
        self.pool = HttpPool(port)
        deadline = time.monotonic() + 60
        while True:   # ready once it routes a request (to worker caches nothing the workload uses)
            try:
                await self.pool.post({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
                return self
            except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError, IndexError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"smg did not start; see {self.tmp}") from None
                await asyncio.sleep(0.3)

    async def join(self) -> None:
        """The workers held back at the start join SMG (its worker API; it adds them once they are healthy)."""
        for _, port in self.workers[self.start_with:]:
            await self.pool.post({"url": f"http://127.0.0.1:{port}", "worker_type": "regular"}, path="/workers")

    async def __aexit__(self, *exc) -> None:
        self.pool.close()
        self.smg.terminate()
        self.smg.wait(10)
        for proc, _ in self.workers:
            proc.kill()
            await proc.wait()

    async def send(self, call: Call) -> bool:
        started = time.perf_counter()
        try:
            body = await self.pool.post({"input_ids": call.prompt, "rid": call.key,
                                         "sampling_params": {"max_new_tokens": call.max_tokens}})
        except Exception as err:  # noqa: BLE001 - counted as failed
            _report_failure(call, err)
            return False
        call.seconds = time.perf_counter() - started
        call.output = body["output_ids"]
        call.cached = body["meta_info"].get("cached_tokens", 0)
        return len(call.output) == call.max_tokens


# ------------------------------------------------------------------------------------------------------ main

WORKLOADS = {"grpo": None, "multiturn": run_multiturn, "document": run_document, "system": run_system,
             "tools": run_tools, "join": run_join, "agent": run_agent}
LB_YAML = ""
DEFAULT_PROGRAMS_YAML = "{enabled: true}"
PROGRAMS_YAML = DEFAULT_PROGRAMS_YAML


def _programs(tmp: Path, model: dict, n: int, k: int | None, policy: str) -> Mesh:
    """rollmesh with program_admission on (``--programs-yaml``), ``policy`` choosing among replicas with room."""
    return Mesh(tmp, model, n, policy, sessions=True, start_with=k,
                lb_yaml=f"program_admission: {PROGRAMS_YAML}\n" + LB_YAML)


SYSTEMS = {
    "least_loaded": lambda tmp, model, n, k: Mesh(tmp, model, n, "least_loaded", sessions=False, start_with=k),
    "group stickiness": lambda tmp, model, n, k: Mesh(tmp, model, n, "least_loaded", sessions=True, start_with=k),
    "prefix_aware": lambda tmp, model, n, k: Mesh(tmp, model, n, "prefix_aware", sessions=True, lb_yaml=LB_YAML,
                                                  start_with=k),
    "prefix_cost": lambda tmp, model, n, k: Mesh(tmp, model, n, "prefix_cost", sessions=True, lb_yaml=LB_YAML,
                                                 start_with=k),
    "programs": lambda tmp, model, n, k: _programs(tmp, model, n, k, "prefix_aware"),
    "programs prefix_cost": lambda tmp, model, n, k: _programs(tmp, model, n, k, "prefix_cost"),
    "SMG cache_aware": lambda tmp, model, n, k: Smg(tmp, model, n, "cache_aware", start_with=k),
    "SMG round_robin": lambda tmp, model, n, k: Smg(tmp, model, n, "round_robin", start_with=k),
}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speed", type=float, default=2.0, help="engine model speed (1: the modelled H100)")
    parser.add_argument("--replicas", type=int, default=16)
    parser.add_argument("--groups", type=int, default=1152)
    parser.add_argument("--n", type=int, default=16, help="responses per GRPO prompt")
    parser.add_argument("--group-concurrency", type=int, default=384)
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--traj-concurrency", type=int, default=1024)
    parser.add_argument("--only", nargs="*", choices=list(SYSTEMS), help="policies to run (default: all)")
    parser.add_argument("--workload", choices=(*WORKLOADS, "both", "all"),
                        default="both", help="both: grpo and multiturn; all: the seven")
    parser.add_argument("--join-after", type=float, default=15.0,
                        help="join: seconds before the second half of the replicas joins")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preempt", action="store_true",
                        help="engines allocate KV as they decode and preempt when out of it (vLLM), instead of "
                             "reserving max_tokens at admission")
    parser.add_argument("--lb-yaml", default="", help="more balancer settings for prefix_aware (YAML), to tune")
    parser.add_argument("--programs-yaml", default=DEFAULT_PROGRAMS_YAML,
                        help="program_admission of the programs system (a YAML mapping), to tune")
    args = parser.parse_args()
    global LB_YAML, PROGRAMS_YAML
    LB_YAML, PROGRAMS_YAML = args.lb_yaml, args.programs_yaml
    model = {"speed": args.speed, "preempt": args.preempt}
    table: dict[str, dict[str, Result]] = {w: {} for w in WORKLOADS}
    workloads = {"both": ("grpo", "multiturn"), "all": tuple(table)}.get(args.workload, (args.workload,))
    with tempfile.TemporaryDirectory() as tmpdir:
        for name in args.only or list(SYSTEMS):
            for workload in workloads:
                _FAILURES_SHOWN[0] = 0
                start_with = max(1, args.replicas // 2) if workload == "join" else args.replicas
                async with SYSTEMS[name](Path(tmpdir), model, args.replicas, start_with) as system:
                    trajectories = (system, args.trajectories, args.traj_concurrency, args.seed)
                    if workload == "grpo":
                        calls = grpo(random.Random(args.seed), args.groups, args.n)
                        result = await run_grpo(system.send, calls, args.group_concurrency)
                    elif workload in ("tools", "agent"):
                        result = await WORKLOADS[workload](*trajectories, args.speed)
                    elif workload == "join":
                        result = await run_join(*trajectories, args.join_after)
                    else:
                        result = await WORKLOADS[workload](*trajectories)
                table[workload][name] = result
                print(f"{workload:9} {name:17} {_row(result)}", flush=True)
    print(f"\n{args.replicas} replicas of the engine model (speed {args.speed:g}; Llama-3.1-8B on an H100 at speed 1; "
          f"KV {'allocated as decoded, preempting' if args.preempt else 'reserved at admission'}), "
          f"{os.cpu_count()} CPU cores shared by everything")
    for workload in workloads:
        what = {"grpo": f"GRPO: {args.groups} groups of {args.n}, {args.group_concurrency} groups in flight; "
                        "latency of a group",
                "multiturn": f"multi-turn: {args.trajectories} trajectories x 8 turns, {args.traj_concurrency} "
                             "in flight; latency of a turn",
                "document": f"shared document: {args.trajectories} trajectories of 1-24 turns (Zipf), 30% "
                            f"starting with one 4,096-token document, {args.traj_concurrency} in flight; latency "
                            "of a turn",
                "system": f"hot system prompt: {args.trajectories} trajectories of 1-8 turns behind one "
                          f"6,144-token system prompt, {args.traj_concurrency} in flight; latency of a turn",
                "tools": f"tool pauses: {args.trajectories} trajectories of 4-12 turns, a lognormal tool wait "
                         f"(median 2 s / speed) between turns, {args.traj_concurrency} in flight; latency of a "
                         "turn",
                "agent": f"coding agent: {args.trajectories} trajectories of 8-32 turns behind one 2,048-token "
                         "system prompt, 256-2,048-token tool outputs after a lognormal wait (median 2 s / speed), "
                         f"contexts to 60K tokens, {args.traj_concurrency} in flight; latency of a turn",
                "join": f"replicas joining: multi-turn, {args.trajectories} trajectories x 8 turns, "
                        f"{args.traj_concurrency} in flight, on {max(1, args.replicas // 2)} replicas, the other "
                        f"{args.replicas - max(1, args.replicas // 2)} joining after {args.join_after:g} s; "
                        "latency of a turn"}[workload]
        print(f"\n{what}")
        base = table[workload].get("least_loaded")
        print(f"  {'policy':18} {'tokens/s':>9} {'vs least_loaded':>16} {'p50':>8} {'p99':>8} {'prefix hit':>10} "
              f"{'failed':>6} {'trajectory p50/p99':>19}")
        for name, r in table[workload].items():
            ratio = f"{(r.tokens / r.wall) / (base.tokens / base.wall):.2f}x" if base else "-"
            whole = (f"{pct(r.trajectories, 50):8.1f}s/{pct(r.trajectories, 99):.1f}s" if r.trajectories else "-")
            print(f"  {name:18} {r.tokens / r.wall:9.0f} {ratio:>16} {pct(r.latencies, 50):7.2f}s "
                  f"{pct(r.latencies, 99):7.2f}s {r.cached_tokens / max(1, r.prompt_tokens):10.1%} {r.failed:6} "
                  f"{whole:>19}")


def _row(r: Result) -> str:
    return (f"{r.tokens / r.wall:8.0f} tokens/s  p50 {pct(r.latencies, 50):6.2f}s  p99 {pct(r.latencies, 99):6.2f}s"
            f"  hit {r.cached_tokens / max(1, r.prompt_tokens):6.1%}  failed {r.failed}  wall {r.wall:6.1f}s")


if __name__ == "__main__":
    asyncio.run(main())
