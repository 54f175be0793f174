"""The load balancer in-process (grpc.aio on port 0) against scripted fake replicas."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from loadbalancer.config import LoadBalancerConfig
from loadbalancer.server import SPEC
from loadbalancer.service import LoadBalancerServicer
from mesh_runtime.config import load_config
from rollmesh.common.v1 import generation_pb2
from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb
from rollmesh.loadbalancer.v1 import loadbalancer_pb2_grpc, routing_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as replica_pb
from tests.loadbalancer.fake_replica import start_fake
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def mesh():
    servers = []

    async def make(modes: dict[str, str], lb_overrides: dict | None = None, before_send=None, add=True,
                   tracer_provider=None, **fake_kw):
        fake_server, fake, address = await start_fake(modes, **fake_kw)
        servers.append(fake_server)
        config = load_config(LoadBalancerConfig, None, overrides={"listen": "127.0.0.1:0", **(lb_overrides or {})})
        spec = dataclasses.replace(SPEC, make_servicer=lambda c, t: LoadBalancerServicer(c, t, before_send=before_send))
        lb, port = await spec.create(config, tracer_provider)
        servers.append(lb)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = loadbalancer_pb2_grpc.LoadBalancerServiceStub(channel)
        stub.lb_address = f"127.0.0.1:{port}"   # for clients that open their own channel
        if add:
            await stub.AddReplicas(pb.AddReplicasRequest(replicas=[
                routing_pb2.ReplicaEndpoint(replica_id=r, address=address) for r in modes]))
        return stub, fake, address

    yield make
    for server in reversed(servers):
        await server.stop(0)


async def _stats(stub, name: str) -> int:
    return getattr((await stub.GetStats(pb.GetStatsRequest())).stats, name)


def request(request_id: str, max_tokens: int = 16, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                              sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens), **kw)


async def collect(stub, req, timeout=30) -> tuple[list[int], pb.GenerateResponse]:
    """The caller's view: tokens (honouring `restarted`) and the last message."""
    received: list[int] = []
    last = None
    async for msg in stub.Generate(req, timeout=timeout):
        if msg.restarted:
            received = []
        received += msg.token_ids
        last = msg
    return received, last


def expected(max_tokens: int) -> list[int]:
    return [1000 + i for i in range(max_tokens)]


async def test_abort_resumes_elsewhere_with_prefix_and_exact_budget(mesh):
    stub, fake, _ = await mesh({"a": "normal", "b": "normal"}, delay_s=0.05, step=2)
    task = asyncio.create_task(collect(stub, request("r1", 20)))
    await fake.started.wait()
    victim = fake.seen[0].replica_id
    await fake.AbortRequests(type("R", (), {"replica_id": victim, "all": True, "request_ids": []})(), None)
    tokens, last = await task
    assert tokens == expected(20)
    assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert [a.outcome for a in last.attempts] == [routing_pb2.ATTEMPT_OUTCOME_ABORTED,
                                                 routing_pb2.ATTEMPT_OUTCOME_COMPLETED]
    assert [s.replica_id for s in last.segments][-1] != victim
    assert sum(len(s.token_ids) for s in last.segments) == 20 == last.usage.completion_tokens
    assert fake.seen[1].resumed > 0  # the second attempt carried the prefix
    stats = (await stub.GetStats(pb.GetStatsRequest())).stats
    assert stats.resumes == 1 and stats.retries == 1 and stats.completed == 1


async def test_partial_rollout_off_regenerates_and_flags_the_restart(mesh):
    stub, fake, _ = await mesh({"a": "normal", "b": "normal"}, delay_s=0.05, step=2)
    task = asyncio.create_task(collect(stub, request("r2", 12, partial_rollout=False)))
    await fake.started.wait()
    await fake.AbortRequests(type("R", (), {"replica_id": "", "all": True, "request_ids": []})(), None)
    tokens, last = await task
    assert tokens == expected(12)
    assert fake.seen[-1].resumed == 0
    assert len(last.segments) == 1
    stats = (await stub.GetStats(pb.GetStatsRequest())).stats
    assert stats.regenerations == 1 and stats.truncated_dropped > 0


