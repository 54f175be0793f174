"""Coalesced streams through the balancer, on the virtual clock: an attempt that breaks at any point relative
to a flush (an abort, a killed replica, a frozen one) still yields exactly the tokens an unbroken run would,
ending at exactly ``max_tokens``, once; streaming and ``final_only`` callers get the same result.

The fake replica streams chunks of ``CHUNK`` tokens as an agent does (:mod:`replica_agent.engines.chunking`):
tokens it generated but had not flushed when it was killed or froze never reach the balancer and are
regenerated elsewhere; an abort's final message carries them.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from loadbalancer.config import LoadBalancerConfig
from loadbalancer.service import build_balancer
from mesh_runtime.config import load_config
from mesh_runtime.errors import ResourceExhausted
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2 as replica_pb
from simulator.vloop import run_virtual
from tests.loadbalancer.test_balancer_virtual_time import Call, Idle

pytestmark = pytest.mark.timeout(120)
PER_TOKEN_S = 0.01
CHUNK = 4
MAX_TOKENS = 11


class ChunkingUpstreams:
    """Replica ``a`` breaks (``mode``) once it has generated ``break_at`` tokens; ``b`` always finishes."""

    def __init__(self, mode: str, break_at: int) -> None:
        self.mode, self.break_at = mode, break_at
        self.requests: list[tuple[str, replica_pb.GenerateRequest]] = []

    def generate(self, route, request, timeout_s):
        self.requests.append((route.replica_id, request))
        return Call(self._stream(route.replica_id, request))

    async def abort(self, route, request_ids):
        return list(request_ids)

    async def _stream(self, replica_id: str, request):
        position = sum(len(s.token_ids) for s in request.resume_segments)
        mine = generation_pb2.TokenSegment(replica_id=replica_id, weight_version=1)
        pending: list[int] = []
        breaks = replica_id == "a"
        while True:
            if breaks and len(mine.token_ids) == self.break_at:
                if self.mode == "abort":   # the abort's reply: the unflushed tokens and every segment
                    yield replica_pb.GenerateResponse(
                        request_id=request.request_id, token_ids=pending, weight_version=1,
                        finish_reason=generation_pb2.FINISH_REASON_ABORTED,
                        segments=[*request.resume_segments, mine])
                    return
                if self.mode == "kill":
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                               grpc.aio.Metadata(), "connection reset")
                await asyncio.Event().wait()   # frozen
            await asyncio.sleep(PER_TOKEN_S)
            token = 1000 + position
            position += 1
            mine.token_ids.append(token)
            pending.append(token)
            if position == request.sampling_params.max_tokens:
                yield replica_pb.GenerateResponse(request_id=request.request_id, token_ids=pending, weight_version=1,
                                                  finish_reason=generation_pb2.FINISH_REASON_LENGTH,
                                                  segments=[*request.resume_segments, mine])
                return
            if len(pending) == CHUNK:
                yield replica_pb.GenerateResponse(request_id=request.request_id, token_ids=pending, weight_version=1)
                pending = []


def balancer(upstreams: ChunkingUpstreams):
    cfg = load_config(LoadBalancerConfig, None, overrides={
        "replicas": [{"replica_id": r, "address": f"{r}:1"} for r in ("a", "b")], "stall_timeout_s": 30.0,
        "retry_initial_backoff_s": 0.01, "retry_max_backoff_s": 0.01})
    lb = build_balancer(cfg, None)
    clock = asyncio.get_running_loop().time
    lb.upstreams, lb.clock, lb.table.clock = upstreams, clock, clock
    return lb


async def run(lb, request_id: str, *, final_only: bool, caller: str = "iterator"):
    """The messages a caller gets: ``iterator`` reads ``Balancer.generate`` (GenerateMany, the HTTP front),
    ``writer`` is what a Generate call gets (``Balancer.serve`` writing each message)."""
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], final_only=final_only,
                                 sampling_params=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    if caller == "iterator":
        return [msg async for msg in lb.generate(request, None)]
    messages = []

    async def write(msg):
        messages.append(msg)
        await asyncio.sleep(0)   # a write gives the loop a turn, as gRPC's does

    await lb.serve(request, None, write)
    return messages


@pytest.mark.parametrize("caller", ["iterator", "writer"])
@pytest.mark.parametrize("mode", ["abort", "kill", "freeze"])
@pytest.mark.parametrize("final_only", [False, True])
def test_a_break_at_any_point_of_a_chunk_yields_exactly_the_unbroken_result_once(mode, final_only, caller):
    expected = [1000 + i for i in range(MAX_TOKENS)]
    for break_at in range(MAX_TOKENS):   # 0 .. MAX_TOKENS-1 tokens generated on a: on, before and after flushes
        async def scenario():
            upstreams = ChunkingUpstreams(mode, break_at)
            lb = balancer(upstreams)
            lb.table.pick = _first_a_then_b(lb.table.pick)
            messages = await run(lb, f"r-{mode}-{break_at}", final_only=final_only, caller=caller)
            repeat = await run(lb, f"r-{mode}-{break_at}", final_only=final_only, caller=caller)
            return upstreams, messages, repeat

        upstreams, messages, repeat = run_virtual(Idle(), scenario())
        final = messages[-1]
        where = f"{mode} after {break_at} tokens"
        assert [s for seg in final.segments for s in seg.token_ids] == expected, where
        assert final.usage.completion_tokens == MAX_TOKENS and final.finish_reason == generation_pb2.FINISH_REASON_LENGTH
        if final_only:
            assert len(messages) == 1 and list(final.token_ids) == expected, where
        else:
            streamed = [t for msg in messages for t in msg.token_ids]
            assert streamed == expected, where
            assert all(len(m.token_ids) <= CHUNK for m in messages[:-1]), where
        # what the second attempt was given: every token the balancer received from a (a killed or frozen
        # replica's unflushed tokens were lost and are regenerated by b)
        received = break_at if mode == "abort" else break_at - break_at % CHUNK
        assert [r for r, _ in upstreams.requests] == ["a", "b"], where
        resumed = upstreams.requests[1][1].resume_segments
        assert [t for seg in resumed for t in seg.token_ids] == expected[:received], where
        assert [a.replica_id for a in final.attempts] == ["a", "b"], where
        # a repeat of the id is answered from the record: the same tokens, nothing generated again
        assert len(repeat) == 1 and list(repeat[0].token_ids) == expected and len(upstreams.requests) == 2, where


def _first_a_then_b(pick):
    """The first attempt goes to ``a``, every later one to ``b`` (the table's own pick, the other avoided)."""
    picks = []

    def choose(request_id, *, avoid, **kw):
        picks.append(request_id)
        other = "b" if len(picks) == 1 else "a"
        return pick(request_id, avoid=avoid | {other}, **kw)
    return choose


@pytest.mark.parametrize("caller", ["iterator", "writer"])
def test_final_only_and_streaming_callers_get_the_same_result(caller):
    async def scenario():
        upstreams = ChunkingUpstreams("none", -1)
        lb = balancer(upstreams)
        streamed = await run(lb, "s", final_only=False, caller=caller)
        final_only = await run(lb, "f", final_only=True, caller=caller)
        return streamed, final_only

    streamed, final_only = run_virtual(Idle(), scenario())
    assert len(streamed) == -(-MAX_TOKENS // CHUNK) and len(final_only) == 1
    assert [t for m in streamed for t in m.token_ids] == list(final_only[0].token_ids)
    assert [list(seg.token_ids) for seg in streamed[-1].segments] == \
        [list(seg.token_ids) for seg in final_only[0].segments]
    assert streamed[-1].usage == final_only[0].usage and streamed[-1].finish_reason == final_only[0].finish_reason


@pytest.mark.parametrize("caller", ["iterator", "writer"])
def test_tokens_an_abort_returned_reach_the_caller_before_the_request_fails(caller):
    """Replica ``a`` aborts after 5 tokens (its reply carries the fifth, unflushed) and the request may not
    be retried (``retry_budget`` 0): the caller gets every token that came back, then the error."""
    async def scenario():
        lb = balancer(ChunkingUpstreams("abort", 5))
        lb.table.pick = _first_a_then_b(lb.table.pick)
        request = pb.GenerateRequest(request_id="once", prompt_token_ids=[1, 2, 3], retry_budget=0,
                                     sampling_params=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS))
        messages = []
        try:
            if caller == "iterator":
                async for msg in lb.generate(request, None):
                    messages.append(msg)
            else:
                async def write(msg):
                    messages.append(msg)
                await lb.serve(request, None, write)
        except Exception as exc:  # noqa: BLE001 - what the caller sees
            return messages, exc
        return messages, None

    messages, error = run_virtual(Idle(), scenario())
    assert [list(m.token_ids) for m in messages] == [[1000, 1001, 1002, 1003], [1004]]
    assert isinstance(error, ResourceExhausted) and "retry budget of 0" in str(error)
