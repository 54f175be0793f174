"""How long sessions pause between their requests, and so how long a replica should hold a session's KV.

An agentic trajectory's turn often ends in a tool call: the next turn comes back after the tool ran, with the
whole context so far. If the replica evicted that context while the tool ran, the next turn prefills it
again. The balancer tells the replica to hold a session's KV for a while after each request (the agent's
``hold_kv``); the replica evicts held KV after every block nobody holds and gives it up under pressure, so a
hold costs little, but one held far longer than the session pauses keeps blocks nobody comes back for.

The hold is what the caller says (``expected_pause``: 0 on a session's last turn) or, when it says nothing, an
estimate from what the balancer saw: each pause between a session's request ending and its next one arriving
is a sample, and the hold is the ``quantile`` of the recent samples (so that fraction of returning sessions
find their KV), at most ``max_hold_s``. Before ``min_samples`` pauses were seen nothing is held. Pure
bookkeeping, no I/O; times are on the caller's clock.
"""

from __future__ import annotations

from collections import OrderedDict, deque


RECOMPUTE_EVERY = 16
"""New pauses between two computations of the estimate (a sort of the window; per request it would cost the
hot path tens of microseconds)."""


class PauseEstimator:
    """See the module docstring."""

    def __init__(self, *, max_hold_s: float, quantile: float = 0.9, window: int = 512, min_samples: int = 16,
                 max_sessions: int = 100_000) -> None:
        self.max_hold_s = max_hold_s
        self.quantile = quantile
        self.min_samples = min_samples
        self.max_sessions = max_sessions
        self._samples: deque[float] = deque(maxlen=window)
        self._ended: OrderedDict[str, float] = OrderedDict()
        self._estimate = 0.0
        self._fresh = 0        # samples since the estimate was computed

    def arrived(self, session: str, now: float) -> None:
        """A request of ``session`` arrived: the time since its previous one ended is a pause sample (one
        longer than ``10 x max_hold_s`` is a session picked up again later, not a pause, and is not counted)."""
        ended = self._ended.pop(session, None)
        if ended is None or self.max_hold_s <= 0:
            return
        pause = max(0.0, now - ended)
        if pause <= 10 * self.max_hold_s:
            self._samples.append(pause)
            self._fresh += 1

    def ended(self, session: str, now: float, *, last: bool = False) -> None:
        """A request of ``session`` completed at ``now``; ``last``: the caller said the session ends with it."""
        if last or self.max_hold_s <= 0:
            self._ended.pop(session, None)
            return
        self._ended[session] = now
        self._ended.move_to_end(session)
        while len(self._ended) > self.max_sessions:
            self._ended.popitem(last=False)

    def forget(self, session: str) -> None:
        """The session was closed."""
        self._ended.pop(session, None)

    def hold_s(self) -> float:
        """How long to hold a session's KV after a request when its caller said nothing."""
        if self.max_hold_s <= 0 or len(self._samples) < self.min_samples:
            return 0.0
        if self._fresh >= RECOMPUTE_EVERY or self._fresh == len(self._samples):   # every request would sort
            ordered = sorted(self._samples)
            self._estimate = min(self.max_hold_s, ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))])
            self._fresh = 0
        return self._estimate

    @property
    def samples(self) -> int:
        return len(self._samples)