async def test_pick_then_send_race_never_reaches_a_removed_replica(mesh):
    gate, picked = asyncio.Event(), asyncio.Queue()

    async def before_send(ticket):
        if not gate.is_set():
            await picked.put(ticket.route.replica_id)
            await gate.wait()

    stub, fake, _ = await mesh({"a": "normal", "b": "normal"}, before_send=before_send)
    task = asyncio.create_task(collect(stub, request("race", 8)))
    victim = await picked.get()
    removed = await stub.RemoveReplicas(pb.RemoveReplicasRequest(replica_ids=[victim]))
    assert list(removed.removed_replica_ids) == [victim]
    gate.set()
    tokens, last = await task
    assert tokens == expected(8)
    assert {s.replica_id for s in fake.seen} == ({"a", "b"} - {victim})
    assert [a.replica_id for a in last.attempts] != [victim]


async def test_retry_budget_is_honoured(mesh):
    stub, fake, _ = await mesh({"a": "abort", "b": "abort"})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request("doomed", 8, retry_budget=3))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry budget of 3" in info.value.details()
    assert len(fake.seen) == 4


async def test_deadline_is_honoured_and_the_upstream_call_cancelled(mesh):
    stub, fake, _ = await mesh({"a": "stall"})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request("slow", 8), timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for _ in range(100):
        if fake.cancelled:
            break
        await asyncio.sleep(0.05)
    assert fake.cancelled == ["slow"]
    assert (await stub.GetStatus(pb.GetStatusRequest())).in_flight == 0


async def test_empty_pool_waits_for_a_replica_then_succeeds(mesh):
    stub, fake, address = await mesh({"a": "normal"}, add=False)
    task = asyncio.create_task(collect(stub, request("patient", 8)))
    await wait_until(lambda: _stats(stub, "no_replica_waits"), 10, every_s=0.02, what="the request waiting")
    assert not task.done()
    await stub.AddReplicas(pb.AddReplicasRequest(replicas=[routing_pb2.ReplicaEndpoint(replica_id="a", address=address)]))
    tokens, _ = await task
    assert tokens == expected(8)
    assert (await stub.GetStats(pb.GetStatsRequest())).stats.no_replica_waits == 1


async def test_empty_pool_fails_with_unavailable_after_the_limit(mesh):
    stub, _, _ = await mesh({"a": "normal"}, add=False, lb_overrides={"no_replica_wait_s": 0.3})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request("lonely", 8))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no eligible replica" in info.value.details() and "routing table is empty" in info.value.details()


async def test_min_weight_version_routes_only_to_new_enough_replicas(mesh):
    stub, fake, address = await mesh({"old": "normal", "new": "normal"}, add=False,
                                     lb_overrides={"no_replica_wait_s": 0.3})
    await stub.AddReplicas(pb.AddReplicasRequest(replicas=[
        routing_pb2.ReplicaEndpoint(replica_id="old", address=address, weight_version=1),
        routing_pb2.ReplicaEndpoint(replica_id="new", address=address, weight_version=2)]))
    for i in range(4):
        await collect(stub, request(f"v{i}", 4, min_weight_version=2))
    assert {s.replica_id for s in fake.seen} == {"new"}
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request("v9", 4, min_weight_version=3))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "< required 3" in info.value.details()


async def test_exactly_once_per_request_id(mesh):
    stub, fake, _ = await mesh({"a": "normal"}, delay_s=0.05)
    first = asyncio.create_task(collect(stub, request("once", 12)))
    await fake.started.wait()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request("once", 12))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    tokens, _ = await first
    replay, last = await collect(stub, request("once", 12))
    assert replay == tokens == expected(12) and last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert len(fake.seen) == 1


async def test_bad_input_is_rejected_before_routing(mesh):
    stub, fake, _ = await mesh({"a": "normal"})
    bad = [request("", 4), request("x", 0), pb.GenerateRequest(request_id="y", sampling_params={"max_tokens": 4}),
           request("z", 4, resume_segments=[generation_pb2.TokenSegment(token_ids=[1, 2, 3, 4])])]
    for req in bad:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for call in (stub.RemoveReplicas(pb.RemoveReplicasRequest()),
                 stub.AddReplicas(pb.AddReplicasRequest(replicas=[routing_pb2.ReplicaEndpoint(replica_id="q",
                                                                                            address="nohost")]))):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fake.seen == []
    assert len((await stub.ListReplicas(pb.ListReplicasRequest())).replicas) == 1


