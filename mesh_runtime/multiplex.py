"""Many generations on one gRPC stream: the ``GenerateMany`` methods of the balancer and the replica agent.

A call per generation costs both sides a call's set-up, metadata,
interceptors and teardown whatever the length of the answer. On one
long-lived bidirectional stream a generation costs an action out and its
messages back, and each side sends what it has queued at once, so under load
one message carries many generations. Both contracts shape the stream alike
(``GenerateManyRequest.actions`` of ``GenerateManyAction``: start a
``GenerateRequest`` or cancel a request id, with its trace context and
timeout; ``GenerateManyResponse.items`` of ``GenerateManyItem``: a request's
next message or its ``google.rpc.Status``), so this module serves and calls
either, given the message classes.

* :class:`Multiplexer` serves one stream: each generation runs in a task of
  its own through the same code as a unary ``Generate`` call; a failed one
  becomes an item with the status that call would have ended with; when the
  stream ends every generation still on it is cancelled.
* :class:`SharedStream` is the caller's side of one stream, and
  :class:`StreamedCall` one generation on it, shaped like a ``Generate``
  call: an async iterator of the responses that raises
  ``grpc.aio.AioRpcError`` with the generation's status when it fails (the
  stream breaking fails every generation on it, as a dead server fails each
  of its calls), ``asyncio.CancelledError`` once :meth:`StreamedCall.cancel`
  was called, and ``DEADLINE_EXCEEDED`` past its timeout.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.rpc import status_pb2
from opentelemetry import context as otel_context
from opentelemetry import propagate

from .durations import set_seconds, to_seconds
from .errors import AlreadyExists, DeadlineExceeded, Internal, canonical, status_proto
from .reasons import Reason

log = logging.getLogger(__name__)
_END = object()
_CODES = {code.value[0]: code for code in grpc.StatusCode}

Generations = Callable[[Any, float | None], AsyncIterator[Any]]
"""(a GenerateRequest, seconds it may take or None) -> the messages a ``Generate`` call would stream."""


MAX_BATCH_BYTES = 1 << 20
"""Most serialized bytes of the items batched into one stream message (a lone larger item goes alone): far
below gRPC's 4 MiB default receive limit, so a burst of long prompts never makes a message a peer refuses."""


async def batches(queue: asyncio.Queue, end: object, max_bytes: int = MAX_BATCH_BYTES) -> AsyncIterator[list[Any]]:
    """What was put on ``queue`` since the last batch, as lists of at most ``max_bytes`` serialized bytes
    (one message on the stream each), until ``end`` is taken from it."""
    carry: Any = None
    while True:
        first = carry if carry is not None else await queue.get()
        carry = None
        if first is end:
            return
        batch, size = [first], first.ByteSize()
        while not queue.empty():
            item = queue.get_nowait()
            if item is end:
                yield batch
                return
            size += item.ByteSize()
            if size > max_bytes:
                carry = item
                break
            batch.append(item)
        yield batch


# ------------------------------------------------------------------------------------------------ serving

class Multiplexer:
    """One ``GenerateMany`` stream being served: its generations' tasks and its outgoing queue."""

    def __init__(self, generations: Generations, *, item: type, response: type) -> None:
        self._generations = generations
        self._item, self._response = item, response
        self._out: asyncio.Queue = asyncio.Queue()
        self._tasks: dict[str, asyncio.Task] = {}

    async def serve(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        reader = asyncio.ensure_future(self._read(requests))
        try:
            async for items in batches(self._out, _END):
                yield self._response(items=items)
        finally:
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()   # the caller went away: abort what it will never read

    async def _read(self, requests: AsyncIterator[Any]) -> None:
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

    def _start(self, action: Any) -> None:
        generate = action.generate
        request_id = generate.request_id
        if request_id in self._tasks:
            self._out.put_nowait(self._item(request_id=request_id, error=status_proto(AlreadyExists(
                f"request {request_id[:64]!r} is already in flight on this stream", reason=Reason.REQUEST_IN_FLIGHT))))
            return
        timeout = to_seconds(action.timeout) if action.HasField("timeout") else None
        parent = propagate.extract(dict(action.trace_context)) if action.trace_context else None
        token = otel_context.attach(parent) if parent is not None else None
        try:   # the task copies the context: its spans continue the caller's trace
            task = asyncio.ensure_future(self._run(generate, timeout))
        finally:
            if token is not None:
                otel_context.detach(token)
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))

    async def _run(self, generate: Any, timeout: float | None) -> None:
        request_id, put, item = generate.request_id, self._out.put_nowait, self._item
        try:
            async with asyncio.timeout(timeout):
                async for message in self._generations(generate, timeout):
                    put(item(request_id=request_id, response=message))
        except asyncio.CancelledError:
            raise   # cancelled by the caller: nothing more is sent for it
        except TimeoutError:
            put(item(request_id=request_id, error=status_proto(DeadlineExceeded(
                f"request {request_id[:64]!r} ran past its timeout", reason=Reason.DEADLINE_EXCEEDED))))
        except Exception as exc:  # noqa: BLE001 - reported to the caller as that generation's status
            mapped = canonical(exc)
            if mapped is None:
                log.exception("generation %s failed", request_id)
                mapped = Internal(f"internal error in GenerateMany: {type(exc).__name__}: {exc}")
            put(item(request_id=request_id, error=status_proto(mapped)))


