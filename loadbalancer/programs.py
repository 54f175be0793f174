"""Agent programs as the unit of admission (``program_admission``): a trajectory's turns run where its KV is,
and no more trajectories run on a replica than its KV cache holds.

A *program* is a session (an agentic trajectory: its turns and the tool calls between them). Without
admission, every trajectory in flight sends its next turn as soon as its tool returns; when their contexts
add up to more than a replica's KV cache, the engine evicts the contexts of trajectories waiting on tools to
make room, and each of their next turns prefills its whole context again. Past that point the fleet spends
its time recomputing KV it threw away (the thrashing that program-aware schedulers such as ThunderAgent
avoid). Here the balancer keeps, per replica, the programs that are *active* on it and the tokens of their
contexts (a turn's prompt plus its expected completion), and keeps that sum within the replica's KV budget
(``kv_fraction`` of its KV capacity, from its load reports or ``kv_tokens``):

* an active program's turns go to its replica, whatever the routing policy would choose, and the replica holds
  its KV across the tool call (the session's KV hold);
* a new program, or one that was parked, waits at the balancer until some replica has room for its context
  (any replica with no active program has room, so a program larger than a budget still runs); the routing
  policy then chooses among the replicas with room;
* the waiting programs are served oldest first (first seen), and a program waits while an older one does:
  trajectories that started earlier, and so are nearer their end, finish before newer ones start, which
  shortens the tail of a step;
* when a turn ends and its replica's active programs have grown past the budget, the youngest programs that
  are waiting on a tool there are *parked*: their hold is released (the engine may evict their KV) and their
  next turn waits for room like a new program's;
* a program ends on ``CloseSession``, after a turn the caller marked as the last (``expected_pause`` 0), or
  after ``idle_s`` without a request.

With ``reserve_final`` > 0 admission weighs a program by its whole cost, not only its context so far: every
program, the one asking and those active on the replica, counts for at least ``reserve_final`` times the mean
final context of the programs that ended (a running mean, :data:`FINAL_WEIGHT`), so a replica takes no more
young programs than it can hold once they have grown. Parking still counts the contexts themselves: a program
is never parked for tokens it does not hold yet.

A replica whose KV capacity is not known admits every program: with no information this is the routing policy
alone. Pure bookkeeping on the caller's clock, plus the waits; the balancer (:mod:`.balancer`) asks before
each pick and tells it where requests went and when they ended.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mesh_runtime.errors import DeadlineExceeded
from mesh_runtime.reasons import Reason

from .stats import Stats

FINAL_WEIGHT = 0.05
"""Weight of each ended program's final context in the running mean ``reserve_final`` scales."""


@dataclass
class Program:
    """One session's standing in admission."""

    session_id: str
    order: int
    """First seen order: lower is older, served first."""
    replica_id: str = ""
    """Where it is active; empty while new or parked."""
    prompt: int = 0
    """The latest request's prompt tokens."""
    completions: dict[str, int] = field(default_factory=dict)
    """Its requests in flight (placed and not yet ended) and the tokens each is expected to generate."""
    last_completion: int = 0
    tokens: int = 0
    """What it counts for on its replica: the prompt plus the completions of its requests in flight (siblings
    of a GRPO group share the prompt), or the last one's while it waits on a tool."""
    last_seen: float = 0.0