async def test_rebalance_moves_only_the_excess_onto_a_new_replica(mesh):
    stub, fake, address = await mesh({"a": "normal", "b": "normal"}, add=False, delay_s=0.1, step=1)
    await stub.AddReplicas(pb.AddReplicasRequest(replicas=[routing_pb2.ReplicaEndpoint(replica_id="a", address=address)]))
    tasks = [asyncio.create_task(collect(stub, request(f"q{i}", 30))) for i in range(6)]
    while len(fake.seen) < 6:
        await asyncio.sleep(0.02)
    await stub.AddReplicas(pb.AddReplicasRequest(replicas=[routing_pb2.ReplicaEndpoint(replica_id="b", address=address)]))
    reply = await stub.Rebalance(pb.RebalanceRequest(request_id="rb-1"))
    assert len(reply.moved_request_ids) == 3
    assert await stub.Rebalance(pb.RebalanceRequest(request_id="rb-1")) == reply  # a retry moves nothing more
    assert {r.replica_id: (r.in_flight_before, r.in_flight_after) for r in reply.replicas} == {"a": (6, 3), "b": (0, 3)}
    results = await asyncio.gather(*tasks)
    assert all(tokens == expected(30) for tokens, _ in results)
    moved = [last for _, last in results if len(last.attempts) == 2]
    assert len(moved) == 3 and all(last.attempts[1].replica_id == "b" for last in moved)


async def test_each_request_is_a_span_with_a_child_span_per_attempt(mesh):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    stub, fake, _ = await mesh({"a": "normal", "b": "normal"}, delay_s=0.05, step=2, tracer_provider=provider)
    task = asyncio.create_task(collect(stub, request("traced", 12)))
    await fake.started.wait()
    await fake.AbortRequests(type("R", (), {"replica_id": "", "all": True, "request_ids": []})(), None)
    await task
    spans = exporter.get_finished_spans()
    request_span = next(s for s in spans if s.name == "lb.generate")
    attempts = [s for s in spans if s.name == "lb.attempt"]
    assert request_span.attributes["rollmesh.request_id"] == "traced"
    assert request_span.attributes["rollmesh.attempts"] == 2
    assert [a.attributes["rollmesh.outcome"] for a in attempts] == ["ABORTED", "COMPLETED"]
    assert all(a.parent.span_id == request_span.context.span_id for a in attempts)
    assert sum(a.attributes["rollmesh.tokens"] for a in attempts) >= 12
    assert [e.name for e in request_span.events] == ["retry"]
    # the abort is planned (the replica aborted its requests): an event with its reason, never an error
    assert [e.name for e in attempts[0].events] == ["attempt.aborted"]
    assert attempts[0].events[0].attributes["rollmesh.reason"] == "aborted by the replica"
    assert not [s.name for s in spans if s.status.status_code == StatusCode.ERROR]
    server_span = next(s for s in spans if s.name.endswith("LoadBalancerService/Generate"))
    assert request_span.parent.span_id == server_span.context.span_id
    upstream = [s for s in spans if s.name.endswith("ReplicaAgentService/Generate")]
    assert {u.parent.span_id for u in upstream} == {a.context.span_id for a in attempts}


async def test_a_retry_never_goes_back_to_a_replica_that_just_failed_it(mesh):
    # The convergence issue's defect 2: a dead replica has 0 in flight, so least-loaded routing picked it on
    # every retry while the healthy replicas were busy, until the retry budget was spent.
    stub, fake, _ = await mesh({"dead": "down", "ok": "ok"}, step=1, delay_s=0.05)
    busy = [asyncio.ensure_future(collect(stub, request(f"busy{i}", 40, retry_budget=20))) for i in range(2)]
    deadline = asyncio.get_running_loop().time() + 10
    while sum(1 for s in fake.seen if s.replica_id == "ok") < 2:   # both are generating on "ok" now
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    tokens, last = await collect(stub, request("probe", 4, retry_budget=3))
    assert len(tokens) == 4 and last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    attempts = [s.replica_id for s in fake.seen if s.request_id == "probe"]
    assert attempts == ["dead", "ok"], attempts                    # one try on the dead one, then elsewhere
    for done in await asyncio.gather(*busy):
        assert len(done[0]) == 40


async def test_an_attempt_that_makes_no_progress_is_resumed_elsewhere(mesh):
    # defect 3 (independent of leases): a frozen replica's requests waited there; now stall_timeout_s cuts them
    stub, fake, _ = await mesh({"frozen": "stall", "ok": "ok"}, lb_overrides={"stall_timeout_s": 0.5})
    loop = asyncio.get_running_loop()
    for i in range(2):   # round robin: one of the two starts on the frozen replica
        started = loop.time()
        tokens, last = await collect(stub, request(f"s{i}", 8), timeout=20)
        assert len(tokens) == 8 and loop.time() - started < 5
    cut = [a for i in range(2) for a in (await _attempts(stub, f"s{i}")) if a.replica_id == "frozen"]
    assert cut and all("no message for 0.5 s (stall_timeout_s)" in a.reason for a in cut)


