"""How every rollmesh server process runs: on uvloop, with the garbage collector set for a long-lived server.

Measured with ``benchmarks/bench_vs_smg.py`` on this project's 2-core machine (two runs each, balancer and
agents as processes): the stock asyncio loop and collector cost the balancer 0.81-0.82 ms of CPU per short
request and 4.35-4.50 ms per 1,000 streamed tokens; uvloop alone 0.77-0.79 ms and 3.97-4.12 ms; uvloop with
the collector below 0.68-0.70 ms and 3.81-4.20 ms (agents: 0.77-0.78 -> 0.68-0.70 ms per request). A native
profile had the collector at about 3% of the balancer's CPU: a server allocates a few objects per message,
so the default young-generation threshold (700) ran a collection every few requests, each scanning
everything loaded at start-up again.

* The loop: uvloop (libuv, in C) unless ``ROLLMESH_EVENT_LOOP=asyncio`` asks for the standard library's, to
  rule uvloop out when chasing a problem.
* The collector: what exists once the server is built (modules, descriptors, configuration) is frozen out of
  collection (:func:`gc.freeze`), and the young generation holds :data:`GC_THRESHOLDS` ``[0]`` allocations
  before it is collected. Reference counting frees almost everything at once regardless; the thresholds
  only decide how often cycles are looked for.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

EVENT_LOOP_VARIABLE = "ROLLMESH_EVENT_LOOP"
LOOPS = ("uvloop", "asyncio")
"""The values :data:`EVENT_LOOP_VARIABLE` may take; the first is the default."""
GC_THRESHOLDS = (50_000, 50, 100)
""":func:`gc.set_threshold` for servers (Python's default: 700, 10, 10)."""


def loop_choice(env: Mapping[str, str]) -> str:
    """The event loop ``env`` asks for; ValueError naming the variable for anything else."""
    choice = env.get(EVENT_LOOP_VARIABLE) or LOOPS[0]
    if choice not in LOOPS:
        raise ValueError(f"{EVENT_LOOP_VARIABLE} must be one of {', '.join(LOOPS)}, got {choice[:20]!r}")
    return choice


def tune_gc() -> None:
    """Freeze what exists now out of collection and collect the young generation less often."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run(main: Coroutine[Any, Any, T], env: Mapping[str, str]) -> T:
    """Run a server's ``main`` to completion on the loop ``env`` asks for (:func:`loop_choice`), the collector
    tuned (:func:`tune_gc`)."""
    try:
        choice = loop_choice(env)
    except ValueError:
        main.close()   # never started: no "never awaited" warning on top of the error
        raise
    tune_gc()
    if choice == "asyncio":
        return asyncio.run(main)
    import uvloop  # noqa: PLC0415 - loaded by the processes that run a server, not by every importer

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
