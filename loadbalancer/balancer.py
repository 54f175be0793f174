"""Runs generation requests through the mesh: route, stream, retry and resume.

A Generate call's request runs in the call's own task, which writes the
caller's stream at the attempt loop's await points (``GenerateMany`` and the
HTTP front read it as an iterator fed by a task of its own), so cancelling
the call cancels the upstream call. Attempts run in one loop per request: an aborted attempt resumes at once on
another replica (with the tokens so far as prefix when partial rollout is on,
from scratch otherwise), an unavailable replica is retried with jittered
exponential backoff, and the whole is bounded by the retry budget and the
request's deadline. One request id has at most one run in flight, and a
recently completed one is answered from its record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import grpc
from opentelemetry import trace

from mesh_runtime.errors import (
    AlreadyExists, DeadlineExceeded, Internal, InvalidArgument, ResourceExhausted, Unavailable,
)
from mesh_runtime.generation import check_duration, check_generation, check_streaming
from mesh_runtime import tracing
from mesh_runtime.durations import set_seconds
from mesh_runtime.metrics import ServerMetrics
from mesh_runtime.reasons import Reason
from mesh_runtime.retry import RetryPolicy, retry_elsewhere
from mesh_runtime.validate import check_session_id
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2, routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2

from .attempts import (
    Outbox,
    RequestRun,
    RetryAttempt,
    Timing,
    Watch,
    as_iterator,
    attempt_ended,
    backoff_s,
    error_reason,
    now_ts,
    segments_of,
    token_count,
    whole_result,
)
from .completed import CompletedCache
from .control import FleetControl
from .pauses import PauseEstimator
from .programs import ProgramAdmission
from .config import LoadBalancerConfig
from .stats import Stats
from .table import Choice, Route, RoutingTable, Ticket
from .upstreams import Upstreams

AgentMessage = replica_agent_pb2.GenerateResponse
Emit = Callable[[loadbalancer_pb2.GenerateResponse], object]
"""Where a request's messages to its caller go."""

FINISHED = (generation_pb2.FINISH_REASON_STOP, generation_pb2.FINISH_REASON_LENGTH)
log = logging.getLogger(__name__)