async def test_removal_with_abort_cuts_the_attempts_on_a_frozen_replica_at_once(mesh):
    # what the controller does when a lease expires: the agent may be frozen and never answer its abort
    stub, fake, address = await mesh({"frozen": "stall", "ok": "ok"}, add=False, lb_overrides={"stall_timeout_s": 600})
    await stub.AddReplicas(pb.AddReplicasRequest(replicas=[routing_pb2.ReplicaEndpoint(replica_id="frozen",
                                                                                         address=address)]))
    pending = asyncio.ensure_future(collect(stub, request("held", 8), timeout=30))
    await asyncio.wait_for(fake.started.wait(), 10)
    await stub.AddReplicas(pb.AddReplicasRequest(replicas=[routing_pb2.ReplicaEndpoint(replica_id="ok",
                                                                                         address=address)]))
    removed = await stub.RemoveReplicas(pb.RemoveReplicasRequest(replica_ids=["frozen"], abort_in_flight=True))
    assert list(removed.in_flight_request_ids) == ["held"]
    tokens, last = await asyncio.wait_for(pending, 10)
    assert len(tokens) == 8 and [a.replica_id for a in last.attempts] == ["frozen", "ok"]
    assert "removed from routing with abort" in last.attempts[0].reason
    assert last.attempts[0].outcome == routing_pb2.ATTEMPT_OUTCOME_ABORTED   # a move, not a failure


async def test_a_final_message_counts_even_when_the_stream_is_cut_after_it(mesh):
    # the replica's abort reply (with its last tokens) arrived, then its stream hung and a removal cut it:
    # the caller gets those tokens and the request resumes after them, not before
    stub, fake, address = await mesh({"hang": "linger", "ok": "ok"}, add=False, delay_s=0.05,
                                     lb_overrides={"stall_timeout_s": 600})
    await stub.AddReplicas(pb.AddReplicasRequest(replicas=[routing_pb2.ReplicaEndpoint(replica_id="hang",
                                                                                         address=address)]))
    pending = asyncio.ensure_future(collect(stub, request("late", 40), timeout=30))
    await asyncio.wait_for(fake.started.wait(), 10)
    await stub.AddReplicas(pb.AddReplicasRequest(replicas=[routing_pb2.ReplicaEndpoint(replica_id="ok",
                                                                                         address=address)]))
    await fake.AbortRequests(replica_pb.AbortRequestsRequest(
        replica_id="hang", requests=replica_pb.RequestIds(request_ids=["late"])), None)
    await asyncio.wait_for(fake.lingering.wait(), 10)   # the abort reply is out; the stream stays open
    await stub.RemoveReplicas(pb.RemoveReplicasRequest(replica_ids=["hang"], abort_in_flight=True))
    tokens, last = await asyncio.wait_for(pending, 10)
    assert tokens == [1000 + i for i in range(40)]
    assert [t for s in last.segments for t in s.token_ids] == tokens
    assert [a.replica_id for a in last.attempts] == ["hang", "ok"]


async def _attempts(stub, request_id):
    """The attempts of a completed request (answered from the balancer's record of it)."""
    last = None
    async for msg in stub.Generate(request(request_id, 8), timeout=10):
        last = msg
    return list(last.attempts)


async def test_a_request_whose_whole_budget_arrived_before_its_replica_died_completes(mesh):
    # found by the chaos test: the resume sent another attempt whose prefix already spent max_tokens, and the
    # replica rejected it (INVALID_ARGUMENT); the request is complete with the tokens it holds
    stub, fake, _ = await mesh({"v": "vanish", "ok": "ok"})
    for i in range(2):   # round robin: one of the two starts on the vanishing replica
        tokens, last = await collect(stub, request(f"full{i}", 8))
        assert tokens == [1000 + k for k in range(8)]
        assert last.finish_reason == generation_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 8
    vanished = [s for s in fake.seen if s.replica_id == "v"]
    assert vanished and all(sum(1 for s in fake.seen if s.request_id == v.request_id) == 1 for v in vanished)


