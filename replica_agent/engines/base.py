"""The ``Engine`` interface: one inference engine per replica.

A replica agent drives its engine only through these methods. Every method
documents the :mod:`errors` it raises; the agent maps those onto gRPC
statuses in one place.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from .errors import EngineDead, EngineUnavailable
from .types import EngineState, GenerationChunk, EngineRequest, LoadSnapshot, WeightSpec

if TYPE_CHECKING:
    from .engine_model import PrefixEvents

PauseMode = Literal["wait", "abort"]
WAKE_TAGS = frozenset({"weights", "kv_cache"})


class Engine(abc.ABC):
    """An asynchronous, continuously batching inference engine.

    All coroutine methods must be called from the event loop that called
    :meth:`start`.
    """

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and start serving (state LOADING -> ACTIVE)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Abort everything in flight, stop the decode loop and release the
        model. Idempotent."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[GenerationChunk]:
        """Stream the completion of ``request``.

        An async generator: nothing happens until it is first iterated. Chunks
        carry up to ``stream_interval`` new tokens; the final chunk carries
        ``finish_reason``, ``usage`` and ``segments``. An abort ends the stream
        normally with ``FinishReason.ABORTED`` and the partial tokens. The
        resumed prefix plus new tokens never exceed ``sampling.max_tokens``.
        Leaving the iteration early aborts the request.

        Raises (on first iteration): ``InvalidRequest``, ``DuplicateRequest``,
        ``EngineUnavailable`` (loading, paused, asleep, no weights),
        ``EngineDead``; ``EngineDead`` also mid-stream if the loop fails.
        """

    async def close_session(self, session_id: str) -> bool:
        """The session ``session_id`` ended: release what was kept for its requests (a prefix or KV
        cache). Returns whether anything was held. The default keeps nothing per session."""
        return False

    def prefix_events(self) -> PrefixEvents | None:
        """The engine's prefix-cache events (blocks stored and removed), or None where it publishes none."""
        return None

    @abc.abstractmethod
    async def abort(self, request_ids: list[str] | None = None) -> list[str]:
        """Abort the given requests (``None``: all) and return the ids that
        were in flight. Returns once their streams have received the final
        ABORTED chunk, which happens no later than the end of the decoding
        step in progress. Unknown ids are ignored."""

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = "wait") -> None:
        """Refuse new generations. ``"wait"`` returns once in-flight requests
        have finished; ``"abort"`` aborts them first. Raises ``InvalidRequest``
        for an unknown mode, ``EngineDead`` if closed or dead."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Undo :meth:`pause`. Raises ``EngineDead`` if closed or dead."""

    @abc.abstractmethod
    async def sleep(self, level: int = 1) -> int:
        """Release accelerator memory and return the bytes freed.

        In-flight requests are aborted first. Level 1 moves the weights to host
        memory and drops the KV cache; level 2 discards both (weights must then
        come from :meth:`load_weights`). Sleeping deeper than the current level
        frees what is left; sleeping again at the same level frees nothing.
        Raises ``InvalidRequest`` for another level, ``EngineDead``.
        """

    @abc.abstractmethod
    async def wake_up(self, tags: set[str] | None = None) -> None:
        """Bring back the parts named in ``tags`` (``{"weights", "kv_cache"}``;
        ``None`` or empty: both). After level 1 the weights return bit for
        bit; after level 2 they come back uninitialised and the engine awaits
        :meth:`load_weights`. Raises ``InvalidRequest`` for unknown tags."""

    @abc.abstractmethod
    async def flush_cache(self) -> None:
        """Drop every cached prefix (the KV kept from earlier requests for reuse), as SGLang's ``/flush_cache``
        does. Raises ``CacheInUse`` where the engine cannot while running requests hold cache blocks (SGLang,
        vLLM: nothing changes), ``EngineDead``."""

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, Any]]:
        """Yield ``(hf_name, tensor)`` for every weight, tied ones once.
        Raises ``EngineUnavailable`` while the weights are not resident."""

    patches_weights_in_place: bool = False
    """Whether :meth:`patch_weights` changes the served weights where they lie (a delta sync then needs no
    packed copy of them and no load)."""

    async def patch_weights(self, patch: Callable[[list[tuple[str, Any]]], object], version: int) -> None:
        """Run ``patch`` over the served weights (as :meth:`named_weights` yields them) while no step runs, then
        serve them as ``version``. ``patch`` restores whatever it changed before it raises; the old version then
        serves on. Raises ``EngineUnavailable`` while the weights are not resident and loaded, and where
        :attr:`patches_weights_in_place` is False (the default: such an engine loads a rebuilt copy)."""
        raise EngineUnavailable(f"{type(self).__name__} cannot change its weights in place; load them instead")

    @abc.abstractmethod
    def weight_spec(self) -> list[WeightSpec]:
        """Name, dtype name and shape of every weight :meth:`named_weights`
        yields, available even while asleep."""

    @abc.abstractmethod
    async def load_weights(self, named_tensors: Mapping[str, Any], version: int) -> None:
        """Atomically replace weights and set :attr:`weight_version`.

        Names, shapes and dtypes are checked against :meth:`weight_spec`
        before anything changes: on ``WeightMismatch`` the old weights keep
        serving. A subset of names is accepted while weights are loaded; the
        full set is required after a level-2 sleep. In-flight requests
        continue under the new weights (their segments record the switch).
        Raises ``WeightMismatch``, ``EngineUnavailable`` (weights asleep),
        ``EngineDead``.
        """

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights currently serving (set by ``load_weights``)."""

    @abc.abstractmethod
    def load_snapshot(self) -> LoadSnapshot:
        """Current load and recent latency figures."""

    @property
    @abc.abstractmethod
    def state(self) -> EngineState:
        """Coarse lifecycle state."""


class LifecycleFlags:
    """The lifecycle flags every engine keeps, what they imply, and the request plumbing every engine shares.

    Engines set the flags; ``state`` and ``weight_version`` are derived here
    once, so every backend reports states the same way, and the checks that
    refuse work (:meth:`_check_alive`, :meth:`_check_serving`) and the chunk
    stream of one request (:meth:`_chunks`) are written once. Put it before
    :class:`Engine` in the bases.
    """

    _dead: BaseException | None = None
    _closed: bool = False
    _started: bool = False
    _weights_resident: bool = True
    _kv_resident: bool = True
    _weights_loaded: bool = True
    _paused: bool = False
    _weight_version: int = 0

    @property
    def state(self) -> EngineState:
        if self._dead is not None:
            return EngineState.DEAD
        if self._closed:
            return EngineState.CLOSED
        if not self._started:
            return EngineState.LOADING
        if not (self._weights_resident and self._kv_resident):
            return EngineState.SLEEPING
        if not self._weights_loaded:
            return EngineState.AWAITING_WEIGHTS
        if self._paused:
            return EngineState.PAUSED
        return EngineState.ACTIVE

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def _check_alive(self) -> None:
        """Raise ``EngineDead`` (failed or closed) or ``EngineUnavailable`` (still loading)."""
        if self._dead is not None:
            raise EngineDead(f"engine failed: {self._dead!r}")
        if self._closed:
            raise EngineDead("engine is closed")
        if not self._started:
            raise EngineUnavailable("engine is still loading")

    def _check_serving(self) -> None:
        """Raise ``EngineUnavailable`` unless the engine takes new requests (awake, weights loaded, not paused)."""
        if not (self._weights_resident and self._kv_resident):
            raise EngineUnavailable("engine is asleep")
        if not self._weights_loaded:
            raise EngineUnavailable("engine has no weights loaded")
        if self._paused:
            raise EngineUnavailable("engine is paused")

    @staticmethod
    async def _chunks(queue: asyncio.Queue, abandon: Callable[[], None]) -> AsyncGenerator[GenerationChunk, None]:
        """A request's chunks from ``queue`` up to the final one; an exception put there is raised.

        Leaving before the final chunk (the caller stopped iterating, or was
        cancelled) calls ``abandon`` - the engine aborts the request. Callers
        that re-yield must ``aclose()`` this iterator in a ``finally`` so the
        abort happens at once, not when the iterator is garbage-collected.
        """
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if not finished:
                abandon()
