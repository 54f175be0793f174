"""The agent's side of ``GenerateMany``: many generations on one stream.

Each started generation runs in a task of its own (the same code path as a
``Generate`` call, :meth:`ReplicaAgentServicer.generations`), which puts its
messages on the stream's one outgoing queue; the response side takes
everything queued at once and sends it as one ``GenerateManyResponse``, so
under load one message carries the chunks of many requests. A failed
generation becomes an item with its ``google.rpc.Status`` (the status a
``Generate`` call would have ended with); the others go on. When the stream
ends, every generation still on it is cancelled, which aborts it in its engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from opentelemetry import context as otel_context
from opentelemetry import propagate

from mesh_runtime.errors import AlreadyExists, DeadlineExceeded, Internal, canonical, status_proto
from mesh_runtime.reasons import Reason
from rollmesh.replica.v1 import replica_agent_pb2 as pb

log = logging.getLogger(__name__)

Generations = Callable[[pb.GenerateRequest], AsyncIterator[pb.GenerateResponse]]
"""A ``Generate`` call's messages for one request (validation included)."""

_END = object()


class Multiplexer:
    """One ``GenerateMany`` stream: its generations' tasks and its outgoing queue."""

    def __init__(self, generations: Generations) -> None:
        self._generations = generations
        self._out: asyncio.Queue = asyncio.Queue()
        self._tasks: dict[str, asyncio.Task] = {}

    async def serve(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> AsyncIterator[pb.GenerateManyResponse]:
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                first = await self._out.get()
                if first is _END:
                    return
                items = [first]
                while not self._out.empty():   # everything queued meanwhile goes in the same message
                    item = self._out.get_nowait()
                    if item is _END:
                        yield pb.GenerateManyResponse(items=items)
                        return
                    items.append(item)
                yield pb.GenerateManyResponse(items=items)
        finally:
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()   # the caller went away: abort what it will never read

    async def _read(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> None:
        try:
            async for request in requests:
                for action in request.actions:
                    which = action.WhichOneof("action")
                    if which == "generate":
                        self._start(action)
                    elif which == "cancel_request_id":
                        task = self._tasks.get(action.cancel_request_id)
                        if task is not None:
                            task.cancel()
        finally:   # the caller closed its side: finish what runs, then end the stream
            if self._tasks:
                await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            self._out.put_nowait(_END)

    def _start(self, request: pb.GenerateManyAction) -> None:
        generate = request.generate
        request_id = generate.request_id
        if request_id in self._tasks:
            self._out.put_nowait(pb.GenerateManyItem(request_id=request_id, error=status_proto(AlreadyExists(
                f"request {request_id[:64]!r} is already in flight on this stream", reason=Reason.REQUEST_IN_FLIGHT))))
            return
        timeout = request.timeout.ToNanoseconds() / 1e9 if request.HasField("timeout") else None
        parent = propagate.extract(dict(request.trace_context)) if request.trace_context else None
        token = otel_context.attach(parent) if parent is not None else None
        try:   # the task copies the context: its spans continue the caller's trace
            task = asyncio.ensure_future(self._run(generate, timeout))
        finally:
            if token is not None:
                otel_context.detach(token)
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))

    async def _run(self, generate: pb.GenerateRequest, timeout: float | None) -> None:
        request_id, put = generate.request_id, self._out.put_nowait
        try:
            async with asyncio.timeout(timeout):
                async for message in self._generations(generate):
                    put(pb.GenerateManyItem(request_id=request_id, response=message))
        except asyncio.CancelledError:
            raise   # cancelled by the caller: nothing more is sent for it
        except TimeoutError:
            put(pb.GenerateManyItem(request_id=request_id, error=status_proto(DeadlineExceeded(
                f"request {request_id[:64]!r} ran past its timeout", reason=Reason.DEADLINE_EXCEEDED))))
        except Exception as exc:  # noqa: BLE001 - reported to the caller as that generation's status
            mapped = canonical(exc)
            if mapped is None:
                log.exception("generation %s failed", request_id)
                mapped = Internal(f"internal error in GenerateMany: {type(exc).__name__}: {exc}")
            put(pb.GenerateManyItem(request_id=request_id, error=status_proto(mapped)))
