"""The bounded message queue between the rollouter and the trainer.

Samples enter in whole GRPO groups (``put_group``) and leave in batches
(``get_batch``). When the queue is full the *oldest* queued samples are
dropped to make room, and only those are counted as dropped: the new samples
are always kept (known weakness 14). Eviction removes the whole front group,
so a partially dropped group never reaches the trainer.

Counters are exact at every await point::

    generated == consumed + dropped + size()

A rollouter failure is reported with ``fail(exc)``: every later (and every
waiting) ``get_batch`` raises :class:`RolloutFailed` instead of returning an
end of data (known weakness 16). ``close()`` is the normal end of data.

``state_dict()`` / ``load_state_dict()`` carry the queued samples and the
counters across a checkpoint (known weakness 17).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

STATE_VERSION = 1


class QueueClosed(RuntimeError):
    """A sample was put into a queue that was closed or failed."""


class RolloutFailed(RuntimeError):
    """The producer (rollouter) failed; the trainer must fail, not finish."""


@dataclass
class Sample:
    """One completion of one prompt.

    ``weight_versions`` and ``segment_lengths`` are parallel: one entry per
    generation segment (an attempt that contributed tokens; more than one
    when the load balancer resumed an aborted attempt elsewhere).
    ``param_version`` is the trainer's parameter version when the rollouter
    submitted the request. A multi-turn trajectory (:mod:`.trajectory`) also has
    tool and user turns in ``completion_ids``: ``loss_mask`` marks the model's
    tokens, their segments carry weight version -1, and the turn counts say
    what happened.
    """

    group_id: str
    index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    param_version: int
    weight_versions: list[int] = field(default_factory=list)
    segment_lengths: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    reward: float | None = None
    loss_mask: list[int] = field(default_factory=list)
    """Per completion token: 1 where the model generated it, 0 for tool and user turns; empty = all 1."""
    assistant_turns: int = 1
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_reward: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        return cls(
            group_id=str(data["group_id"]),
            index=int(data["index"]),
            prompt_ids=[int(t) for t in data["prompt_ids"]],
            completion_ids=[int(t) for t in data["completion_ids"]],
            logprobs=[float(x) for x in data["logprobs"]],
            param_version=int(data["param_version"]),
            weight_versions=[int(v) for v in data.get("weight_versions", [])],
            segment_lengths=[int(v) for v in data.get("segment_lengths", [])],
            finish_reason=str(data.get("finish_reason", "stop")),
            reward=None if data.get("reward") is None else float(data["reward"]),
            loss_mask=[int(v) for v in data.get("loss_mask", [])],
            assistant_turns=int(data.get("assistant_turns", 1)), user_turns=int(data.get("user_turns", 0)),
            tool_calls=int(data.get("tool_calls", 0)), tool_errors=int(data.get("tool_errors", 0)),
            tool_reward=float(data.get("tool_reward", 0.0)),
        )


@dataclass
class BatchResult:
    """What one ``get_batch`` call returned.

    ``wait_samples`` is ``max(0, requested - size_at_start)``: the samples
    the trainer had to wait on for generation (the ``step_wait_samples``
    signal), computed from the request size even when the call timed out
    with fewer samples. ``waited_s`` is measured with the queue's clock.
    """

    samples: list[Sample]
    requested: int
    size_at_start: int
    wait_samples: int
    waited_s: float
    timed_out: bool
    end_of_data: bool


class MessageQueue:
    """Bounded FIFO of samples, dropping the oldest group when full."""

    def __init__(self, max_queue_size: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if max_queue_size <= 0:
            raise ValueError(f"max_queue_size must be > 0, got {max_queue_size}")
        self._max = int(max_queue_size)
        self._clock = clock
        self._items: deque[Sample] = deque()
        self._generated = 0
        self._consumed = 0
        self._dropped = 0
        self._closed = False
        self._error: BaseException | None = None
        self._changed = asyncio.Event()
        self._consume_listeners: list[Callable[[], None]] = []

    # -- producer side -------------------------------------------------

    @property
    def max_queue_size(self) -> int:
        return self._max

    def put(self, sample: Sample) -> int:
        """Put one sample; returns how many queued samples were dropped."""
        return self.put_group([sample])

    def put_group(self, samples: Iterable[Sample]) -> int:
        """Put a group atomically; returns how many old samples were dropped.

        The new samples are never dropped. To make room, whole groups are
        evicted from the front (oldest first); every evicted sample is
        counted in ``dropped``.
        """
        new = list(samples)
        if self._error is not None or self._closed:
            raise QueueClosed("queue is closed" if self._error is None else "queue failed")
        if len(new) > self._max:
            raise ValueError(f"group of {len(new)} samples exceeds max_queue_size {self._max}")
        dropped = 0
        while len(self._items) + len(new) > self._max:
            dropped += self._evict_front_group()
        self._items.extend(new)
        self._generated += len(new)
        self._dropped += dropped
        self._changed.set()
        return dropped

    def _evict_front_group(self) -> int:
        group_id = self._items[0].group_id
        n = 0
        while self._items and self._items[0].group_id == group_id:
            self._items.popleft()
            n += 1
        return n

    def close(self) -> None:
        """Normal end of data: waiting consumers return what is left."""
        self._closed = True
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        """Producer failure: consumers raise :class:`RolloutFailed`."""
        if self._error is None:
            self._error = error
        self._changed.set()

    # -- consumer side -------------------------------------------------

    def add_consume_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every consumption (room was made)."""
        self._consume_listeners.append(callback)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RolloutFailed(f"rollout failed: {self._error!r}") from self._error

    async def get_batch(self, n: int, timeout: float | None) -> BatchResult:
        """Take up to ``n`` samples, waiting at most ``timeout`` seconds.

        Returns early with what is queued when the queue is closed (end of
        data) or the wait times out. Raises :class:`RolloutFailed` when the
        producer failed, leaving the queued samples in place.
        """
        if n <= 0:
            raise ValueError(f"n must be > 0, got {n}")
        self._raise_if_failed()
        start = self._clock()
        size_at_start = len(self._items)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(0.0, timeout)
        timed_out = False
        while len(self._items) < n and not self._closed and self._error is None:
            self._changed.clear()
            if deadline is None:
                await self._changed.wait()
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                timed_out = True
                break
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                timed_out = len(self._items) < n
                break
        self._raise_if_failed()
        take = min(n, len(self._items))
        batch = [self._items.popleft() for _ in range(take)]
        self._consumed += take
        if take:
            for callback in list(self._consume_listeners):
                callback()
        return BatchResult(
            samples=batch,
            requested=n,
            size_at_start=size_at_start,
            wait_samples=max(0, n - size_at_start),
            waited_s=self._clock() - start,
            timed_out=timed_out,
            end_of_data=self._closed and not self._items,
        )

    # -- introspection -------------------------------------------------

    def size(self) -> int:
        return len(self._items)

    @property
    def generated(self) -> int:
        return self._generated

    @property
    def consumed(self) -> int:
        return self._consumed

    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def error(self) -> BaseException | None:
        return self._error

    def stats(self) -> dict[str, int]:
        return {
            "generated": self._generated,
            "consumed": self._consumed,
            "dropped": self._dropped,
            "size": len(self._items),
            "max_queue_size": self._max,
        }

    def peek(self) -> list[Sample]:
        """The queued samples, oldest first (copies of the references)."""
        return list(self._items)

    # -- checkpoint ----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-friendly snapshot: queued samples and counters.

        Closed/failed state is not saved: a restored queue is open.
        """
        return {
            "version": STATE_VERSION,
            "max_queue_size": self._max,
            "samples": [s.to_dict() for s in self._items],
            "generated": self._generated,
            "consumed": self._consumed,
            "dropped": self._dropped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a snapshot. The current ``max_queue_size`` is kept; if the
        snapshot holds more samples than fit, the oldest groups are dropped
        and counted as dropped."""
        if int(state.get("version", 0)) != STATE_VERSION:
            raise ValueError(f"unsupported queue state version {state.get('version')!r}")
        samples = [Sample.from_dict(d) for d in state["samples"]]
        self._items = deque(samples)
        self._generated = int(state["generated"])
        self._consumed = int(state["consumed"])
        self._dropped = int(state["dropped"])
        if self._generated != self._consumed + self._dropped + len(self._items):
            raise ValueError("queue state counters do not add up")
        while len(self._items) > self._max:
            self._dropped += self._evict_front_group()
        self._closed = False
        self._error = None
        self._changed.set()
