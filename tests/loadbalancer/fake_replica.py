"""A scripted ReplicaAgentService for load-balancer component tests.

Token ``i`` of every completion is ``1000 + i``, so a completion stitched
together from resumed attempts can be checked against ``range(max_tokens)``.
Each replica hosted by a fake has a mode: ``normal`` (streams ``step``
tokens per message, waiting on a gate between messages when ``gated``),
``abort`` (aborts at once), ``busy`` (refuses: not serving now), ``stall`` (never answers), ``vanish`` (dies right
after its last token) or ``linger`` (its abort reply carries the next tokens,
then the stream stays open: a replica that hangs after its final message).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from mesh_runtime.errors import Unavailable, to_status

from rollmesh.common.v1 import generation_pb2
from rollmesh.replica.v1 import replica_agent_pb2 as pb
from rollmesh.replica.v1 import replica_agent_pb2_grpc


@dataclass
class Seen:
    replica_id: str
    request_id: str
    resumed: int
    hold_kv_s: float = 0.0


@dataclass
class FakeReplicas(replica_agent_pb2_grpc.ReplicaAgentServiceServicer):
    modes: dict[str, str]
    step: int = 4
    version: int = 0
    delay_s: float = 0.0
    seen: list[Seen] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    _aborts: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    lingering: asyncio.Event = field(default_factory=asyncio.Event)   # a ``linger`` stream sent its abort reply

    async def Generate(self, request, context):  # noqa: N802
        resumed = sum(len(s.token_ids) for s in request.resume_segments)
        self.seen.append(Seen(request.replica_id, request.request_id, resumed,
                              request.hold_kv.seconds + request.hold_kv.nanos / 1e9))
        mode = self.modes.get(request.replica_id)
        if mode is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no replica {request.replica_id}")
        segments = list(request.resume_segments)
        mine = generation_pb2.TokenSegment(weight_version=self.version, replica_id=request.replica_id)
        if mode == "down":   # what a dead or unreachable replica looks like to the balancer
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"replica {request.replica_id} is down")
        if mode == "busy":   # what a live agent answers while the replica syncs weights
            await context.abort_with_status(to_status(Unavailable(
                f"replica {request.replica_id} is busy (weights in progress)", reason="REPLICA_NOT_SERVING")))
        if mode == "abort":
            yield pb.GenerateResponse(request_id=request.request_id, finish_reason=generation_pb2.FINISH_REASON_ABORTED,
                                      segments=segments)
            return
        key = (request.replica_id, request.request_id)
        abort = self._aborts.setdefault(key, asyncio.Event())
        self.started.set()
        try:
            if mode == "stall":
                await asyncio.Event().wait()
            position, budget = resumed, request.sampling_params.max_tokens
            while position < budget:
                if abort.is_set() and mode == "linger":
                    last = [1000 + i for i in range(position, min(budget, position + self.step))]
                    mine.token_ids.extend(last)
                    yield pb.GenerateResponse(request_id=request.request_id, weight_version=self.version,
                                              token_ids=last, finish_reason=generation_pb2.FINISH_REASON_ABORTED,
                                              segments=segments + [mine])
                    self.lingering.set()
                    await asyncio.Event().wait()
                if abort.is_set():
                    yield pb.GenerateResponse(request_id=request.request_id, weight_version=self.version,
                                              finish_reason=generation_pb2.FINISH_REASON_ABORTED,
                                              segments=segments + ([mine] if mine.token_ids else []))
                    return
                tokens = [1000 + i for i in range(position, min(budget, position + self.step))]
                position += len(tokens)
                mine.token_ids.extend(tokens)
                done = position >= budget
                msg = pb.GenerateResponse(request_id=request.request_id, token_ids=tokens, weight_version=self.version)
                if done and mode == "vanish":   # every token sent, then the replica dies before its final message
                    yield msg
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "replica died")
                if done:
                    msg.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                    msg.segments.extend(segments + [mine])
                yield msg
                if self.delay_s and not done:
                    try:
                        await asyncio.wait_for(abort.wait(), self.delay_s)
                    except asyncio.TimeoutError:
                        pass
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self._aborts.pop(key, None)

    async def AbortRequests(self, request, context):  # noqa: N802
        keys = [k for k in self._aborts if (not request.replica_id or k[0] == request.replica_id)
                and (request.all or k[1] in request.requests.request_ids)]
        for key in keys:
            self._aborts[key].set()
        return pb.AbortRequestsResponse(aborted_request_ids=[k[1] for k in keys])


async def start_fake(modes: dict[str, str], **kwargs) -> tuple[grpc.aio.Server, FakeReplicas, str]:
    fake = FakeReplicas(modes, **kwargs)
    server = grpc.aio.server()
    replica_agent_pb2_grpc.add_ReplicaAgentServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, fake, f"127.0.0.1:{port}"
