"""What running a call through tenacity costs, against a plain loop, where the call succeeds at once (the
balancer's attempt loop: nearly every request needs one attempt).

Each way runs the same coroutine (an awaited no-op, as an attempt that returns) ``--calls`` times on one event
loop (uvloop, as the servers run); printed: microseconds per call, and the difference as a share of the
balancer's CPU per short request (``--request-ms``, bench_vs_smg's figure).

    .venv/bin/python -m benchmarks.bench_retry_overhead [--calls 200000] [--request-ms 0.49]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop

from mesh_runtime.retry import RetryPolicy


async def attempt() -> int:
    await asyncio.sleep(0)
    return 1


async def plain(calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        tries = 0
        while True:
            tries += 1
            try:
                await attempt()
                break
            except ConnectionError:
                if tries > 3:
                    raise
    return time.process_time() - start


async def with_tenacity(calls: int) -> float:
    policy = RetryPolicy(initial_s=0.05, max_s=1.0, jitter=(0.5, 1.0), max_attempts=4)
    start = time.process_time()
    for _ in range(calls):
        await policy.run(attempt, retry_if=lambda err: isinstance(err, ConnectionError))
    return time.process_time() - start


async def main(calls: int, request_ms: float) -> None:
    await plain(1000)
    await with_tenacity(1000)
    base = await plain(calls)
    run = await with_tenacity(calls)
    per_base, per_run = base / calls * 1e6, run / calls * 1e6
    print(f"plain loop:           {per_base:7.2f} us per call (CPU)")
    print(f"RetryPolicy.run:      {per_run:7.2f} us per call (CPU)")
    print(f"tenacity adds {per_run - per_base:.2f} us per call: {(per_run - per_base) / (request_ms * 1000):.1%} of "
          f"the balancer's {request_ms} ms per short request")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--request-ms", type=float, default=0.49)
    args = parser.parse_args()
    uvloop.run(main(args.calls, args.request_ms))