class ProgramAdmission:
    """See the module docstring."""

    def __init__(self, *, kv_tokens: int = 0, kv_fraction: float = 1.0, reserve_final: float = 0.0,
                 idle_s: float = 300.0, max_programs: int = 100_000, clock: Callable[[], float],
                 stats: Stats | None = None) -> None:
        """``kv_tokens``: every replica's KV capacity in tokens (0: as :meth:`set_capacity` reports it, per
        replica). ``reserve_final``: see the module docstring. ``stats``: where waits and parks are counted."""
        self.kv_tokens = kv_tokens
        self.kv_fraction = kv_fraction
        self.reserve_final = reserve_final
        self.final_context = 0.0
        """Running mean of the final context (last prompt and completion) of the programs that ended."""
        self.idle_s = idle_s
        self.max_programs = max_programs
        self.clock = clock
        self.programs: OrderedDict[str, Program] = OrderedDict()
        """By session, least recently seen first."""
        self.capacity: dict[str, int] = {}
        """Replica -> its KV capacity in tokens, from its load reports."""
        self.active_tokens: dict[str, int] = {}
        """Replica -> the tokens of the programs active on it."""
        self.active: dict[str, dict[str, Program]] = {}
        """Replica -> the programs active on it, by session."""
        self._order = itertools.count()
        self._waiting: dict[str, tuple[int, asyncio.Event]] = {}
        self.stats = stats or Stats()

    # ------------------------------------------------------------------ state
    def budget(self, replica_id: str) -> float | None:
        """The tokens the programs active on a replica may hold (None: its capacity is not known)."""
        capacity = self.kv_tokens or self.capacity.get(replica_id, 0)
        return capacity * self.kv_fraction if capacity > 0 else None

    def set_capacity(self, replica_id: str, tokens: int) -> None:
        """A replica reported its KV capacity (0: it does not say); more room may let waiters in."""
        if tokens > 0 and self.capacity.get(replica_id) != tokens:
            self.capacity[replica_id] = tokens
            self.wake()

    def retain(self, replica_ids: Iterable[str]) -> None:
        """The table changed: the replicas not in ``replica_ids`` left it, and their programs are placed again
        (their KV went with them); waiters look again."""
        keep = set(replica_ids)
        gone = {r for r in (*self.active, *self.capacity) if r not in keep}
        for replica_id in gone:
            for program in list(self.active.get(replica_id, {}).values()):
                self._deactivate(program)       # leaves neither its tokens nor its entry in ``active``
            self.capacity.pop(replica_id, None)
        self.wake()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def replica(self, session_id: str) -> str:
        """Where a session's program is active ("" when it is not)."""
        program = self.programs.get(session_id)
        return program.replica_id if program is not None else ""

    # ------------------------------------------------------------- admission
    def allowed(self, session_id: str, tokens: int, eligible: Iterable[str]) -> frozenset[str]:
        """The replicas a request of ``session_id`` with ``tokens`` of context (its prompt plus its expected
        completion) may go to now, among ``eligible`` (the routable ones); empty: it must wait
        (:meth:`wait`)."""
        self._expire()
        program = self._program(session_id)
        eligible = set(eligible)
        if program.replica_id:
            if program.replica_id in eligible:
                return frozenset((program.replica_id,))
            self._deactivate(program)        # its replica is out of picks: it is placed again
        if any(order < program.order for order, _ in self._waiting.values()):
            return frozenset()
        floor = self.reserve_final * self.final_context
        return frozenset(r for r in eligible if self._fits(r, max(tokens, floor), floor))

    def _fits(self, replica_id: str, tokens: float, floor: float) -> bool:
        """Whether ``tokens`` more fit in the replica's budget beside its active programs, each counted for at
        least ``floor``."""
        budget = self.budget(replica_id)
        active = self.active.get(replica_id)
        if budget is None or not active:
            return True
        held = (sum(max(p.tokens, floor) for p in active.values()) if floor > 0
                else self.active_tokens.get(replica_id, 0))
        return held + tokens <= budget

    async def admit(self, session_id: str, tokens: int, eligible: Callable[[], list[str]],
                    remaining: Callable[[], float | None]) -> frozenset[str] | None:
        """Wait until a request of ``session_id`` with ``tokens`` of context may go: the replicas it may go to
        (:meth:`allowed`), or None when ``eligible()`` names none (the caller's own wait for a replica
        applies). ``remaining()``: the request's time left (None: no deadline)."""
        while True:
            ids = eligible()
            if not ids:
                self.leave(session_id)
                return None
            only = self.allowed(session_id, tokens, ids)
            if only:
                return only
            left = remaining()
            if left is not None and left <= 0:
                self.leave(session_id)
                raise DeadlineExceeded(f"session {session_id[:64]!r}: deadline passed while its program waited "
                                       "for KV room on a replica", reason=Reason.DEADLINE_EXCEEDED)
            await self.wait(session_id, self.idle_s if left is None else min(left, self.idle_s))   # idle ones expire

    async def wait(self, session_id: str, timeout_s: float | None) -> None:
        """Wait (at most ``timeout_s``) until room may have opened for this session's program: it is then the
        oldest waiting, and a turn ended, a program ended or was parked, or capacity grew. The caller asks
        :meth:`allowed` again; :meth:`placed` or :meth:`leave` ends its place in the queue."""
        program = self._program(session_id)
        entry = self._waiting.get(session_id)
        if entry is None:
            self.stats.program_waits += 1
            entry = self._waiting[session_id] = (program.order, asyncio.Event())
        event = entry[1]
        event.clear()      # the caller just found no room: only what happens from now on counts
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def leave(self, session_id: str) -> None:
        """The session's request stopped waiting (placed, failed, cancelled): its other requests waiting (a
        group's siblings) look again, and the next oldest program may go."""
        entry = self._waiting.pop(session_id, None)
        if entry is not None:
            entry[1].set()
            self.wake()

    def _head(self) -> str | None:
        return min(self._waiting, key=lambda s: self._waiting[s][0]) if self._waiting else None

    def wake(self) -> None:
        """Room may have opened: the oldest waiting program looks again."""
        head = self._head()
        if head is not None:
            self._waiting[head][1].set()

    # ------------------------------------------------------------ bookkeeping
    def placed(self, session_id: str, replica_id: str, request_id: str, *, prompt: int, completion: int = 0) -> None:
        """A request of the session was sent to ``replica_id`` with ``prompt`` tokens, expected to generate
        ``completion``: the program is active there."""
        program = self._program(session_id)
        if program.replica_id != replica_id:
            self._deactivate(program)
            program.replica_id = replica_id
            self.active.setdefault(replica_id, {})[session_id] = program
        program.prompt = prompt
        program.completions[request_id] = completion
        self._recount(program)
        self._touch(program)
        self.leave(session_id)

    def ended(self, session_id: str, request_id: str, *, last: bool = False) -> list[tuple[str, str]]:
        """A request of the session ended. ``last``: the caller said it was the session's last turn (the program
        ends). Returns the ``(session, replica)`` of the programs parked to bring that replica back within its
        budget: their KV holds should be released."""
        program = self.programs.get(session_id)
        if program is None:
            return []
        completion = program.completions.pop(request_id, None)
        if completion is not None:
            program.last_completion = completion
            self._recount(program)
        self._touch(program)
        if last:
            self.close(session_id)
            return []
        return self._park_over_budget(program.replica_id) if program.replica_id else []

    def close(self, session_id: str) -> str:
        """The session ended; the replica it was active on ("" if none)."""
        program = self.programs.pop(session_id, None)
        if program is None:
            return ""
        if program.prompt:
            final = program.prompt + program.last_completion
            self.final_context += (final - self.final_context) * (FINAL_WEIGHT if self.final_context else 1.0)
        replica_id = program.replica_id
        self._deactivate(program)
        return replica_id

    def _park_over_budget(self, replica_id: str) -> list[tuple[str, str]]:
        budget = self.budget(replica_id)
        parked: list[tuple[str, str]] = []
        if budget is None:
            return parked
        while self.active_tokens.get(replica_id, 0) > budget:
            mine = list(self.active.get(replica_id, {}).values())
            idle = [p for p in mine if not p.completions]
            if len(mine) < 2 or not idle:
                break
            youngest = max(idle, key=lambda p: p.order)
            if youngest is min(mine, key=lambda p: p.order):
                break                       # the oldest keeps its place, whatever its size
            self._deactivate(youngest)
            self.stats.programs_parked += 1
            parked.append((youngest.session_id, replica_id))
        return parked

    def _program(self, session_id: str) -> Program:
        program = self.programs.get(session_id)
        if program is None:
            while len(self.programs) >= self.max_programs:
                oldest = next(iter(self.programs.values()))
                self.close(oldest.session_id)
            program = self.programs[session_id] = Program(session_id, next(self._order), last_seen=self.clock())
        return program

    def _touch(self, program: Program) -> None:
        program.last_seen = self.clock()
        self.programs.move_to_end(program.session_id)

    def _expire(self) -> None:
        """Programs with no request for ``idle_s`` end (a trajectory that never sent CloseSession)."""
        horizon = self.clock() - self.idle_s
        while self.programs:
            program = next(iter(self.programs.values()))
            if program.last_seen > horizon:
                return
            if program.completions or program.session_id in self._waiting:
                self._touch(program)        # a long turn, or a wait: not idle
                continue
            self.close(program.session_id)

    def _recount(self, program: Program) -> None:
        if program.replica_id:
            size = program.prompt + (sum(program.completions.values()) if program.completions
                                     else program.last_completion)
            self._add(program.replica_id, size - program.tokens)
            if size < program.tokens:
                self.wake()
            program.tokens = size

    def _deactivate(self, program: Program) -> None:
        if program.replica_id:
            self._add(program.replica_id, -program.tokens)
            active = self.active.get(program.replica_id, {})
            active.pop(program.session_id, None)
            if not active:
                self.active.pop(program.replica_id, None)
            program.replica_id = ""
            program.tokens = 0
            self.wake()

    def _add(self, replica_id: str, tokens: int) -> None:
        left = self.active_tokens.get(replica_id, 0) + tokens
        if left > 0:
            self.active_tokens[replica_id] = left
        else:
            self.active_tokens.pop(replica_id, None)
