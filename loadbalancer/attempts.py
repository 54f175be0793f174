"""One request's run across its attempts: its state, how an attempt ends, and the balancer's timings.

:class:`RequestRun` is what the balancer keeps per request (segments so far,
attempts, replicas to avoid, the budget and deadline). An attempt that goes on
elsewhere ends with :class:`RetryAttempt` (``backoff`` for a failure, none for
an abort); :class:`AttemptCut` is an attempt the balancer ended itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import trace

from mesh_runtime.durations import set_seconds
from mesh_runtime.errors import error_info
from mesh_runtime.metrics import ServerMetrics
from mesh_runtime.retry import RetryPolicy
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2

from .prefix_index import PromptKeys
from .table import Route, Ticket

AgentCall = grpc.aio.UnaryStreamCall
"""An attempt's Generate call on an agent (its messages, ``cancel()``)."""


class Outbox:
    """A request's messages on their way to its caller: ``put`` queues one (synchronously, from anywhere in
    the attempt loop) and ``drain`` writes what is queued, in order, at the loop's await points. The Generate
    servicer drains straight into its call's ``write``: no task and no queue of its own per request."""

    __slots__ = ("_write", "_pending", "_first_token")

    def __init__(self, write: Callable[[loadbalancer_pb2.GenerateResponse], Awaitable[object]],
                 first_token: Callable[[], None] | None = None) -> None:
        """``first_token()`` is called once, as the first message with tokens is written."""
        self._write = write
        self._pending: list[loadbalancer_pb2.GenerateResponse] = []
        self._first_token = first_token

    def put(self, message: loadbalancer_pb2.GenerateResponse) -> None:
        self._pending.append(message)

    async def drain(self) -> None:
        while self._pending:
            pending, self._pending = self._pending, []
            for message in pending:
                if self._first_token is not None and message.token_ids:
                    self._first_token()
                    self._first_token = None
                await self._write(message)


_DONE = object()


