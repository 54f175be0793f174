"""The torch engine's prefix cache on CPU: per-turn prefill of agentic trajectories and GRPO groups, with and
without reuse, in one run.

Model: the ``small-llama`` preset (4.5 M parameters, 2,048 positions), one thread per engine. Workloads:

* trajectories: 4 concurrent trajectories of 6 turns; each starts from its own prompt of 400-700 tokens,
  each turn generates 48 tokens and appends a 64-token tool response (different per trajectory and turn),
  every turn with the trajectory's session id; measured: each turn's time to first token (the prefill of
  its context) and the whole run;
* GRPO groups: 6 prompts of 600-1,000 tokens, each sent 8 times at once (a group), 32 tokens out;
  measured: the groups' wall time and the time to the first token.

    .venv/bin/python -m benchmarks.bench_prefix_reuse
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from replica_agent.engines import create_engine
from replica_agent.engines.types import EngineRequest, SamplingParams


async def first_and_all(engine, rid: str, prompt: list[int], max_tokens: int, session: str = ""):
    start = time.perf_counter()
    first, ids = None, []
    async for chunk in engine.generate(EngineRequest(rid, prompt, SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=hash(rid) % 1000, ignore_eos=True),
            stream_interval=1, session_id=session)):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
        ids += chunk.token_ids
    return first, ids


async def trajectories(engine, rng: random.Random):
    ttft: dict[int, list[float]] = {}

    async def one(t: int) -> None:
        context = [rng.randint(10, 4000) for _ in range(rng.randint(400, 700))]
        for turn in range(6):
            first, ids = await first_and_all(engine, f"t{t}-{turn}", context, 48, session=f"traj-{t}")
            ttft.setdefault(turn, []).append(first)
            context = context + ids + [rng.randint(10, 4000) for _ in range(64)]
        await engine.close_session(f"traj-{t}")

    start = time.perf_counter()
    await asyncio.gather(*(one(t) for t in range(4)))
    return time.perf_counter() - start, ttft


async def groups(engine, rng: random.Random):
    firsts = []
    start = time.perf_counter()
    for g in range(6):
        prompt = [rng.randint(10, 4000) for _ in range(rng.randint(600, 1000))]
        results = await asyncio.gather(*(first_and_all(engine, f"g{g}-{i}", prompt, 32) for i in range(8)))
        firsts += [f for f, _ in results]
    return time.perf_counter() - start, firsts


async def main() -> None:
    rows = {}
    for label, tokens in (("no reuse", 0), ("prefix cache", 65536)):
        engine = create_engine("torch", preset="small-llama", seed=0, prefix_cache_tokens=tokens, num_threads=1,
                               max_batch_size=64)
        await engine.start()
        try:
            await first_and_all(engine, "warm", list(range(10, 200)), 4)
            wall_t, ttft = await trajectories(engine, random.Random(1))
            wall_g, firsts = await groups(engine, random.Random(2))
            rows[label] = (wall_t, ttft, wall_g, firsts, engine.prefix_stats())
        finally:
            await engine.close()
    print("time to first token per turn (median of 4 trajectories, ms):")
    print(f"{'turn':<6}" + "".join(f"{label:>16}" for label in rows))
    for turn in range(6):
        print(f"{turn + 1:<6}" + "".join(f"{statistics.median(r[1][turn]) * 1000:>16.1f}" for r in rows.values()))
    for label, (wall_t, _, wall_g, firsts, stats) in rows.items():
        hit = f", hit {stats.hit_tokens / max(1, stats.lookup_tokens):.0%} of looked-up tokens" if stats else ""
        print(f"{label}: trajectories {wall_t:.2f} s; GRPO groups {wall_g:.2f} s, time to first token p50 "
              f"{statistics.median(firsts) * 1000:.0f} ms{hit}")


if __name__ == "__main__":
    asyncio.run(main())
