"""The workloads of ``bench_prefix_routing``: what its clients send, the same on every system under test.

A system under test (``target``) has ``send(call) -> bool`` (the call's ``output``, ``cached`` and ``seconds``
filled in), and may have ``close(session)`` (the trajectory ended, as the driver says with CloseSession) and
``join()`` (held-back replicas join). See the benchmark's docstring for each workload.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field


@dataclass
class Call:
    """One generation: its prompt, its length, and what came back."""

    key: str
    prompt: list[int]
    max_tokens: int
    session: str = ""
    output: list[int] = field(default_factory=list)
    cached: int = 0
    seconds: float = 0.0


@dataclass
class Result:
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    wall: float = 0.0
    trajectories: list[float] = field(default_factory=list)
    """Seconds from each trajectory's first turn sent to its last turn's end (multi-turn workloads)."""


# ------------------------------------------------------------------------------------------------ workloads

def grpo(rng: random.Random, groups: int, n: int) -> list[list[Call]]:
    out = []
    for g in range(groups):
        prompt = [rng.randrange(2, 32000) for _ in range(rng.randint(1024, 4096))]
        out.append([Call(f"g{g}-{i}", prompt, rng.randint(256, 1024), session=f"g{g}") for i in range(n)])
    return out


async def run_grpo(send, groups: list[list[Call]], concurrency: int) -> Result:
    result = Result()
    queue = list(reversed(groups))

    async def worker() -> None:
        while queue:
            group = queue.pop()
            started = time.perf_counter()
            done = await asyncio.gather(*(send(call) for call in group))
            if all(done):
                result.latencies.append(time.perf_counter() - started)
            for call, ok in zip(group, done):
                _count(result, call, ok)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall = time.perf_counter() - started
    return result


async def run_multiturn(target, trajectories: int, concurrency: int, seed: int) -> Result:
    system = [random.Random(seed).randrange(2, 32000) for _ in range(512)]

    def opening(rng: random.Random) -> tuple[list[int], int]:
        return system + [rng.randrange(2, 32000) for _ in range(rng.randint(256, 1024))], 8

    return await _run_trajectories(target, trajectories, concurrency, seed, "t", opening)


async def run_document(target, trajectories: int, concurrency: int, seed: int) -> Result:
    """Multi-turn trajectories of skewed lengths (Zipf over 1-24 turns), 30% of them starting with one shared
    4,096-token document: a prefix shared by part of the traffic."""
    document = [random.Random(seed + 1).randrange(2, 32000) for _ in range(4096)]
    turns, weights = range(1, 25), [1 / k for k in range(1, 25)]

    def opening(rng: random.Random) -> tuple[list[int], int]:
        context = (document if rng.random() < 0.3 else []) + [rng.randrange(2, 32000)
                                                             for _ in range(rng.randint(256, 1024))]
        return context, rng.choices(turns, weights)[0]

    return await _run_trajectories(target, trajectories, concurrency, seed, "d", opening)


async def run_system(target, trajectories: int, concurrency: int, seed: int) -> Result:
    """Trajectories of 1-8 turns, every one starting with one shared 6,144-token system prompt."""
    system = [random.Random(seed + 2).randrange(2, 32000) for _ in range(6144)]

    def opening(rng: random.Random) -> tuple[list[int], int]:
        return system + [rng.randrange(2, 32000) for _ in range(rng.randint(256, 1024))], rng.randint(1, 8)

    return await _run_trajectories(target, trajectories, concurrency, seed, "s", opening)


async def run_tools(target, trajectories: int, concurrency: int, seed: int, speed: float) -> Result:
    """Trajectories of 4-12 turns behind a 512-token system prompt; a tool call of lognormal latency (median
    2 s, sigma 1, over ``speed``) between turns."""
    system = [random.Random(seed + 3).randrange(2, 32000) for _ in range(512)]

    def opening(rng: random.Random) -> tuple[list[int], int]:
        return system + [rng.randrange(2, 32000) for _ in range(rng.randint(256, 1024))], rng.randint(4, 12)

    def tool_s(rng: random.Random) -> float:
        return rng.lognormvariate(math.log(2.0), 1.0) / speed

    return await _run_trajectories(target, trajectories, concurrency, seed, "k", opening, tool_s)


async def run_agent(target, trajectories: int, concurrency: int, seed: int, speed: float) -> Result:
    """Coding-agent trajectories: one 2,048-token system prompt, a task of 512-2,048 tokens, then 8-32 turns,
    each a response of 64-512 tokens ending in a tool call whose output (256-2,048 tokens: a file, a test run)
    is appended after a lognormal wait (median 2 s, sigma 1, over ``speed``). Contexts grow to 10-60K tokens,
    so the trajectories in flight hold more context than the engines' KV caches."""
    system = [random.Random(seed + 4).randrange(2, 32000) for _ in range(2048)]

    def opening(rng: random.Random) -> tuple[list[int], int]:
        return system + [rng.randrange(2, 32000) for _ in range(rng.randint(512, 2048))], rng.randint(8, 32)

    def tool_s(rng: random.Random) -> float:
        return rng.lognormvariate(math.log(2.0), 1.0) / speed

    return await _run_trajectories(target, trajectories, concurrency, seed, "a", opening, tool_s,
                                   response=(64, 512), observation=(256, 2048))


