"""Who is routed: the one rule, and the one writer of every load balancer's routing table.

Transitions do not edit balancer tables. They change what the rule reads (the registry's replica states, the
weight versions, the hold and admission marks below, the stale set) and ask :class:`Routing` to converge the
replicas they touched; a level-triggered round (:meth:`Routing.reconcile`, every ``reconcile_interval_s``)
makes every balancer's whole table match the same rule, so a lost call, a restarted balancer or a stray
``RemoveReplicas`` heals (docs/architecture.md, principle 8).

The rule, for a replica the registry knows:

* **routed** when a transition admitted it (a woken hybrid replica, routed while PAUSED before it resumes; a
  scale-out's replicas, routed before their operation ends), or when it is ACTIVE, no scale operation owns
  it, and it is standalone at the current weight version (or none is set yet) or hybrid while the hybrid
  replicas are active (docs/known-weaknesses.md, 19);
* **never routed** when a transition took it out of service (a hybrid release, a scale-in drain, a replica
  that failed mid-transition), when its last weight sync failed (stale: until a later sync succeeds), or
  when its state cannot serve (failed, stopped, removed, asleep, draining, launching, loading), or when the
  registry does not know it;
* otherwise left as it is: a replica in the middle of a transition (SYNCING during a serving sync keeps
  serving) is neither added nor removed.

The controller core asks for the two transition marks through its routing port
(:meth:`Routing.take_out`, :meth:`Routing.bring_in`: :class:`controller.core.ports.RoutingPort`), so
hybrid deactivation and a scale-in drain take replicas out of service the same way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from .core.records import ReplicaKind, ReplicaRecord, ReplicaState
from .core.replicas import ReplicaRegistry
from .ports import LoadBalancerRouting, OneBalancer

log = logging.getLogger(__name__)
S = ReplicaState

CANNOT_SERVE = frozenset({S.FAILED, S.STOPPED, S.REMOVED, S.SLEEPING, S.DRAINING, S.LAUNCHING, S.LOADING})
"""States in which a replica must not be in a balancer's table."""
_SETTLED_OUT = frozenset({S.FAILED, S.STOPPED, S.REMOVED, S.SLEEPING})
"""States that keep a replica out by themselves: a transition's hold on it is no longer needed."""