class Balancer:
    """The load balancer's domain: the routing table plus request execution."""

    def __init__(self, config: LoadBalancerConfig, table: RoutingTable, upstreams: Upstreams, *,
                 tracer: trace.Tracer, stats: Stats | None = None,
                 before_send: Callable[[Ticket], Awaitable[None]] | None = None,
                 metrics: ServerMetrics | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: what deadlines and waits are measured on (the table's own clock is the table's)."""
        self.config = config
        self.clock = clock
        self._timing = Timing(metrics) if metrics is not None else None
        self.table = table
        self.upstreams = upstreams
        self.tracer = tracer
        self.stats = stats or Stats()
        self._before_send = before_send
        self.retry_policy = RetryPolicy(initial_s=config.retry_initial_backoff_s, max_s=config.retry_max_backoff_s,
                                        jitter=(0.5, 1.0))
        """The waits between a request's attempts (its budget and deadline bound how many)."""
        self._running: dict[str, RequestRun] = {}
        self.completed = CompletedCache(max_entries=config.completed_cache_size,
                                        max_bytes=config.completed_cache_bytes, ttl_s=config.completed_cache_ttl_s)
        self._table_changed = asyncio.Event()
        table.on_change(self._notify)
        self.pauses = PauseEstimator(max_hold_s=config.max_kv_hold_s, quantile=config.kv_hold_quantile,
                                     max_sessions=config.max_sticky_sessions)
        """Sessions' pauses between requests: how long replicas hold a session's KV after a request."""
        pa = config.program_admission
        self.programs = ProgramAdmission(kv_tokens=pa.kv_tokens, kv_fraction=pa.kv_fraction,
                                         reserve_final=pa.reserve_final, idle_s=pa.idle_s,
                                         max_programs=config.max_sticky_sessions, clock=clock,
                                         stats=self.stats) if pa.enabled else None
        """Sessions as programs admitted by KV room (``program_admission``), when on."""
        self.control = FleetControl(table, upstreams, abort_grace_s=config.abort_grace_s, pauses=self.pauses,
                                    programs=self.programs)
        """Operations on the fleet as a whole (sessions, removal, pauses, rebalancing)."""

    def _notify(self) -> None:
        if self.programs is not None:
            self.programs.retain(self.table.routes)
        self._table_changed.set()
        self._table_changed = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def replica_of(self, request_id: str) -> str | None:
        """The replica that request ``request_id``'s current attempt runs on (None: not running, or waiting for
        a replica)."""
        run = self._running.get(request_id)
        return run.attempts[-1].replica_id if run is not None and run.attempts else None

    # ------------------------------------------------------------ generation
    def _start(self, request: loadbalancer_pb2.GenerateRequest,
               time_remaining: float | None) -> RequestRun | loadbalancer_pb2.GenerateResponse:
        """Check a request and register its run (or, for a recently completed request id, its record)."""
        check_generation(request.request_id, request.prompt_token_ids, request.sampling_params,
                         request.resume_segments)
        check_streaming(request)
        check_session_id(request.session_id, "session_id", required=False)
        expected_pause = check_duration(request, "expected_pause", Reason.INVALID_KV_HOLD)
        if request.request_id in self._running:
            raise AlreadyExists(f"request {request.request_id!r} is already in flight", reason=Reason.REQUEST_IN_FLIGHT)
        record = self.completed.get(request.request_id)
        if record is not None:
            return record
        run = RequestRun(
            request=request,
            partial_rollout=request.partial_rollout if request.HasField("partial_rollout")
            else self.config.partial_rollout,
            budget=request.retry_budget if request.HasField("retry_budget") else self.config.retry_budget,
            deadline=None if time_remaining is None else self.clock() + time_remaining,
            segments=list(request.resume_segments), clock=self.clock)
        if request.session_id:
            self.pauses.arrived(request.session_id, self.clock())
            run.hold_kv_s = expected_pause if expected_pause is not None else self.pauses.hold_s()
        self._running[request.request_id] = run
        self.stats.requests_total += 1
        return run

    async def serve(self, request: loadbalancer_pb2.GenerateRequest, time_remaining: float | None,
                    write: Callable[[loadbalancer_pb2.GenerateResponse], Awaitable[object]]) -> None:
        """Run one request in the calling task, handing its messages to ``write`` in order (the Generate
        servicer's ``context.write``); raises the request's error. Cancelling the task (the caller went
        away) cancels the upstream call."""
        run = self._start(request, time_remaining)
        if not isinstance(run, RequestRun):
            await write(run)
            return
        started = time.perf_counter()
        timing = self._timing
        first_token = None if timing is None else lambda: timing.ttft.observe(time.perf_counter() - started)
        out = Outbox(write, first_token)
        outcome = "failed"
        try:
            with tracing.span(self.tracer, "lb.generate", attributes={
                    "rollmesh.request_id": run.request_id, "rollmesh.session_id": request.session_id,
                    "rollmesh.max_tokens": request.sampling_params.max_tokens}) as span:
                try:
                    await self._run_attempts(run, out, span)
                except Exception:
                    await out.drain()   # what an attempt emitted before the request failed still reaches the caller
                    raise
                span.set_attribute("rollmesh.attempts", len(run.attempts))
            await out.drain()
            outcome = "completed"
            if request.session_id:
                self.pauses.ended(request.session_id, self.clock(), last=run.hold_kv_s == 0 and
                                  request.HasField("expected_pause"))
        except asyncio.CancelledError:   # the caller went away: not a failure of ours
            outcome = "cancelled"
            raise
        finally:
            if self.programs is not None and request.session_id:   # ended, failed or cancelled (waiting or not)
                self.programs.leave(request.session_id)
                self.control.release_holds(self.programs.ended(request.session_id, run.request_id, last=(
                    outcome == "completed" and request.HasField("expected_pause") and run.hold_kv_s == 0)))
            del self._running[request.request_id]
            setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
            if timing is not None:
                timing.request.labels(outcome).observe(time.perf_counter() - started)

    def generate(self, request: loadbalancer_pb2.GenerateRequest,
                 time_remaining: float | None) -> AsyncIterator[loadbalancer_pb2.GenerateResponse]:
        """One request's messages as an async iterator (for ``GenerateMany`` and the HTTP front): :meth:`serve`
        in a task of its own; closing the iterator cancels it."""
        return as_iterator(lambda write: self.serve(request, time_remaining, write))

    async def _run_attempts(self, run: RequestRun, out: Outbox, span: trace.Span) -> None:
        """Attempts until one completes the request or ``run.budget`` retries are spent (a plain loop: this
        is every request's path, where a retry library's per-attempt bookkeeping would cost more than it
        does)."""
        tries = 0
        try:
            while True:
                tries += 1
                remaining = run.remaining()
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceeded(f"request {run.request_id!r} ran out of time after "
                                           f"{len(run.attempts)} attempt(s)", reason=Reason.DEADLINE_EXCEEDED)
                if tries > 1:
                    self.stats.retries += 1
                    last = run.attempts[-1]
                    log.info("request %s: try %d of %d, after %s on %s: %s", run.request_id, tries, run.budget + 1,
                             routing_pb2.AttemptOutcome.Name(last.outcome).removeprefix("ATTEMPT_OUTCOME_"),
                             last.replica_id, last.reason or "-",
                             extra={"request_id": run.request_id, "replica_id": last.replica_id})
                    span.add_event("retry", {"rollmesh.attempt": tries})
                try:
                    await self._attempt(run, out)
                    return
                except RetryAttempt as retry:
                    if tries > run.budget:
                        raise
                    delay = backoff_s(retry, tries, self.retry_policy, run.remaining())
                    if delay > 0:
                        await asyncio.sleep(delay)
        except RetryAttempt as last:
            outcomes = ", ".join(f"{a.replica_id}:{routing_pb2.AttemptOutcome.Name(a.outcome)}"
                                 for a in run.attempts)
            log.warning("request %s spent its retry budget of %d (last: %s); attempts: %s", run.request_id,
                        run.budget, last, outcomes, extra={"request_id": run.request_id})
            raise ResourceExhausted(f"request {run.request_id!r} spent its retry budget of {run.budget} "
                                    f"(last: {last}); attempts: {outcomes}", reason=Reason.RETRY_BUDGET_SPENT,
                                    non_retryable=True) from None

    async def _acquire(self, run: RequestRun) -> Choice:
        """Pick a replica, waiting (event-driven) for one to become eligible."""
        min_version = run.request.min_weight_version if run.request.HasField("min_weight_version") else None
        started = self.clock()
        limit = self.config.no_replica_wait_s
        waited = False
        prefix = self.table.prefix
        if prefix is not None and run.prefix_keys is None:
            run.prefix_keys = prefix.index.prompt(run.request.prompt_token_ids)
        programs = self.programs if run.request.session_id else None
        prompt, max_tokens = len(run.request.prompt_token_ids), run.request.sampling_params.max_tokens
        while True:
            only = None if programs is None else await programs.admit(
                run.request.session_id, prompt + self.table.completion_tokens.expected(max_tokens),
                lambda: self.table.admissible(min_version, avoid=run.avoid), run.remaining)
            choice = self.table.pick(run.request_id, session_id=run.request.session_id,
                                     min_weight_version=min_version, avoid=run.avoid, prefix_keys=run.prefix_keys,
                                     prompt_tokens=prompt, max_tokens=max_tokens, only=only)
            if choice is not None:
                if programs is not None and only is not None:
                    programs.placed(run.request.session_id, choice.ticket.route.replica_id, run.request_id,
                                    prompt=prompt, completion=choice.pick.expected_completion)
                self.stats.sticky_hits += int(choice.sticky_hit)
                self.stats.sticky_migrations += int(choice.sticky_migrated)
                self.stats.prefix_hits += int(choice.prefix_tokens > 0)
                self.stats.prefix_spills += int(choice.prefix_spilled)
                return choice
            if not waited:
                self.stats.no_replica_waits += 1
                waited = True
            if self.table.any_paused:   # a pause holds requests until it ends, whatever no_replica_wait_s says
                started = self.clock()
            budget = limit - (self.clock() - started)
            remaining = run.remaining()
            if remaining is not None and remaining < budget:
                if remaining <= 0:
                    raise DeadlineExceeded(f"request {run.request_id!r}: deadline passed while waiting for a "
                                           "replica", reason=Reason.DEADLINE_EXCEEDED)
                budget = remaining
            if budget <= 0:
                raise Unavailable(f"no eligible replica for request {run.request_id!r} within {limit:.1f} s "
                                  f"({self.table.explain_ineligible(min_version)})", reason=Reason.NO_ELIGIBLE_REPLICA)
            changed = self._table_changed
            ejection_ends = self.table.next_ejection_end()   # an ejected replica comes back without a table change
            try:
                await asyncio.wait_for(changed.wait(), timeout=min(budget, (ejection_ends or budget) + 0.01))
            except asyncio.TimeoutError:
                pass

    def _replica_request(self, run: RequestRun, ticket: Ticket) -> replica_agent_pb2.GenerateRequest:
        request = run.request
        msg = replica_agent_pb2.GenerateRequest(
            replica_id=ticket.route.replica_id, request_id=run.request_id,
            prompt_token_ids=request.prompt_token_ids, sampling_params=request.sampling_params,
            resume_segments=run.segments, session_id=request.session_id)
        if run.hold_kv_s > 0:
            set_seconds(msg.hold_kv, run.hold_kv_s)
        if request.HasField("stream_interval"):
            msg.stream_interval = request.stream_interval
        if request.HasField("flush_interval"):
            msg.flush_interval.CopyFrom(request.flush_interval)
        return msg

    async def _attempt(self, run: RequestRun, out: Outbox) -> None:
        emit = out.put
        if self._budget_spent(run):
            # an attempt streamed the whole budget, then broke before its final message: the request is done
            self._complete_from_segments(run, emit)
            return
        while True:  # re-pick when a removal revoked the ticket before it was sent
            choice = await self._acquire(run)
            ticket = choice.ticket
            if self._before_send is not None:
                await self._before_send(ticket)
            if not ticket.revoked:
                break
            self.table.release(ticket)
        route = ticket.route
        record = routing_pb2.Attempt(replica_id=route.replica_id, weight_version=route.weight_version,
                                     started_at=now_ts())
        run.attempts.append(record)
        attempt_started = time.perf_counter()
        streamed: list[replica_agent_pb2.GenerateResponse] = []   # this attempt's messages with tokens
        final = None
        forward = not run.request.final_only
        with tracing.span(self.tracer, "lb.attempt", record_exception=False, set_status_on_exception=False,
                          attributes={"rollmesh.replica_id": route.replica_id,
                                      "rollmesh.request_id": run.request_id}) as span:
            try:
                # No await between the revocation check above and this send: a removal either
                # happened before the check (and we re-picked) or sees this request in flight.
                ticket.sent = True
                call = self.upstreams.generate(route, self._replica_request(run, ticket), run.remaining())
                watch = Watch(ticket, call, self.config.stall_timeout_s)
                try:
                    try:
                        async for msg in call:   # to its end, so the client span closes
                            watch.heard()
                            if final is not None:
                                continue
                            if msg.token_ids:
                                if msg.weight_version > route.weight_version:
                                    self.table.observe_version(route, msg.weight_version)
                                streamed.append(msg)
                                ticket.tokens += len(msg.token_ids)
                            if msg.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                                final = msg
                            elif forward and msg.token_ids:
                                emit(self._chunk(run, msg, route.replica_id))
                                watch.pause()   # a slow caller is not a stalled replica
                                await out.drain()
                                watch.heard()
                    except grpc.aio.AioRpcError as err:
                        if final is None:   # once the final message is in, how the stream ends does not matter
                            self._attempt_failed(run, record, streamed, route, err)
                    except asyncio.CancelledError:
                        cut = watch.cut()   # the watch cancelled the call (a stall, a removal with abort)
                        if cut is None:
                            raise
                        if final is None and cut.removed:
                            self._attempt_moved(run, record, streamed, route, str(cut))
                        if final is None:
                            self._attempt_failed(run, record, streamed, route, None, why=str(cut))
                    finally:
                        watch.stop()
                    if final is None:
                        self._attempt_failed(run, record, streamed, route, None)
                    self.table.answered(route)
                    record.tokens = ticket.tokens
                    record.weight_version = final.weight_version or record.weight_version
                    span.set_attribute("rollmesh.tokens", ticket.tokens)
                    span.set_attribute("rollmesh.weight_version", record.weight_version)
                    if final.finish_reason in FINISHED:
                        self._finish(run, record, final, route.replica_id, emit)
                        span.set_attribute("rollmesh.outcome", "COMPLETED")
                        self.table.release(ticket, completed=True)
                        return
                    span.set_attribute("rollmesh.outcome", "ABORTED")
                    self._aborted(run, record, final, ticket, emit)
                finally:
                    call.cancel()
                    self.table.release(ticket)
                    if self._timing is not None:
                        outcome = routing_pb2.AttemptOutcome.Name(record.outcome).removeprefix("ATTEMPT_OUTCOME_").lower()
                        self._timing.attempt.labels(outcome).observe(time.perf_counter() - attempt_started)
            except RetryAttempt as retry:
                attempt_ended(span, record, retry)
                raise
            except asyncio.CancelledError:
                span.add_event("attempt.cancelled")
                raise
            except BaseException as exc:
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {str(exc)[:300]}"))
                raise

    def _chunk(self, run: RequestRun, msg: AgentMessage, replica_id: str) -> loadbalancer_pb2.GenerateResponse:
        out = loadbalancer_pb2.GenerateResponse(request_id=run.request_id, token_ids=msg.token_ids,
                                                logprobs=msg.logprobs, weight_version=msg.weight_version,
                                                replica_id=replica_id)
        if run.restart_pending:
            out.restarted, run.restart_pending = True, False
        return out

    @staticmethod
    def _budget_spent(run: RequestRun) -> bool:
        held = sum(len(s.token_ids) for s in run.segments)
        return run.partial_rollout and held > 0 and held >= run.request.sampling_params.max_tokens

    def _complete_from_segments(self, run: RequestRun, emit: Emit) -> None:
        """Finish with FINISH_REASON_LENGTH from the tokens already held (no further attempt can add any)."""
        last = run.segments[-1]
        final = replica_agent_pb2.GenerateResponse(request_id=run.request_id, weight_version=last.weight_version,
                                                   finish_reason=generation_pb2.FINISH_REASON_LENGTH,
                                                   segments=run.segments)
        self._finish(run, routing_pb2.Attempt(), final, last.replica_id, emit)

    def _finish(self, run: RequestRun, record: routing_pb2.Attempt, final: AgentMessage, replica_id: str,
                emit: Emit) -> None:
        record.outcome = routing_pb2.ATTEMPT_OUTCOME_COMPLETED
        set_seconds(record.ended_at, time.time())
        out = self._chunk(run, final, replica_id)
        out.finish_reason = final.finish_reason
        out.segments.extend(final.segments)
        out.attempts.extend(run.attempts)
        completion = sum(len(s.token_ids) for s in final.segments)
        caller_resumed = sum(len(s.token_ids) for s in run.request.resume_segments)
        out.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=len(run.request.prompt_token_ids),
                                                completion_tokens=completion, resumed_tokens=caller_resumed,
                                                attempts=len(run.attempts), cached_tokens=final.usage.cached_tokens))
        whole = whole_result(out, caller_resumed)
        emit(whole if run.request.final_only else out)
        self.completed.put(run.request_id, whole)

    def _restart(self, run: RequestRun, dropped: int) -> None:
        """Drop an attempt's tokens (partial rollout off): regenerate from the caller's prefix."""
        self.stats.truncated_dropped += dropped
        self.stats.regenerations += 1
        run.segments = list(run.request.resume_segments)
        run.restart_pending = True

    def _aborted(self, run: RequestRun, record: routing_pb2.Attempt, final: AgentMessage, ticket: Ticket,
                 emit: Emit) -> None:
        record.outcome = routing_pb2.ATTEMPT_OUTCOME_ABORTED
        set_seconds(record.ended_at, time.time())
        record.reason = "moved by rebalance" if ticket.move_requested else "aborted by the replica"
        if final.token_ids and not run.request.final_only:  # the abort's own last tokens still reach the caller
            emit(self._chunk(run, final, ticket.route.replica_id))
        if run.partial_rollout:
            run.segments = list(final.segments)
            self.stats.resumes += 1
        else:
            self._restart(run, record.tokens)
        moved = frozenset({ticket.route.replica_id}) if ticket.move_requested else frozenset()
        run.avoid = moved | run.failed_on
        raise RetryAttempt(f"aborted on {ticket.route.replica_id}", backoff=False)

    def _keep(self, run: RequestRun, streamed: list[AgentMessage], route: Route) -> None:
        """What a broken-off attempt streamed: resumed from (partial rollout) or dropped for a regeneration."""
        if streamed:
            if run.partial_rollout:
                run.segments += segments_of(streamed, route)
                self.stats.resumes += 1
            else:
                self._restart(run, token_count(streamed))

    def _attempt_moved(self, run: RequestRun, record: routing_pb2.Attempt, streamed: list[AgentMessage],
                       route: Route, why: str) -> NoReturn:
        """The control plane removed the attempt's replica with abort: keep what arrived, go on elsewhere now."""
        record.outcome = routing_pb2.ATTEMPT_OUTCOME_ABORTED
        set_seconds(record.ended_at, time.time())
        record.tokens = token_count(streamed)
        record.reason = why
        self._keep(run, streamed, route)
        run.avoid = frozenset({route.replica_id}) | run.failed_on
        raise RetryAttempt(f"{route.replica_id}: {why}", backoff=False)

    def _attempt_failed(self, run: RequestRun, record: routing_pb2.Attempt, streamed: list[AgentMessage],
                        route: Route, err: grpc.aio.AioRpcError | None,
                        why: str = "") -> NoReturn:
        """An attempt broke off without a final message (or was cut): keep what arrived, retry with backoff."""
        set_seconds(record.ended_at, time.time())
        record.tokens = token_count(streamed)
        if err is not None and not retry_elsewhere(err):
            record.outcome = routing_pb2.ATTEMPT_OUTCOME_FAILED
            code = err.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(f"request {run.request_id!r}: deadline passed on {route.replica_id}",
                                       reason=Reason.DEADLINE_EXCEEDED) from None
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
                raise InvalidArgument(f"replica {route.replica_id} rejected the request: {err.details()}",
                                      reason=Reason.REJECTED_BY_REPLICA) from None
            raise Internal(f"replica {route.replica_id} failed the request: {code.name}: {err.details()}",
                           reason=Reason.REPLICA_ERROR) from None
        record.outcome = routing_pb2.ATTEMPT_OUTCOME_UNAVAILABLE
        record.reason = (f"{err.code().name}: {err.details()}" if err is not None
                         else why or "stream ended early")
        refused = err is not None and error_reason(err) == Reason.REPLICA_NOT_SERVING   # alive, just busy (e.g. a sync)
        if not refused and self.table.unreachable(route, record.reason):
            self.stats.outlier_ejections += 1
            log.warning("replica %s ejected from picks for %.1f s: %s", route.replica_id,
                        route.breaker.ejected_until - self.table.clock(), route.breaker.ejected_reason)
            trace.get_current_span().add_event("outlier.ejected", {
                "rollmesh.replica_id": route.replica_id, "rollmesh.reason": route.breaker.ejected_reason,
                "rollmesh.ejections": route.breaker.ejections})
        run.failed_on = run.failed_on | {route.replica_id}   # never back to it while another one is eligible
        run.avoid = run.avoid | run.failed_on
        self._keep(run, streamed, route)
        raise RetryAttempt(f"{route.replica_id}: {record.reason}", backoff=True, refused=refused)