# ------------------------------------------------------------------------------------------------ calling

def rpc_error(status: status_pb2.Status) -> grpc.aio.AioRpcError:
    """The error a ``Generate`` call would have raised with ``status`` (details such as ErrorInfo kept)."""
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString()))
    return grpc.aio.AioRpcError(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), grpc.aio.Metadata(), trailing,
                                status.message)


class StreamedCall:
    """One generation on a :class:`SharedStream`, shaped like a ``Generate`` call (see the module docstring).
    ``fallback()`` makes the ``Generate`` call it becomes when the server has no ``GenerateMany``."""

    __slots__ = ("request_id", "_stream", "_fallback", "_inner", "_inner_call", "_messages", "_waiter", "_error",
                 "_finished", "_cancelled", "_timer", "_loop")

    def __init__(self, stream: SharedStream, request_id: str, timeout_s: float | None,
                 fallback: Callable[[], Any]) -> None:
        self.request_id = request_id
        self._stream = stream
        self._fallback = fallback
        self._inner: Any = None
        """The fallback call's iterator, once the server said it has no GenerateMany."""
        self._inner_call: Any = None
        self._messages: collections.deque[Any] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._finished = self._cancelled = False
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(timeout_s, self._expire) if timeout_s is not None else None

    # -- fed by the stream's reader
    def deliver(self, message: Any) -> None:
        self._messages.append(message)
        self._wake()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if self._error is None and not self._finished:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED and self._inner is None and not self._cancelled:
                self._inner_call = self._fallback()   # nothing ran there: the server has no GenerateMany
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

    # -- read by the caller
    def __aiter__(self) -> StreamedCall:
        return self

    async def __anext__(self) -> Any:
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
            except asyncio.CancelledError:
                if not self._cancelled:
                    self.cancel()   # its reader was cancelled: stop the generation, as a call's would be
                raise
            finally:
                self._waiter = None

    def _done(self) -> None:
        self._finished = True
        if self._timer is not None:
            self._timer.cancel()

    def cancel(self) -> bool:
        """Stop the generation: the server aborts it, and a read pending or made after this raises
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


class SharedStream:
    """The caller's side of one open ``GenerateMany`` stream and the generations on it.

    ``open_call(requests)`` opens the stream (e.g. ``stub.GenerateMany``); ``action`` and ``request`` are the
    contract's GenerateManyAction and GenerateManyRequest classes; ``on_end(stream, error)`` is told once
    when the stream is over (``error`` says how).
    """

    def __init__(self, open_call: Callable[[AsyncIterator[Any]], Any], address: str, *, action: type,
                 request: type, on_end: Callable[[SharedStream, grpc.aio.AioRpcError], None]) -> None:
        self.address = address
        self._action, self._request = action, request
        self._on_end = on_end
        self._outgoing: asyncio.Queue[Any] = asyncio.Queue()
        self._calls: dict[str, StreamedCall] = {}
        self.broken = False
        self._call = open_call(self._requests())
        self._reader = asyncio.ensure_future(self._read())

    async def _requests(self) -> AsyncIterator[Any]:
        async for actions in batches(self._outgoing, None):
            yield self._request(actions=actions)

    def start(self, request: Any, timeout_s: float | None, trace_context: dict[str, str],
              fallback: Callable[[], Any]) -> StreamedCall:
        """Send ``request`` now; its :class:`StreamedCall`."""
        call = StreamedCall(self, request.request_id, timeout_s, fallback)
        self._calls[request.request_id] = call
        action = self._action(generate=request, trace_context=trace_context)
        if timeout_s is not None:
            set_seconds(action.timeout, timeout_s)
        self._outgoing.put_nowait(action)
        return call

    def cancel(self, request_id: str) -> None:
        if self._calls.pop(request_id, None) is not None and not self.broken:
            self._outgoing.put_nowait(self._action(cancel_request_id=request_id))

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
                                         "the stream was closed by its caller")
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


class StreamPool:
    """One :class:`SharedStream` per server address, used for a server once ``probe(address)`` said it
    serves ``GenerateMany`` (until then, and for a server without it, ``fallback()`` makes a ``Generate``
    call). A probe that fails is made again on a later generation, at most every ``PROBE_RETRY_S``.

    ``open_call(address)`` is that server's ``GenerateMany`` method (e.g. ``stub.GenerateMany``);
    ``probe(address)`` reads its capabilities (raises ``grpc.aio.AioRpcError`` when it cannot);
    ``action`` and ``request`` are the contract's message classes.
    """

    PROBE_RETRY_S = 5.0

    def __init__(self, *, open_call: Callable[[str], Callable[[AsyncIterator[Any]], Any]],
                 probe: Callable[[str], Any], action: type, request: type, what: str = "server",
                 on_broken: Callable[[str, grpc.aio.AioRpcError], Any] | None = None) -> None:
        """``on_broken(address, error)`` is told when a stream to ``address`` broke."""
        self._open_call, self._probe_call, self._on_broken = open_call, probe, on_broken
        self._action, self._request, self._what = action, request, what
        self._streams: dict[str, SharedStream] = {}
        self._supported: dict[str, bool] = {}
        self._probes: dict[str, asyncio.Task] = {}
        self._probed_at: dict[str, float] = {}

    @property
    def unsupported(self) -> set[str]:
        """Servers that have no GenerateMany: their generations are Generate calls."""
        return {address for address, ok in self._supported.items() if not ok}

    def generate(self, address: str, request: Any, timeout_s: float | None, trace_context: dict[str, str],
                 fallback: Callable[[], Any]) -> Any:
        """Start a generation on the server's stream (sent now), or ``fallback()`` where it has none (yet)."""
        supported = self._supported.get(address)
        if not supported:
            if supported is None:
                self._probe(address)
            return fallback()
        stream = self._streams.get(address)
        if stream is None or stream.broken:
            stream = self._streams[address] = SharedStream(self._open_call(address), address, action=self._action,
                                                           request=self._request, on_end=self._ended)
        return stream.start(request, timeout_s, trace_context, fallback)

    async def check(self, address: str) -> bool:
        """Probe ``address`` now (unless known) and say whether its generations go on a stream."""
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
            supported = bool(await self._probe_call(address))
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._supported[address] = False
            log.debug("capability probe of %s %s failed: %s", self._what, address, err.code().name)
            return   # asked again on a later generation
        self._supported[address] = supported
        if not supported:
            log.info("%s %s does not serve GenerateMany: Generate calls to it", self._what, address)

    def _ended(self, stream: SharedStream, error: grpc.aio.AioRpcError) -> None:
        if self._streams.get(stream.address) is stream:
            del self._streams[stream.address]
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:   # e.g. replaced by an older version
            log.info("%s %s does not serve GenerateMany: Generate calls to it", self._what, stream.address)
            self._supported[stream.address] = False
        elif error.code() != grpc.StatusCode.CANCELLED:
            log.info("GenerateMany stream to %s %s ended: %s %s", self._what, stream.address, error.code().name,
                     error.details())
            if self._on_broken is not None:
                self._on_broken(stream.address, error)

    async def close(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        streams, self._streams = list(self._streams.values()), {}
        await asyncio.gather(*(s.close() for s in streams), return_exceptions=True)


async def serves_generate_many(stub: Any, request: Any, timeout_s: float) -> bool:
    """Whether the server behind ``stub`` lists the ``generate_many`` capability (its ``GetStatus``)."""
    reply = await stub.GetStatus(request, timeout=timeout_s)
    return "generate_many" in reply.status.capabilities
