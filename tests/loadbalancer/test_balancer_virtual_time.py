"""The balancer's timing behaviour on the simulator's virtual clock: minutes of waiting in milliseconds.

The real :class:`~loadbalancer.balancer.Balancer` and routing table run on
:class:`simulator.vloop.VirtualTimeLoop` against in-process fake upstreams (no
sockets), whose tokens take virtual seconds. Stall timeouts, outlier
ejections, waits for a replica and deadlines are configured as they are in
production (tens of seconds), and the tests assert the virtual time at which
each thing happened: exactly, since no real time passes.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from loadbalancer.config import LoadBalancerConfig
from loadbalancer.service import build_balancer
from loadbalancer.table import Route
from mesh_runtime.config import load_config
from mesh_runtime.errors import DeadlineExceeded
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb
from rollmesh.loadbalancer.v1 import routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as replica_pb
from simulator.vloop import run_virtual

pytestmark = pytest.mark.timeout(60)
PER_TOKEN_S = 0.5


class Idle:
    """A world with no events of its own: the loop's clock only moves when every task waits on a timer."""

    now = 0.0

    def run_until(self, limit: float) -> bool:
        return False


class Call:
    """What a gRPC stream call looks like to the balancer: an async iterator it can cancel; as with a real
    call, a read pending or made after ``cancel()`` raises ``asyncio.CancelledError``."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._read: asyncio.Future | None = None
        self._cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._cancelled:
            raise asyncio.CancelledError
        self._read = asyncio.ensure_future(self._stream.__anext__())
        return await self._read

    def cancel(self) -> None:
        self._cancelled = True
        if self._read is not None:
            self._read.cancel()


class Upstreams:
    """Replicas by behaviour: ``ok`` (a token every PER_TOKEN_S), ``stall`` (nothing, ever), ``down``
    (UNAVAILABLE at once); ``modes`` may change while the test runs."""

    def __init__(self, modes: dict[str, str]) -> None:
        self.modes = modes
        self.calls: list[tuple[float, str]] = []

    def generate(self, route, request, timeout_s):
        self.calls.append((asyncio.get_running_loop().time(), route.replica_id))
        return Call(self._stream(route.replica_id, request, self.modes[route.replica_id]))

    async def abort(self, route, request_ids):
        return list(request_ids)

    async def _stream(self, replica_id: str, request, mode: str):
        if mode == "down":
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       f"failed to connect to {replica_id}")
        if mode == "stall":
            await asyncio.Event().wait()
        position = sum(len(s.token_ids) for s in request.resume_segments)
        mine = generation_pb2.TokenSegment(replica_id=replica_id)
        while position < request.sampling_params.max_tokens:
            await asyncio.sleep(PER_TOKEN_S)
            token = 1000 + position
            position += 1
            mine.token_ids.append(token)
            msg = replica_pb.GenerateResponse(request_id=request.request_id, token_ids=[token])
            if position == request.sampling_params.max_tokens:
                msg.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                msg.segments.extend([*request.resume_segments, mine])
            yield msg


def balancer(modes: dict[str, str], **config):
    cfg = load_config(LoadBalancerConfig, None, overrides={
        "replicas": [{"replica_id": r, "address": f"{r}:1"} for r in modes], **config})
    lb = build_balancer(cfg, None)
    clock = asyncio.get_running_loop().time
    lb.upstreams, lb.clock, lb.table.clock = Upstreams(modes), clock, clock
    return lb


async def generate(lb, request_id: str, max_tokens: int, time_remaining: float | None = None):
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                                 sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens))
    tokens, last = [], None
    async for msg in lb.generate(request, time_remaining):
        tokens = [] if msg.restarted else tokens
        tokens += msg.token_ids
        last = msg
    return tokens, last


def test_a_frozen_stream_is_given_up_after_stall_timeout_s_and_resumed_elsewhere_with_its_prefix():
    async def scenario():
        lb = balancer({"frozen": "ok"}, stall_timeout_s=120.0, retry_initial_backoff_s=0.05,
                      retry_max_backoff_s=0.05)
        original = lb.upstreams._stream

        async def stream(replica_id, request, mode):
            async for msg in original(replica_id, request, mode):
                yield msg
                if replica_id == "frozen" and msg.token_ids[-1] >= 1002:   # three tokens, then silence
                    await asyncio.Event().wait()

        lb.upstreams._stream = stream
        lb.upstreams.modes["b"] = "ok"
        request = asyncio.ensure_future(generate(lb, "r2", 8))
        await asyncio.sleep(3 * PER_TOKEN_S + 1.0)
        lb.table.add([Route("b", "b:1")])   # a second replica joins while the first is frozen
        return await request, asyncio.get_running_loop().time()

    (tokens, last), ended = run_virtual(Idle(), scenario())
    assert tokens == [1000 + i for i in range(8)]
    assert [a.replica_id for a in last.attempts] == ["frozen", "b"]
    assert "stall_timeout_s" in last.attempts[0].reason and last.attempts[1].outcome == routing_pb2.ATTEMPT_OUTCOME_COMPLETED
    # 3 tokens, 120 s without a message, the retry's jittered backoff (at most 0.05 s), the other 5 tokens on b,
    # resumed after the prefix
    expected = 3 * PER_TOKEN_S + 120.0 + 5 * PER_TOKEN_S
    assert expected <= ended <= expected + 0.05
    assert [(s.replica_id, len(s.token_ids)) for s in last.segments] == [("frozen", 3), ("b", 5)]


def test_a_caller_that_reads_slowly_is_not_taken_for_a_stalled_replica():
    """``serve`` writes each chunk at the attempt loop's await point: while the caller takes 300 s to take
    one (longer than stall_timeout_s), the attempt waits for it, is not cut, and the stall watch resumes
    after; the replica's own later silence is still caught."""
    async def scenario():
        lb = balancer({"only": "ok"}, stall_timeout_s=120.0)
        loop, written = asyncio.get_running_loop(), []

        async def write(msg):
            written.append((loop.time(), msg))
            if len(written) == 2:
                await asyncio.sleep(300.0)

        request = pb.GenerateRequest(request_id="slow", prompt_token_ids=[1, 2, 3],
                                     sampling_params=generation_pb2.SamplingParams(max_tokens=6))
        await lb.serve(request, None, write)
        return written, loop.time()

    written, ended = run_virtual(Idle(), scenario())
    last = written[-1][1]
    assert [m.token_ids[0] for _, m in written[:-1]] == [1000, 1001, 1002, 1003, 1004]
    assert list(last.token_ids) == [1005] and last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert [(a.replica_id, a.outcome) for a in last.attempts] == [("only", routing_pb2.ATTEMPT_OUTCOME_COMPLETED)]
    # the fake replica makes a token when it is read: the attempt reads on once the caller took the second
    assert written[2][0] == pytest.approx(3 * PER_TOKEN_S + 300.0)
    assert ended == pytest.approx(6 * PER_TOKEN_S + 300.0)


