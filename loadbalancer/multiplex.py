"""The balancer's side of ``GenerateMany``: one stream per agent carries every attempt sent there.

A gRPC call per attempt costs the balancer and the agent a call's set-up,
metadata, interceptors and teardown on both sides, whatever the length of the
answer; on one long-lived stream an attempt costs a message out and its
chunks back, and the agent batches the chunks of many attempts into one
message. :class:`AgentStreams` keeps one :class:`AgentStream` per agent
address, opened on first use and again after it broke. An attempt gets a
:class:`StreamedCall`, which looks to the balancer like a ``Generate`` call:
an async iterator of the agent's ``GenerateResponse`` messages that raises
``grpc.aio.AioRpcError`` with the generation's status when it fails (the
stream breaking fails every attempt on it, as a dead agent fails each of its
calls), ``asyncio.CancelledError`` once :meth:`StreamedCall.cancel` was
called, and ``DEADLINE_EXCEEDED`` past its timeout. An agent that does not
serve ``GenerateMany`` (an older one) answers UNIMPLEMENTED: its address is
remembered and its attempts fall back to a ``Generate`` call each.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

import grpc
from google.rpc import status_pb2

from rollmesh.replica.v1 import replica_agent_pb2 as pb

log = logging.getLogger(__name__)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(status: status_pb2.Status) -> grpc.aio.AioRpcError:
    """The error a ``Generate`` call would have raised with ``status`` (details such as ErrorInfo kept)."""
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), grpc.aio.Metadata(), trailing,
                                status.message)


class StreamedCall:
    """One attempt on an agent's stream, shaped like a ``Generate`` call (see the module docstring)."""

    __slots__ = ("request_id", "_stream", "_fallback", "_inner", "_inner_call", "_messages", "_waiter", "_error", "_finished",
                 "_cancelled", "_timer", "_loop")

    def __init__(self, stream: AgentStream, request_id: str, timeout_s: float | None,
                 fallback: Callable[[], Any]) -> None:
        self.request_id = request_id
        self._stream = stream
        self._fallback = fallback
        self._inner: Any = None
        """The fallback call's iterator, once the agent said it has no GenerateMany."""
        self._inner_call: Any = None
        self._messages: collections.deque[pb.GenerateResponse] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._finished = self._cancelled = False
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(timeout_s, self._expire) if timeout_s is not None else None

    # -- fed by the stream's reader
    def deliver(self, message: pb.GenerateResponse) -> None:
        self._messages.append(message)
        self._wake()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if self._error is None and not self._finished:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED and self._inner is None and not self._cancelled:
                self._inner_call = self._fallback()   # nothing ran there: the agent does not serve GenerateMany
                self._inner = self._inner_call.__aiter__()
                if self._timer is not None:
                    self._timer.cancel()   # the call has its own deadline
            else:
                self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _expire(self) -> None:
        self._stream.cancel(self.request_id)
        self.fail(grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Deadline Exceeded"))

    # -- read by the attempt
    def __aiter__(self) -> StreamedCall:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        while True:
            if self._cancelled:
                raise asyncio.CancelledError
            if self._inner is not None:
                return await self._inner.__anext__()
            if self._messages:
                message = self._messages.popleft()
                if message.finish_reason:
                    self._done()
                return message
            if self._error is not None:
                self._done()
                raise self._error
            if self._finished:
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _done(self) -> None:
        self._finished = True
        if self._timer is not None:
            self._timer.cancel()

    def cancel(self) -> bool:
        """Stop the attempt: the agent aborts it, and a read pending or made after this raises
        ``asyncio.CancelledError`` (as a cancelled call's would)."""
        if self._inner_call is not None:
            return self._inner_call.cancel()
        if self._cancelled:
            return False
        self._cancelled = True
        if not self._finished:
            self._stream.cancel(self.request_id)
        self._done()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()
        return True


class AgentStream:
    """One open ``GenerateMany`` stream to an agent and the attempts on it."""

    def __init__(self, stub, address: str, on_end: Callable[[AgentStream, grpc.aio.AioRpcError], None]) -> None:
        self.address = address
        self._on_end = on_end
        self._outgoing: asyncio.Queue[pb.GenerateManyAction | None] = asyncio.Queue()
        self._calls: dict[str, StreamedCall] = {}
        self.broken = False
        self._call = stub.GenerateMany(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    async def _requests(self):
        """Everything queued since the last message, in one message."""
        queue = self._outgoing
        while (first := await queue.get()) is not None:
            actions = [first]
            while not queue.empty():
                action = queue.get_nowait()
                if action is None:
                    yield pb.GenerateManyRequest(actions=actions)
                    return
                actions.append(action)
            yield pb.GenerateManyRequest(actions=actions)

    def start(self, request: pb.GenerateRequest, timeout_s: float | None, trace_context: dict[str, str],
              fallback: Callable[[], Any]) -> StreamedCall:
        call = StreamedCall(self, request.request_id, timeout_s, fallback)
        self._calls[request.request_id] = call
        message = pb.GenerateManyAction(generate=request, trace_context=trace_context)
        if timeout_s is not None:
            message.timeout.FromNanoseconds(int(max(0.0, timeout_s) * 1e9))
        self._outgoing.put_nowait(message)
        return call

    def cancel(self, request_id: str) -> None:
        if self._calls.pop(request_id, None) is not None and not self.broken:
            self._outgoing.put_nowait(pb.GenerateManyAction(cancel_request_id=request_id))

    async def _read(self) -> None:
        error: grpc.aio.AioRpcError
        try:
            async for response in self._call:
                calls = self._calls
                for item in response.items:
                    call = calls.get(item.request_id)
                    if call is None:
                        continue   # cancelled meanwhile
                    if item.HasField("error"):
                        del calls[item.request_id]
                        call.fail(rpc_error(item.error))
                        continue
                    if item.response.finish_reason:
                        del calls[item.request_id]
                    call.deliver(item.response)
            error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                         f"the GenerateMany stream to {self.address} ended")
        except grpc.aio.AioRpcError as err:
            error = err
        except asyncio.CancelledError:
            error = grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                         "the balancer closed the stream")
        self.broken = True
        self._on_end(self, error)
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.fail(error)

    async def close(self) -> None:
        self._outgoing.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class AgentStreams:
    """One :class:`AgentStream` per agent address (see the module docstring).

    An agent is sent attempts on a stream once a ``GetStatus`` probe saw it list the ``generate_many``
    capability; until then (and for an agent without it) its attempts are Generate calls. A probe that
    fails is made again on a later attempt, at most every ``PROBE_RETRY_S``.
    """

    PROBE_RETRY_S = 5.0

    def __init__(self, stub_for: Callable[[str], Any], *, probe_timeout_s: float = 5.0) -> None:
        self._stub_for = stub_for
        self._probe_timeout_s = probe_timeout_s
        self._streams: dict[str, AgentStream] = {}
        self._supported: dict[str, bool] = {}
        self._probes: dict[str, asyncio.Task] = {}
        self._probed_at: dict[str, float] = {}

    @property
    def unsupported(self) -> set[str]:
        """Agents that have no GenerateMany: their attempts are Generate calls."""
        return {address for address, ok in self._supported.items() if not ok}

    def generate(self, address: str, request: pb.GenerateRequest, timeout_s: float | None,
                 trace_context: dict[str, str], fallback: Callable[[], Any]):
        """Start an attempt on the agent's stream (sent now), or ``fallback()`` where it has none (yet)."""
        supported = self._supported.get(address)
        if not supported:
            if supported is None:
                self._probe(address)
            return fallback()
        stream = self._streams.get(address)
        if stream is None or stream.broken:
            stream = self._streams[address] = AgentStream(self._stub_for(address), address, self._ended)
        return stream.start(request, timeout_s, trace_context, fallback)

    async def check(self, address: str) -> bool:
        """Probe ``address`` now (unless known) and say whether its attempts go on a stream."""
        if address not in self._supported:
            await self._ask(address)
        return bool(self._supported.get(address))

    def _probe(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        if address in self._probes or loop.time() - self._probed_at.get(address, -1e9) < self.PROBE_RETRY_S:
            return
        self._probed_at[address] = loop.time()
        task = self._probes[address] = asyncio.ensure_future(self._ask(address))
        task.add_done_callback(lambda _: self._probes.pop(address, None))

    async def _ask(self, address: str) -> None:
        try:
            reply = await self._stub_for(address).GetStatus(pb.GetStatusRequest(), timeout=self._probe_timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._supported[address] = False
            log.debug("capability probe of %s failed: %s", address, err.code().name)
            return   # asked again on a later attempt
        self._supported[address] = "generate_many" in reply.status.capabilities
        if not self._supported[address]:
            log.info("agent %s does not serve GenerateMany: Generate calls to it", address)

    def _ended(self, stream: AgentStream, error: grpc.aio.AioRpcError) -> None:
        if self._streams.get(stream.address) is stream:
            del self._streams[stream.address]
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:   # e.g. the agent was replaced by an older one
            log.info("agent %s does not serve GenerateMany: Generate calls to it", stream.address)
            self._supported[stream.address] = False
        elif error.code() != grpc.StatusCode.CANCELLED:
            log.info("GenerateMany stream to %s ended: %s %s", stream.address, error.code().name, error.details())

    async def close(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)
