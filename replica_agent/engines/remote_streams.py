"""What the out-of-process engines (vLLM, SGLang) share: one task per request feeding its
:class:`~.delta_stream.RequestStream`, aborts that wait for the engine's final output, death, and the
Hugging Face view of the served weights (:class:`~.served_weights.WeightCatalog`).


:class:`RemoteStreams` is mixed into such an engine before :class:`~.base.LifecycleFlags`. The engine
implements :meth:`RemoteStreams._submit` (validate, build the stream, start its task with
:meth:`_spawn`), :meth:`RemoteStreams._abort_remote` (tell the engine to abort request ids) and
:meth:`RemoteStreams._shutdown` (release the client, and the engine if it started one); it keeps its
client in ``_client``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from .delta_stream import RequestStream
from .errors import EngineDead, EngineError, EngineUnavailable, InvalidRequest
from .served_weights import WeightCatalog
from .types import FinishReason, GenerationChunk, EngineRequest, WeightSpec

log = logging.getLogger(__name__)


class RemoteStreams:
    """Request streams of an engine that runs elsewhere (see the module docstring)."""

    ABORT_GRACE_S = 2.0
    """How long ``abort`` waits for the engine's final output before ending a stream itself."""

    engine_name = "engine"
    replica_id: str
    _requests: dict[str, RequestStream]
    _idle: asyncio.Event
    _background: set[asyncio.Task[Any]]
    _dead: BaseException | None
    _closed: bool
    _client: Any
    _weight_version: int
    _catalog: WeightCatalog | None
    _weights_resident: bool
    _weights_loaded: bool

    def _submit(self, request: EngineRequest) -> RequestStream:
        raise NotImplementedError

    async def _abort_remote(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError

    def _remote_reachable(self) -> bool:
        return self._client is not None and self._dead is None

    async def close(self) -> None:
        """Abort what is in flight, stop the background tasks, then shut the engine down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._requests:
            await self.abort(None)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._shutdown()

    async def generate(self, request: EngineRequest) -> AsyncIterator[GenerationChunk]:
        stream = self._submit(request)

        def abandon() -> None:
            if not stream.done.is_set():
                self._spawn(self.abort([stream.request_id]))

        chunks = self._chunks(stream.queue, abandon)   # type: ignore[attr-defined]  # from LifecycleFlags
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    def _spawn(self, coro: Any, name: str | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` as a task that ``close`` cancels if it is still running."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _retire(self, stream: RequestStream) -> None:
        if self._requests.get(stream.request_id) is stream:
            del self._requests[stream.request_id]
        if not self._requests:
            self._idle.set()

    def _mark_dead(self, exc: BaseException) -> None:
        if self._dead is None:
            log.error("%s engine %r is dead: %r", self.engine_name, self.replica_id, exc)
            self._dead = exc
        for stream in list(self._requests.values()):
            stream.fail(EngineDead(f"engine failed: {exc!r}"))
            self._retire(stream)

    async def abort(self, request_ids: list[str] | None = None) -> list[str]:
        if request_ids is None:
            targets = list(self._requests.values())
        else:
            targets = [self._requests[i] for i in request_ids if i in self._requests]
        live = [s for s in targets if not s.done.is_set()]
        for stream in live:
            stream.abort_requested = True
        if live and self._remote_reachable():
            try:
                await self._abort_remote([s.request_id for s in live])
            except EngineDead:
                pass
            except EngineError as exc:
                log.warning("%s engine %r: abort failed: %s", self.engine_name, self.replica_id, exc)
        await self._settle(live)
        return [s.request_id for s in targets]

    async def _settle(self, streams: list[RequestStream]) -> None:
        """Wait for the engine's final outputs; end the streams it leaves open."""
        pending = [s for s in streams if not s.done.is_set()]
        if not pending:
            return
        waits = [asyncio.ensure_future(s.done.wait()) for s in pending]
        _, late = await asyncio.wait(waits, timeout=self.ABORT_GRACE_S)
        for w in late:
            w.cancel()
        stragglers = [s for s in pending if not s.done.is_set()]
        if stragglers:
            log.info("%s engine %r: ending %d aborted stream(s) without the engine's final output",
                     self.engine_name, self.replica_id, len(stragglers))
        for stream in stragglers:
            stream.finish(FinishReason.ABORTED, self._weight_version)
            if stream.task is not None:
                stream.task.cancel()
        tasks = [s.task for s in stragglers if s.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.ABORT_GRACE_S)

    # -- the served weights, by Hugging Face name ----------------------------------------------------
    @property
    def catalog(self) -> WeightCatalog:
        """The served model's weights (EngineUnavailable while the engine is still loading)."""
        if self._catalog is None:
            raise EngineUnavailable("engine is still loading")
        return self._catalog

    def weight_spec(self) -> list[WeightSpec]:
        return list(self.catalog.spec)

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        if self._catalog is None or not (self._weights_resident and self._weights_loaded):
            raise EngineUnavailable("weights are not resident (loading, asleep or awaiting a reload)")
        if not self._catalog.exportable:
            raise EngineUnavailable("weights were updated and keep_host_weights is off: no host copy to export")
        return self._catalog.tensors()

    @staticmethod
    def _check_version(version: object) -> None:
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidRequest(f"weight version must be an integer, got {version!r}")

    def _check_update(self, named_tensors: Mapping[str, Any]) -> None:
        """Refuse an update the engine cannot take now or that does not fit the model (nothing changes)."""
        if not self._weights_resident:
            raise EngineUnavailable("weights are asleep; call wake_up({'weights'}) before load_weights")
        self.catalog.check(named_tensors, require_complete=not self._weights_loaded)