async def as_iterator(serve: Callable[[Callable[[loadbalancer_pb2.GenerateResponse], Awaitable[object]]],
                                      Awaitable[None]]) -> AsyncIterator[loadbalancer_pb2.GenerateResponse]:
    """The messages ``serve(write)`` writes, as an async iterator: it runs in a task of its own that feeds a
    queue; its error is raised after the messages before it; closing the iterator cancels the task."""
    queue: asyncio.Queue = asyncio.Queue()

    async def put(message: loadbalancer_pb2.GenerateResponse) -> None:
        queue.put_nowait(message)

    async def run() -> None:
        try:
            await serve(put)
            queue.put_nowait(_DONE)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc)

    task = asyncio.get_running_loop().create_task(run())
    try:
        while (item := await queue.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()


def error_reason(err: grpc.aio.AioRpcError) -> str:
    info = error_info(err)
    return info.reason if info is not None else ""


class Timing:
    """The balancer's histograms (what takes time); its counters are :class:`Stats`."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.request = metrics.histogram("rollmesh_lb_request_duration_seconds",
                                         "Time from a generation request's arrival to its last message, by outcome",
                                         ("outcome",))
        self.ttft = metrics.histogram("rollmesh_lb_time_to_first_token_seconds",
                                      "Time from a generation request's arrival to its first token to the caller")
        self.attempt = metrics.histogram("rollmesh_lb_attempt_duration_seconds",
                                         "Duration of one replica attempt of a request, by how it ended "
                                         "(completed, aborted, unavailable, failed)", ("outcome",))


class AttemptCut(Exception):
    """The balancer ended an attempt itself: no message for stall_timeout_s, or its replica was removed
    from routing with abort (a move, like a replica-side abort: recorded ABORTED, resumed at once)."""

    def __init__(self, why: str, *, removed: bool) -> None:
        super().__init__(why)
        self.removed = removed


class RetryAttempt(Exception):
    """An attempt ended without a result; the request goes on elsewhere."""

    def __init__(self, why: str, *, backoff: bool, refused: bool = False) -> None:
        super().__init__(why)
        self.backoff = backoff
        self.refused = refused   # the replica is alive but not serving (REPLICA_NOT_SERVING)


def attempt_ended(span: trace.Span, record: routing_pb2.Attempt, retry: RetryAttempt) -> None:
    """How an attempt that goes on elsewhere ends on its span: an abort (weight sync, rebalance, drain,
    removal) or a refusal by a replica that is not serving is an event with its reason; a failure is an
    error."""
    outcome = routing_pb2.AttemptOutcome.Name(record.outcome).removeprefix("ATTEMPT_OUTCOME_")
    span.set_attribute("rollmesh.outcome", outcome)
    if record.outcome == routing_pb2.ATTEMPT_OUTCOME_ABORTED:
        span.add_event("attempt.aborted", {"rollmesh.reason": record.reason})
    elif retry.refused:
        span.add_event("attempt.refused", {"rollmesh.reason": record.reason})
    else:
        span.set_status(trace.Status(trace.StatusCode.ERROR, record.reason[:300]))


def backoff_s(retry: RetryAttempt, tries: int, policy: RetryPolicy, remaining_s: float | None) -> float:
    """The wait before the next attempt: none after an abort; after a failure, the balancer's retry policy's
    (jittered exponential, ``tries`` so far), within the ``remaining_s`` of the deadline.

    The attempt loop itself stays a plain loop (its tries interleave with the budget, the deadline and the
    replica choice), and a request that needs one attempt pays nothing for retries: run through
    :class:`~mesh_runtime.retry.RetryPolicy` (tenacity) a call that succeeds at once costs 24 us of CPU
    against 0.9 us for the plain loop (``benchmarks/bench_retry_overhead.py``), 4.7% of the balancer's CPU
    per short request on Generate and 11% on GenerateMany."""
    if not retry.backoff:
        return 0.0
    delay = policy.delay(tries)
    return delay if remaining_s is None else max(0.0, min(delay, remaining_s))


def now_ts() -> Timestamp:
    """Now (what Timestamp.GetCurrentTime gives, without its detour through datetime)."""
    return set_seconds(Timestamp(), time.time())


@dataclass
class RequestRun:
    """The state of one request across its attempts."""

    request: loadbalancer_pb2.GenerateRequest
    partial_rollout: bool
    budget: int
    deadline: float | None
    segments: list[generation_pb2.TokenSegment] = field(default_factory=list)
    attempts: list[routing_pb2.Attempt] = field(default_factory=list)
    avoid: frozenset[str] = frozenset()
    failed_on: frozenset[str] = frozenset()
    """Replicas an attempt of this request failed on (UNAVAILABLE, broken stream): later attempts avoid them
    while another eligible replica exists."""
    restart_pending: bool = False
    hold_kv_s: float = 0.0
    """How long its replica holds the session's KV after it ends (the caller's expected_pause, else the
    balancer's estimate)."""
    prefix_keys: PromptKeys | None = None
    """The prompt's keys for a prefix-aware balancer, made at its first pick (computed per block size once)."""
    clock: Callable[[], float] = time.monotonic
    """The balancer's clock, which ``deadline`` is on."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.clock()


def token_count(streamed: list[replica_agent_pb2.GenerateResponse]) -> int:
    return sum(len(msg.token_ids) for msg in streamed)


def segments_of(streamed: list[replica_agent_pb2.GenerateResponse],
                route: Route) -> list[generation_pb2.TokenSegment]:
    """Token segments (one per weight version) from the messages of a broken attempt."""
    out: list[generation_pb2.TokenSegment] = []
    for msg in streamed:
        if not out or out[-1].weight_version != msg.weight_version:
            out.append(generation_pb2.TokenSegment(weight_version=msg.weight_version, replica_id=route.replica_id,
                                                   node_id=route.node_id))
        out[-1].token_ids.extend(msg.token_ids)
        out[-1].logprobs.extend(msg.logprobs)
    return out


class Watch:
    """Ends an attempt's upstream call when the balancer cuts the attempt: its replica was removed with abort
    (:meth:`Ticket.cut`), or no message came for ``stall_timeout_s``. It costs one timer per stall period and
    a clock read per message, instead of a future per message."""

    def __init__(self, ticket: Ticket, call: AgentCall, stall_s: float) -> None:
        self._ticket, self._call, self._stall_s = ticket, call, stall_s
        self._loop = asyncio.get_running_loop()
        self.last = self._loop.time()
        self.paused = False
        self._why: AttemptCut | None = None
        self._timer = self._loop.call_later(stall_s, self._check)
        ticket.on_cut = self._removed
        if ticket.cut_reason:
            self._removed(ticket.cut_reason)

    def heard(self) -> None:
        """A message arrived (or the caller took the last one: see :meth:`pause`)."""
        self.last = self._loop.time()
        self.paused = False

    def pause(self) -> None:
        """The attempt waits for its caller to take a message: no stall is counted until :meth:`heard`."""
        self.paused = True

    def _check(self) -> None:
        if self.paused:
            self._timer = self._loop.call_later(self._stall_s, self._check)
            return
        idle = self._loop.time() - self.last
        if idle >= self._stall_s:
            self._end(AttemptCut(f"no message for {self._stall_s:g} s (stall_timeout_s)", removed=False))
        else:
            self._timer = self._loop.call_later(self._stall_s - idle, self._check)

    def _removed(self, reason: str) -> None:
        self._end(AttemptCut(reason, removed=True))

    def _end(self, cut: AttemptCut) -> None:
        if self._why is None:
            self._why = cut
            self._call.cancel()

    def cut(self) -> AttemptCut | None:
        """Why the watch ended the call, when a cancellation came from it (None: the request's own task is
        being cancelled, e.g. its caller went away)."""
        task = asyncio.current_task()
        if self._why is None or (task is not None and task.cancelling()):
            return None
        return self._why

    def stop(self) -> None:
        self._timer.cancel()
        self._ticket.on_cut = None


def whole_result(final: loadbalancer_pb2.GenerateResponse, caller_resumed: int) -> loadbalancer_pb2.GenerateResponse:
    """The final message with every token this call generated in ``token_ids`` (the caller's resumed
    tokens left out): the answer of a final-only call and of a repeated request id."""
    whole = loadbalancer_pb2.GenerateResponse()
    whole.CopyFrom(final)
    whole.ClearField("token_ids")
    whole.ClearField("logprobs")
    whole.ClearField("restarted")
    for segment in final.segments:
        whole.token_ids.extend(segment.token_ids)
        whole.logprobs.extend(segment.logprobs)
    if caller_resumed:
        del whole.token_ids[:caller_resumed]
        del whole.logprobs[:min(caller_resumed, len(whole.logprobs))]
    return whole


def cut_all(tickets: list[Ticket], why: str) -> None:
    """Cut every ticket's attempt (a removal with abort, after its grace)."""
    for ticket in tickets:
        ticket.cut(why)