def test_an_ejected_replica_gets_no_picks_until_its_ejection_ends_then_gets_them_again():
    async def scenario():
        lb = balancer({"flaky": "down", "ok": "ok"}, outlier_detection={
            "consecutive_failures": 2, "base_ejection_s": 30.0, "max_ejection_percent": 50.0},
            retry_initial_backoff_s=0.01, retry_max_backoff_s=0.01)
        loop, flaky = asyncio.get_running_loop(), lb.table.routes["flaky"]
        i = 0
        while not flaky.breaker.ejected_until:   # least-loaded ties alternate: flaky is tried until it is ejected
            await generate(lb, f"e{i}", 2)
            i += 1
        ejected_at, until = loop.time(), flaky.breaker.ejected_until
        lb.upstreams.modes["flaky"] = "ok"   # it recovers at once, but stays out until its ejection ends
        while loop.time() < until - 2:
            await generate(lb, f"during{i}", 2)
            i += 1
        await asyncio.sleep(until - loop.time())
        for j in range(4):
            await generate(lb, f"back{j}", 2)
        flaky_calls = [t for t, r in lb.upstreams.calls if r == "flaky"]
        return ejected_at, until, flaky_calls, flaky

    ejected_at, until, flaky_calls, flaky = run_virtual(Idle(), scenario())
    failures = [t for t in flaky_calls if t <= ejected_at]
    assert len(failures) == 2                                              # the two that ejected it ...
    assert until == pytest.approx(failures[-1] + 30.0, abs=0.01)           # ... for base_ejection_s from the 2nd
    assert not [t for t in flaky_calls if ejected_at < t < until]          # none while ejected
    assert [t for t in flaky_calls if t >= until]                          # picked again afterwards
    assert flaky.breaker.consecutive_failures == 0 and flaky.completed >= 1 and flaky.breaker.ejected_until == 0


def test_a_request_without_a_replica_waits_until_its_deadline():
    async def scenario():
        lb = balancer({}, no_replica_wait_s=600.0)
        try:
            await generate(lb, "patient", 4, time_remaining=90.0)
        except DeadlineExceeded as err:
            return str(err), asyncio.get_running_loop().time(), lb.stats.no_replica_waits
        raise AssertionError("no deadline")

    message, ended, waits = run_virtual(Idle(), scenario())
    assert "deadline passed while waiting for a replica" in message
    assert ended == pytest.approx(90.0, abs=0.05) and waits == 1
