"""The balancer's operations on the fleet as a whole, beside request execution (:mod:`.balancer`): end a
session, flush prefix caches, remove replicas (optionally aborting their requests, which resume elsewhere), pause and resume
replicas, and rebalance requests in flight. Requests these operations abort come back to the balancer as
aborted attempts and resume with their tokens so far (:meth:`~loadbalancer.balancer.Balancer._aborted`)."""

from __future__ import annotations

import asyncio

from mesh_runtime.errors import FailedPrecondition
from mesh_runtime.reasons import Reason
from mesh_runtime.validate import check_session_id

from .attempts import cut_all
from .pauses import PauseEstimator
from .programs import ProgramAdmission
from .table import RoutingTable, Ticket
from .upstreams import Upstreams


class FleetControl:
    """See the module docstring."""

    def __init__(self, table: RoutingTable, upstreams: Upstreams, *, abort_grace_s: float,
                 pauses: PauseEstimator | None = None, programs: ProgramAdmission | None = None) -> None:
        self.table = table
        self.upstreams = upstreams
        self.abort_grace_s = abort_grace_s
        self.pauses = pauses
        self.programs = programs
        self._releases: set[asyncio.Task] = set()

    async def close_session(self, session_id: str) -> tuple[str, bool]:
        """End a session: drop its pin and tell its replica (``(replica_id, released)``; ``("", False)`` when
        it was pinned to no routed replica)."""
        check_session_id(session_id, "session_id")
        if self.pauses is not None:
            self.pauses.forget(session_id)
        active_on = self.programs.close(session_id) if self.programs is not None else ""
        replica_id = self.table.drop_session(session_id) or active_on
        route = self.table.routes.get(replica_id or "")
        if route is None:
            return "", False
        return route.replica_id, await self.upstreams.close_session(route, session_id)

    def release_holds(self, parked: list[tuple[str, str]]) -> None:
        """Parked programs' KV holds end on their replicas (in the background: the request that parked them
        does not wait)."""
        for session_id, replica_id in parked:
            route = self.table.routes.get(replica_id)
            if route is not None:
                task = asyncio.create_task(self.upstreams.close_session(route, session_id))
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)

    async def flush_cache(self, replica_ids: list[str]) -> dict[str, str]:
        """Flush the routed replicas' prefix caches (SGLang's ``/flush_cache``), all at once: per replica "" when
        it flushed, else why not (an engine keeps its cache while running requests hold blocks of it)."""
        routes = [self.table.routes[i] for i in replica_ids if i in self.table.routes]
        answers = await asyncio.gather(*(self.upstreams.flush_cache(route) for route in routes))
        return {route.replica_id: why for route, why in zip(routes, answers)}

    async def remove(self, replica_ids: list[str], abort_in_flight: bool) -> tuple[list[str], int, list[str]]:
        removed, dropped = self.table.remove(replica_ids)
        in_flight: list[str] = []
        aborts = []
        for route in removed:
            sent = [t for t in route.tickets.values() if t.sent]
            in_flight += [t.request_id for t in sent]
            if abort_in_flight and sent:
                # a live agent ends each attempt with its abort reply (a clean stream, a span without error);
                # what is still open after abort_grace_s (a frozen agent) is cut and resumed elsewhere
                reason = f"{route.replica_id} was removed from routing with abort"
                asyncio.get_running_loop().call_later(self.abort_grace_s, cut_all, sent, reason)
                aborts.append(self.upstreams.abort(route, [t.request_id for t in sent]))
        if aborts:
            await asyncio.gather(*aborts)
        return [r.replica_id for r in removed], dropped, in_flight

    async def pause(self, replica_ids: list[str], abort: bool) -> list[str]:
        """Take replicas out of picks until :meth:`resume`; requests wait for a routable replica meanwhile (the
        no-replica limit does not run during a pause). ``abort``: their requests in flight are aborted too and
        resume, with the tokens so far, where routing allows. The ids of the replicas now paused."""
        self.table.set_paused(replica_ids, True)
        routes = [self.table.routes[i] for i in replica_ids if i in self.table.routes]
        if abort:
            await asyncio.gather(*(self.upstreams.abort(route, [t.request_id for t in route.tickets.values()
                                                                if t.sent])
                                   for route in routes if any(t.sent for t in route.tickets.values())))
        return [r.replica_id for r in routes]

    def resume(self, replica_ids: list[str]) -> list[str]:
        """End a pause; the ids of the replicas routable again."""
        self.table.set_paused(replica_ids, False)
        return [i for i in replica_ids if i in self.table.routes]

    async def rebalance(self, max_moves: int | None) -> tuple[list[str], dict[str, tuple[int, int]]]:
        routes = self.table.eligible(None)
        if len(routes) < 2:
            raise FailedPrecondition(f"rebalance needs at least two routable replicas, there are {len(routes)}",
                                     reason=Reason.TOO_FEW_REPLICAS)
        self.table.clear_sticky()
        before = {r.replica_id: r.in_flight for r in routes}
        moves = self.table.plan_moves(max_moves)
        projected = dict(before)
        by_route: dict[str, list[Ticket]] = {}
        for ticket in moves:
            ticket.move_requested = True
            by_route.setdefault(ticket.route.replica_id, []).append(ticket)
            projected[ticket.route.replica_id] -= 1
            target = min((rid for rid in projected if rid != ticket.route.replica_id), key=lambda rid: projected[rid])
            projected[target] += 1
        await asyncio.gather(*(self.upstreams.abort(ts[0].route, [t.request_id for t in ts])
                               for ts in by_route.values()))
        return [t.request_id for t in moves], {rid: (before[rid], projected[rid]) for rid in before}