async def run_join(target, trajectories: int, concurrency: int, seed: int, join_after_s: float) -> Result:
    """The multi-turn workload, with the replicas held back joining ``join_after_s`` in."""
    async def join() -> None:
        await asyncio.sleep(join_after_s)
        await target.join()

    joining = asyncio.create_task(join())
    try:
        return await run_multiturn(target, trajectories, concurrency, seed)
    finally:
        if not joining.done():
            joining.cancel()
        elif joining.exception() is not None:
            raise RuntimeError("the held-back replicas could not join") from joining.exception()


async def _run_trajectories(target, trajectories: int, concurrency: int, seed: int, tag: str, opening,
                            tool_s=None, response: tuple[int, int] = (128, 512),
                            observation: tuple[int, int] = (64, 512)) -> Result:
    """``trajectories`` agentic trajectories on ``target`` (a system under test), ``concurrency`` in flight:
    ``opening(rng)`` gives each its first context and its number of turns; every turn resends the whole
    context, then appends the response (``response`` tokens, a range) and an observation (``observation``
    tokens), as a harness does; ``tool_s(rng)``, if given, is the wait for the tool before the observation. A
    system with sessions is told when a trajectory ends (``close``), as the driver tells the balancer with
    CloseSession."""
    send, close = target.send, getattr(target, "close", None)
    result = Result()
    left = list(range(trajectories))

    async def worker() -> None:
        while left:
            t = left.pop()
            rng = random.Random(seed * 1000 + t)
            context, turns = opening(rng)
            began = time.perf_counter()
            for turn in range(turns):
                call = Call(f"{tag}{t}-{turn}", list(context), rng.randint(*response), session=f"{tag}{t}")
                ok = await send(call)
                _count(result, call, ok)
                if not ok:
                    break
                result.latencies.append(call.seconds)
                if tool_s is not None and turn + 1 < turns:
                    await asyncio.sleep(tool_s(rng))
                context += call.output + [rng.randrange(2, 32000) for _ in range(rng.randint(*observation))]
            else:
                result.trajectories.append(time.perf_counter() - began)
            if close is not None:
                await close(f"{tag}{t}")   # the trajectory ended, as the driver says with CloseSession

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall = time.perf_counter() - started
    return result


def _count(result: Result, call: Call, ok: bool) -> None:
    if not ok:
        result.failed += 1
        return
    result.tokens += len(call.output)
    result.prompt_tokens += len(call.prompt)
    result.cached_tokens += call.cached