class Routing:
    """The routing reconciler; also the controller core's ``RoutingPort``."""

    def __init__(self, registry: ReplicaRegistry, tables: LoadBalancerRouting, *,
                 weight_version: Callable[[], int | None] = lambda: None,
                 hybrid_active: Callable[[], bool] = lambda: False,
                 owned: Callable[[ReplicaRecord], bool] = lambda record: False) -> None:
        self.registry = registry
        self.tables = tables
        """Every balancer's table over gRPC (configured and registered balancers)."""
        self._weight_version = weight_version
        self._hybrid_active = hybrid_active
        self._owned = owned
        self.stale: set[str] = set()
        """Replicas whose last weight sync failed: out of routing until a later one succeeds."""
        self.held: dict[str, str] = {}
        """Replicas a transition took out of service, with why (until their state keeps them out by itself)."""
        self.admitted: set[str] = set()
        """Replicas a transition routes ahead of the rule (until the rule routes them by itself)."""

    def bind(self, *, weight_version: Callable[[], int | None], hybrid_active: Callable[[], bool],
             owned: Callable[[ReplicaRecord], bool]) -> None:
        """Give the rule what the controller builds after the reconciler (the scheduler, the scaler)."""
        self._weight_version, self._hybrid_active, self._owned = weight_version, hybrid_active, owned

    @property
    def balancers(self) -> list[OneBalancer]:
        return self.tables.balancers

    # ------------------------------------------------------------------------------------------ the rule
    def _serves_by_rule(self, record: ReplicaRecord) -> bool:
        if record.state is not S.ACTIVE or self._owned(record):
            return False
        if record.kind is ReplicaKind.HYBRID:
            return self._hybrid_active()
        current = self._weight_version()
        return current is None or record.weight_version >= current

    def _prune(self, replica_id: str) -> ReplicaRecord | None:
        """The record (None when unknown), with transition marks its state has made unneeded dropped."""
        record = self.registry.get(replica_id) if replica_id in self.registry else None
        if record is None or record.state in _SETTLED_OUT:
            self.held.pop(replica_id, None)
        if record is None or record.state in CANNOT_SERVE or (
                replica_id in self.admitted and self._serves_by_rule(record)):
            self.admitted.discard(replica_id)
        return record

    def routes(self, replica_id: str) -> bool:
        """Whether the rule routes this replica now."""
        record = self._prune(replica_id)
        if record is None or replica_id in self.held or replica_id in self.stale:
            return False
        return replica_id in self.admitted or self._serves_by_rule(record)

    def must_not_route(self, replica_id: str) -> bool:
        """Whether no balancer may route this replica now (the rule's second clause)."""
        record = self._prune(replica_id)
        return (record is None or record.state in CANNOT_SERVE or replica_id in self.held
                or replica_id in self.stale)

    def wanted(self) -> set[str]:
        """Every replica the rule routes now (marks of replicas the registry forgot are dropped)."""
        for replica_id in [r for r in (*self.held, *self.admitted) if r not in self.registry]:
            self._prune(replica_id)
        return {r.replica_id for r in self.registry.replicas() if self.routes(r.replica_id)}

    # ----------------------------------------------------------------------------------- converging
    async def converge(self, replica_ids: Sequence[str], *, abort_in_flight: bool = False) -> None:
        """Make every balancer route exactly what the rule says of these replicas (the others are left as
        they are). ``abort_in_flight``: the removed replicas' open requests there end now and resume elsewhere
        (a replica whose lease lapsed may be frozen). Raises when no balancer took the change."""
        ids = list(dict.fromkeys(replica_ids))
        out = [r for r in ids if self.must_not_route(r)]
        into = [self.registry.get(r) for r in ids if self.routes(r)]
        if out:
            await self.tables.remove_replicas(out, abort_in_flight=abort_in_flight)
        if into:
            await self.tables.add_replicas(into)

    async def take_out(self, replica_ids: Sequence[str], *, why: str = "taken out of service",
                       abort_in_flight: bool = False) -> None:
        """A transition takes these replicas out of service (a hybrid release, a scale-in drain, a failed
        replica): held out of routing from now on, and out of every balancer before this returns. When no
        balancer takes the change, nothing changed and the error is raised."""
        ids = list(replica_ids)
        with self._marks_kept_on_failure(ids):
            self.held.update(dict.fromkeys(ids, why))
            self.admitted.difference_update(ids)
            await self.converge(ids, abort_in_flight=abort_in_flight)

    async def bring_in(self, replica_ids: Sequence[str]) -> None:
        """A transition puts these replicas into service now (a woken hybrid replica before it resumes, a
        scale-out's synced replicas): routed ahead of the rule until the rule routes them by itself. When
        no balancer takes the change, nothing changed and the error is raised."""
        ids = list(replica_ids)
        with self._marks_kept_on_failure(ids):
            for replica_id in ids:
                self.held.pop(replica_id, None)
            self.admitted.update(ids)
            await self.converge(ids)

    async def to_rule(self, replica_ids: Sequence[str]) -> None:
        """The transition that held or admitted these replicas is over without taking them where it meant
        to (a scale-in that did not finish): their marks are dropped and they are routed as the rule says."""
        ids = list(replica_ids)
        for replica_id in ids:
            self.held.pop(replica_id, None)
        self.admitted.difference_update(ids)
        await self.converge(ids)

    @contextlib.contextmanager
    def _marks_kept_on_failure(self, ids: list[str]) -> Iterator[None]:
        """The marks of ``ids`` as they were before the block, back again when it raises (nothing changed)."""
        held, admitted = {r: self.held.get(r) for r in ids}, self.admitted & set(ids)
        try:
            yield
        except BaseException:
            self._restore(held, admitted)
            raise

    def _restore(self, held: dict[str, str | None], admitted: set[str]) -> None:
        for replica_id, why in held.items():
            if why is None:
                self.held.pop(replica_id, None)
            else:
                self.held[replica_id] = why
            if replica_id in admitted:
                self.admitted.add(replica_id)
            else:
                self.admitted.discard(replica_id)

    async def update_versions(self, versions: dict[str, int]) -> None:
        """Tell every balancer the weight versions replicas hold now (its version floors read them)."""
        await self.tables.update_versions(versions)

    async def rebalance(self) -> int | None:
        return await self.tables.rebalance()

    async def clear_sticky(self) -> None:
        await self.tables.clear_sticky()

    async def routed_ids(self) -> set[str] | None:
        """The replica ids in the first balancer's table now (None without a balancer)."""
        return await self.tables.routed_ids()

    # ----------------------------------------------------------------------------- the level-triggered round
    async def reconcile(self, *, observe: Callable[[dict[str, Any]], None] | None = None,
                        after_round: Callable[[str, bool], None] | None = None) -> tuple[list[str], list[str]]:
        """Make every balancer's whole table match the rule; ``(added, removed)``. The caller holds the
        controller's transitions lock. A balancer that cannot be reached is skipped (the others are still
        reconciled); only when none can be is its error raised. ``observe(table)`` sees the first balancer's
        table as read; ``after_round(address, ok)`` hears how each balancer's round went."""
        added: list[str] = []
        removed: list[str] = []
        failures: list[BaseException] = []
        balancers = self.tables.balancers
        for index, balancer in enumerate(balancers):   # each balancer's table on its own
            try:
                routed = await balancer.routed()
                if index == 0 and observe is not None:
                    observe(routed)
                missing = sorted(self.wanted() - set(routed))
                extra = sorted(r for r in routed if self.must_not_route(r))
                if missing:
                    await balancer.add_replicas([self.registry.get(r) for r in missing])
                if extra:
                    await balancer.remove_replicas(extra, abort_in_flight=True)
            except grpc.aio.AioRpcError as err:
                failures.append(err)
                if after_round is not None:
                    after_round(balancer.address, False)
                continue
            if after_round is not None:
                after_round(balancer.address, True)
            if missing or extra:
                log.warning("routing of balancer %s reconciled: re-added %s, removed %s", balancer.address,
                            missing or "none", extra or "none")
            added += [r for r in missing if r not in added]
            removed += [r for r in extra if r not in removed]
        if failures and len(failures) == len(balancers):
            raise failures[0]
        return added, removed