async def test_a_replica_that_keeps_failing_is_ejected_until_it_answers_again(mesh):
    stub, fake, _ = await mesh({"dead": "down", "ok": "ok"}, lb_overrides={
        "outlier_detection": {"consecutive_failures": 2, "base_ejection_s": 1.0}})
    for i in range(6):   # least-loaded ties alternate: the dead one gets tried until it is ejected
        tokens, _ = await collect(stub, request(f"e{i}", 4), timeout=20)
        assert len(tokens) == 4
    assert sum(1 for s in fake.seen if s.replica_id == "dead") == 2   # then it was out of picks
    routed = {r.endpoint.replica_id: r for r in (await stub.ListReplicas(pb.ListReplicasRequest())).replicas}
    dead = routed["dead"]
    assert not dead.routable and "ejected for" in dead.unroutable_reason and "2 consecutive failures" in \
        dead.unroutable_reason and dead.ejections == 1 and dead.HasField("ejected_until")
    assert routed["ok"].routable
    assert (await stub.GetStats(pb.GetStatsRequest())).stats.outlier_ejections == 1
    fake.modes["dead"] = "ok"   # it recovers; after its ejection it gets a try and is healthy again

    async def ejection_over() -> bool:
        listed = (await stub.ListReplicas(pb.ListReplicasRequest())).replicas
        return next(r for r in listed if r.endpoint.replica_id == "dead").routable
    await wait_until(ejection_over, 10, every_s=0.05, what="the ejection over")
    for i in range(4):
        await collect(stub, request(f"back{i}", 4), timeout=20)
    back = {r.endpoint.replica_id: r for r in (await stub.ListReplicas(pb.ListReplicasRequest())).replicas}["dead"]
    assert back.routable and back.consecutive_failures == 0 and back.ejections == 0 and back.completed >= 1


async def test_a_replica_that_refuses_while_busy_is_not_ejected(mesh):
    # REPLICA_NOT_SERVING (e.g. during its weight sync) comes from a live agent: retried elsewhere, never ejected
    stub, fake, _ = await mesh({"syncing": "busy", "ok": "ok"}, lb_overrides={
        "outlier_detection": {"consecutive_failures": 1, "base_ejection_s": 30.0}})
    for i in range(6):
        tokens, _ = await collect(stub, request(f"b{i}", 4), timeout=20)
        assert len(tokens) == 4
    assert sum(1 for s in fake.seen if s.replica_id == "syncing") >= 2
    syncing = {r.endpoint.replica_id: r for r in (await stub.ListReplicas(pb.ListReplicasRequest())).replicas}["syncing"]
    assert syncing.routable and syncing.ejections == 0


