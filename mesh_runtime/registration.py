"""The one loop that keeps a server registered with the controller: run a registration session, and when it
ends, run another after the controller's ``RetryInfo`` or a jittered exponential backoff.

A *session* is whatever one registration means to its server: a replica agent registers its node, then holds
the lease on its load-report stream; a balancer registers, then renews every heartbeat interval. A session
never returns normally; it raises :class:`LinkLost` (or lets an ``AioRpcError`` of its calls through) when the
registration is gone. The backoff starts over after a session that had registered, so a controller restart
costs one short wait, while a controller that keeps refusing is asked ever less often (up to
``max_backoff_s``). A refusal that an operator must fix on the other side (a bad address, a certificate for
another server) is logged as an error; a controller that is down or busy, as a warning.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable

import grpc

from .retry import RetryPolicy, permanent, retry_after

log = logging.getLogger(__name__)


class LinkLost(Exception):
    """A registration session ended: register again."""

    def __init__(self, why: str, *, retry_after_s: float | None = None, registered: bool = False,
                 refused: bool = False) -> None:
        super().__init__(why)
        self.retry_after_s = retry_after_s
        """The controller's RetryInfo: register again after exactly this long (it spreads a storm out)."""
        self.registered = registered
        """Whether the session had registered before it ended (the backoff then starts over)."""
        self.refused = refused
        """The controller refused the registration (an operator's fix of either side heals it)."""

    @classmethod
    def from_rpc(cls, what: str, err: grpc.aio.AioRpcError, *, registered: bool = False) -> LinkLost:
        """A failed call of the session: the server's RetryInfo kept; a refusal told from an outage."""
        refused = permanent(err) or err.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                                   grpc.StatusCode.ALREADY_EXISTS)
        return cls(f"{what}: {err.code().name}: {err.details()}", retry_after_s=retry_after(err),
                   registered=registered, refused=refused)


async def keep_registered(session: Callable[[], Awaitable[object]], *, what: str, first_backoff_s: float = 0.2,
                          max_backoff_s: float = 5.0, rng: random.Random | None = None) -> None:
    """Run ``session()`` again and again until cancelled (see the module's docstring). ``what`` names the
    registration in the log lines."""
    policy = RetryPolicy(initial_s=first_backoff_s, max_s=max(max_backoff_s, first_backoff_s), jitter=(0.5, 1.5),
                         rng=rng)

    async def once() -> None:   # a session only ever ends in a LinkLost
        try:
            await session()
            lost = LinkLost("the session ended")
        except LinkLost as err:
            lost = err
        except grpc.aio.AioRpcError as err:
            lost = LinkLost.from_rpc("a call failed", err)
        raise lost

    def told(err: BaseException, wait: float) -> None:
        refused = isinstance(err, LinkLost) and err.refused
        log.log(logging.ERROR if refused else logging.WARNING, "%s lost (%s); registering again in %.2f s",
                what, err, wait)

    await policy.run(once, retry_if=lambda err: isinstance(err, LinkLost), on_retry=told,
                     wait_hint=lambda err: err.retry_after_s if isinstance(err, LinkLost) else None,
                     progressed=lambda err: isinstance(err, LinkLost) and err.registered)
