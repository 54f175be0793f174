"""The balancer's OpenAI-compatible HTTP API against its gRPC Generate, on the same mesh, in one run.

4 replica agents with one synthetic replica each (200 tokens/s per request, vocabulary of the tiny
presets so every id decodes), one ``rollmesh lb`` with ``http_listen`` on. The same requests go through
gRPC ``Generate`` (a call per request) and through ``POST /v1/completions`` (a keep-alive HTTP connection
per client, aiohttp): prompts of 16-240 tokens (the tiny presets take 512 in all), each different, as
token ids. A third shape streams long completions (4,096 tokens each), where the cost of turning tokens into
text deltas shows: decoding the whole completion again on every chunk is quadratic in its length. Printed per shape:
requests/s, p50/p99 latency, and the balancer's CPU per request or per 1,000 streamed tokens.

    .venv/bin/python -m benchmarks.bench_openai_front [--short 2000] [--stream 600] [--long 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp

from benchmarks.cpu_quota import cpu_seconds
from launcher.processes import start_server
from mesh_runtime.channels import open_channel
from mesh_runtime.chat import build_preset_core
from mesh_runtime.net import free_port
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, loadbalancer_pb2_grpc

AGENT = """node_id: {node}
slots: 1
backend: synthetic
engine_options: {{tokens_per_second: {rate}, max_batch_size: 1024, vocab_size: 256,
                  lengths: {{kind: fixed, value: 100000}}}}
replicas: [{{replica_id: {node}-0}}]
"""


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(32, 126) for _ in range(rng.randint(16, 240))] for _ in range(count)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))] if ordered else float("nan")


async def start_mesh(tmp: Path, rate: float):
    agents = []
    for i in range(4):
        (tmp / f"n{i}.yaml").write_text(AGENT.format(node=f"n{i}", rate=rate))
        agents.append(await start_server("replica-agent", ["--config", str(tmp / f"n{i}.yaml"), "--listen",
                                                           "127.0.0.1:0"], log_path=tmp / f"n{i}.log"))
    model = tmp / "model"   # the presets' tokenizer with a context long enough for the long shape
    model.mkdir()
    build_preset_core().save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    http = free_port()
    replicas = "".join(f"  - {{replica_id: n{i}-0, address: {a.address}}}\n" for i, a in enumerate(agents))
    (tmp / "lb.yaml").write_text(f"http_listen: 127.0.0.1:{http}\nmodel: {model}\nreplicas:\n{replicas}")
    lb = await start_server("lb", ["--config", str(tmp / "lb.yaml"), "--listen", "127.0.0.1:0"],
                            log_path=tmp / "lb.log")
    return lb, agents, f"http://127.0.0.1:{http}/v1/completions"


async def grpc_load(address: str, work: list[list[int]], concurrency: int, max_tokens: int, tag: str):
    left = list(enumerate(work))
    latencies: list[float] = []
    tokens = failures = 0
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async with open_channel(address) as channel:
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)

        async def client() -> None:
            nonlocal tokens, failures
            while left:
                i, prompt = left.pop()
                start = time.perf_counter()
                try:
                    got = 0
                    async for msg in stub.Generate(loadbalancer_pb2.GenerateRequest(
                            request_id=f"{tag}-{i}", prompt_token_ids=prompt, sampling_params=sampling), timeout=600):
                        got += len(msg.token_ids)
                    assert got == max_tokens
                    tokens += got
                    latencies.append(time.perf_counter() - start)
                except Exception:  # noqa: BLE001 - counted
                    failures += 1

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies, tokens, failures


async def http_load(url: str, work: list[list[int]], concurrency: int, max_tokens: int, stream: bool):
    left = list(enumerate(work))
    latencies: list[float] = []
    tokens = failures = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal tokens, failures
            while left:
                _, prompt = left.pop()
                body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                        "stream": stream}
                start = time.perf_counter()
                try:
                    async with session.post(url, json=body) as response:
                        if response.status != 200:
                            raise RuntimeError(response.status)
                        if stream:
                            got = 0
                            async for line in response.content:
                                if line.startswith(b"data: {"):
                                    got += len(json.loads(line[6:])["choices"][0]["token_ids"])
                        else:
                            got = len((await response.json())["choices"][0]["token_ids"])
                    assert got == max_tokens
                    tokens += got
                    latencies.append(time.perf_counter() - start)
                except Exception as err:  # noqa: BLE001 - counted
                    failures += 1
                    if failures == 1:
                        print(f"first HTTP failure: {err!r}")

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - start, latencies, tokens, failures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=2000, help="short requests (16 out) per front")
    parser.add_argument("--stream", type=int, default=600, help="streamed 256-token requests per front")
    parser.add_argument("--long", type=int, default=16, help="streamed 4,096-token requests per front")
    parser.add_argument("--rate", type=float, default=200.0, help="tokens/s per request")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lb, agents, url = await start_mesh(Path(tmp), args.rate)
        try:
            await grpc_load(lb.address, prompts(200, 0), 32, 16, "warm")
            await http_load(url, prompts(200, 0), 32, 16, False)
            rows = []
            for shape, count, concurrency, max_tokens in (("short", args.short, 128, 16),
                                                          ("stream", args.stream, 256, 256),
                                                          ("long", args.long, 16, 4096)):
                if not count:
                    continue
                work = prompts(count, 1)
                for front in ("gRPC Generate", "HTTP /v1/completions"):
                    cpu = cpu_seconds(lb.pid)
                    if front.startswith("gRPC"):
                        wall, lat, tokens, fail = await grpc_load(lb.address, work, concurrency, max_tokens, shape)
                    else:
                        wall, lat, tokens, fail = await http_load(url, work, concurrency, max_tokens,
                                                                  stream=shape != "short")
                    used = cpu_seconds(lb.pid) - cpu
                    per = f"{used / count * 1000:.3f} ms/request" if shape == "short" else \
                        f"{used / max(tokens, 1) * 1e6:.2f} ms/1k tokens"
                    rows.append((shape, front, count / wall, pct(lat, 50) * 1000, pct(lat, 99) * 1000, per, fail))
        finally:
            await asyncio.gather(*(p.terminate() for p in (lb, *agents)))
    print(f"{'shape':<8} {'front':<22} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}  {'balancer CPU':<20} failed")
    for shape, front, rps, p50, p99, per, fail in rows:
        print(f"{shape:<8} {front:<22} {rps:>8.0f} {p50:>8.1f} {p99:>8.1f}  {per:<20} {fail}")


if __name__ == "__main__":
    asyncio.run(main())