async def test_update_replicas_refuses_an_unknown_replica_unless_told_to_skip_it(mesh):
    stub, _, _ = await mesh({"a": "normal"})
    updates = [pb.ReplicaUpdate(replica_id="a", weight_version=3), pb.ReplicaUpdate(replica_id="ghost", weight_version=3)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.UpdateReplicas(pb.UpdateReplicasRequest(updates=updates), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "ghost" in err.value.details()
    listed = await stub.ListReplicas(pb.ListReplicasRequest(), timeout=10)
    assert [r.endpoint.weight_version for r in listed.replicas] == [0]   # all or nothing
    reply = await stub.UpdateReplicas(pb.UpdateReplicasRequest(updates=updates, skip_unknown=True), timeout=10)
    assert [r.endpoint.replica_id for r in reply.replicas] == ["a"] and list(reply.skipped_replica_ids) == ["ghost"]
    listed = await stub.ListReplicas(pb.ListReplicasRequest(), timeout=10)
    assert [r.endpoint.weight_version for r in listed.replicas] == [3]


async def test_a_request_its_caller_cancels_counts_as_cancelled_not_failed(mesh):
    stub, fake, _ = await mesh({"a": "normal"}, delay_s=0.05, step=1)
    call = stub.Generate(request("walks-away", 40), timeout=30)
    async for _ in call:
        break
    call.cancel()
    for _ in range(100):
        stats = (await stub.GetStats(pb.GetStatsRequest(), timeout=10)).stats
        if stats.in_flight == 0:
            break
        await asyncio.sleep(0.05)
    assert (stats.requests_total, stats.completed, stats.failed, stats.cancelled) == (1, 0, 0, 1)


async def test_replicas_are_listed_in_pages_by_id(mesh):
    from mesh_runtime.errors import error_info

    stub, _, _ = await mesh({f"r{i}": "ok" for i in (3, 1, 4, 0, 2)})
    everything = [r.endpoint.replica_id for r in (await stub.ListReplicas(pb.ListReplicasRequest())).replicas]
    assert everything == ["r0", "r1", "r2", "r3", "r4"]   # by id, whatever order they were added in
    seen, token, pages = [], "", 0
    while True:
        reply = await stub.ListReplicas(pb.ListReplicasRequest(page_size=2, page_token=token))
        seen, token, pages = seen + [r.endpoint.replica_id for r in reply.replicas], reply.next_page_token, pages + 1
        if not token:
            break
    assert seen == everything and pages == 3
    first = await stub.ListReplicas(pb.ListReplicasRequest(page_size=2))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ListReplicas(pb.ListReplicasRequest(page_size=2, page_token=first.next_page_token,
                                                       routable_only=True))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(info.value).reason == "INVALID_PAGE_TOKEN"


async def test_a_sessions_request_asks_its_replica_to_hold_its_kv_for_the_pause(mesh):
    """expected_pause is passed on as the replica's hold_kv (0: the session's last turn, nothing held; no session:
    nothing held); unset, the hold is the balancer's estimate from the pauses it saw, capped by max_kv_hold_s;
    a negative one is refused before routing."""
    from google.protobuf.duration_pb2 import Duration

    stub, fake, _ = await mesh({"a": "normal"}, lb_overrides={"max_kv_hold_s": 20.0})
    await collect(stub, request("p1", 4, session_id="s", expected_pause=Duration(seconds=5)))
    await collect(stub, request("p2", 4, session_id="s", expected_pause=Duration(seconds=60)))
    await collect(stub, request("p3", 4, session_id="s", expected_pause=Duration()))
    await collect(stub, request("p4", 4, expected_pause=Duration(seconds=5)))
    assert [s.hold_kv_s for s in fake.seen] == [5.0, 60.0, 0.0, 0.0]   # the caller's own figure is not capped
    for i in range(20):   # sessions of two turns, nothing said: the balancer learns their pause
        await collect(stub, request(f"t{i}-0", 4, session_id=f"t{i}"))
        await asyncio.sleep(0.01)
        await collect(stub, request(f"t{i}-1", 4, session_id=f"t{i}"))
    holds = [s.hold_kv_s for s in fake.seen[4:]]
    # nothing held before 16 pauses were seen: s's two, then one per second turn; t13-1 brings the 16th
    assert holds[:27] == [0.0] * 27 and all(0.01 <= h < 1.0 for h in holds[27:])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, request("neg", 4, session_id="s", expected_pause=Duration(seconds=-1)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected_pause" in info.value.details()
    assert fake.seen[-1].request_id != "neg"
    off, off_fake, _ = await mesh({"b": "normal"}, lb_overrides={"max_kv_hold_s": 0})
    for i in range(20):
        await collect(off, request(f"u{i}-0", 4, session_id=f"u{i}"))
        await collect(off, request(f"u{i}-1", 4, session_id=f"u{i}"))
    assert {s.hold_kv_s for s in off_fake.seen} == {0.0}


def test_the_pause_estimate_is_a_quantile_of_recent_pauses_capped():
    from loadbalancer.pauses import PauseEstimator

    pauses = PauseEstimator(max_hold_s=10.0, quantile=0.9, min_samples=4)
    for i, pause in enumerate([1.0, 2.0, 3.0]):
        pauses.ended(f"s{i}", 100.0)
        pauses.arrived(f"s{i}", 100.0 + pause)
    assert pauses.hold_s() == 0.0 and pauses.samples == 3          # too few pauses seen
    pauses.arrived("never-ended", 200.0)                             # a session's first request: no pause
    pauses.ended("long", 0.0)
    pauses.arrived("long", 500.0)                                    # picked up much later: not a pause
    pauses.ended("last", 0.0, last=True)
    pauses.arrived("last", 1.0)                                      # said to be over: not a pause
    pauses.ended("closed", 0.0)
    pauses.forget("closed")
    pauses.arrived("closed", 1.0)
    assert pauses.samples == 3
    for i, pause in enumerate([4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 30.0]):
        pauses.ended(f"t{i}", 0.0)
        pauses.arrived(f"t{i}", pause)
    assert pauses.samples == 10 and pauses.hold_s() == 10.0          # the 90th percentile is 30 s: capped
    quick = PauseEstimator(max_hold_s=60.0, quantile=0.5, min_samples=1)
    for i, pause in enumerate([1.0, 2.0, 3.0, 4.0]):
        quick.ended(f"q{i}", 0.0)
        quick.arrived(f"q{i}", pause)
    assert quick.hold_s() == 3.0
