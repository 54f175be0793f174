"""Program admission (loadbalancer/programs.py): sessions as programs that run where their KV is, admitted while
a replica's KV budget has room, oldest first, the youngest idle ones parked when a replica's programs outgrow
it; on a virtual clock."""

from __future__ import annotations

import asyncio

import pytest

from loadbalancer.config import LoadBalancerConfig
from loadbalancer.programs import ProgramAdmission
from mesh_runtime.config import ConfigError, load_config
from mesh_runtime.errors import DeadlineExceeded

pytestmark = pytest.mark.timeout(30)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def admission(**kw) -> tuple[ProgramAdmission, Clock]:
    clock = Clock()
    programs = ProgramAdmission(clock=clock, **kw)
    for replica in ("a", "b"):
        programs.set_capacity(replica, 1000)
    return programs, clock


def test_an_active_program_goes_to_its_replica_only():
    programs, _ = admission()
    assert programs.allowed("s", 300, ["a", "b"]) == {"a", "b"}
    programs.placed("s", "a", "s-0", prompt=300)
    programs.ended("s", "s-0")
    assert programs.allowed("s", 500, ["a", "b"]) == {"a"}   # its KV is on a, whatever the policy would choose
    programs.placed("s", "a", "s-1", prompt=500)
    assert programs.active_tokens == {"a": 500}             # its context grew: counted once, at its new size


def test_a_groups_siblings_count_their_prompt_once_and_each_completion():
    programs, _ = admission()
    for i in range(4):                                       # a GRPO group: one session, one prompt
        programs.placed("g", "a", f"g-{i}", prompt=200, completion=100)
    assert programs.active_tokens == {"a": 600}
    programs.ended("g", "g-0")
    assert programs.active_tokens == {"a": 500}
    for i in range(1, 4):
        programs.ended("g", f"g-{i}")
    assert programs.active_tokens == {"a": 300}              # idle: the prompt and the last completion


def test_a_new_program_goes_only_where_there_is_room_and_waits_when_there_is_none():
    programs, _ = admission()
    programs.placed("s1", "a", "s1-0", prompt=800)
    assert programs.allowed("new", 300, ["a", "b"]) == {"b"}
    programs.placed("s2", "b", "s2-0", prompt=900)
    assert programs.allowed("new", 300, ["a", "b"]) == frozenset()
    assert programs.allowed("new", 100, ["a", "b"]) == {"a", "b"}   # a smaller one fits both


def test_a_replica_with_no_active_program_admits_one_larger_than_its_budget():
    programs, _ = admission()
    assert programs.allowed("huge", 5000, ["a"]) == {"a"}
    programs.placed("huge", "a", "h-0", prompt=5000)
    assert programs.allowed("next", 10, ["a"]) == frozenset()


def test_without_a_known_capacity_every_program_is_admitted():
    programs = ProgramAdmission(clock=Clock())
    for i in range(50):
        assert programs.allowed(f"s{i}", 100_000, ["a", "b"]) == {"a", "b"}
        programs.placed(f"s{i}", "a", f"r{i}", prompt=100_000)
    fixed = ProgramAdmission(clock=Clock(), kv_tokens=1000, kv_fraction=0.5)   # kv_tokens sets every replica's
    fixed.placed("s", "a", "r", prompt=400)
    assert fixed.budget("a") == 500 and fixed.allowed("t", 200, ["a", "b"]) == {"b"}


def test_waiting_programs_go_oldest_first_and_a_younger_one_waits_behind_an_older_one():
    async def scenario():
        programs, _ = admission()
        programs.placed("s1", "a", "s1-0", prompt=900)
        programs.placed("s2", "b", "s2-0", prompt=900)
        order: list[str] = []

        async def request(session: str, tokens: int) -> None:
            only = await programs.admit(session, tokens, lambda: ["a", "b"], lambda: None)
            assert only
            programs.placed(session, sorted(only)[0], f"{session}-0", prompt=tokens)
            order.append(session)

        old = asyncio.ensure_future(request("old", 500))
        await asyncio.sleep(0)
        young = asyncio.ensure_future(request("young", 50))   # it fits now, but an older program waits
        await asyncio.sleep(1)
        assert order == [] and programs.waiting == 2 and programs.stats.program_waits == 2
        assert programs.close("s1") == "a"                     # room on a: the oldest goes, then the next
        await asyncio.gather(old, young)
        return order, programs

    order, programs = asyncio.run(scenario())
    assert order == ["old", "young"] and programs.waiting == 0
    assert programs.replica("old") == "a" and programs.active_tokens == {"a": 550, "b": 900}


def test_a_replica_outgrown_by_its_programs_parks_the_youngest_idle_one():
    programs, _ = admission()
    programs.placed("oldest", "a", "o-0", prompt=300)
    programs.placed("middle", "a", "m-0", prompt=300)
    programs.placed("young", "a", "y-0", prompt=300)
    for session, rid in (("middle", "m-0"), ("young", "y-0")):
        assert programs.ended(session, rid) == []              # within the budget: nothing parked
    programs.placed("oldest", "a", "o-1", prompt=600)     # the oldest's context grew: 1,200 of 1,000
    assert programs.ended("oldest", "o-1") == [("young", "a")]  # the youngest idle one goes, its hold released
    assert programs.replica("young") == "" and programs.active_tokens == {"a": 900}
    assert programs.stats.programs_parked == 1
    assert programs.allowed("young", 400, ["a"]) == frozenset()  # its next turn waits for room like a new one


def test_a_program_with_a_turn_running_and_the_oldest_are_never_parked():
    programs, _ = admission()
    programs.placed("oldest", "a", "o-0", prompt=900)
    programs.placed("young", "a", "y-0", prompt=50)       # still running
    programs.ended("oldest", "o-0")
    programs.placed("oldest", "a", "o-1", prompt=1500)
    assert programs.ended("oldest", "o-1") == []               # the young one is running; the oldest stays
    assert programs.ended("young", "y-0") == [("young", "a")]  # idle now: parked


def test_a_last_turn_an_idle_program_and_a_removed_replica_end_a_programs_place():
    programs, clock = admission(idle_s=60)
    programs.placed("s", "a", "s-0", prompt=400)
    assert programs.ended("s", "s-0", last=True) == [] and "s" not in programs.programs
    programs.placed("quiet", "a", "q-0", prompt=400)
    programs.ended("quiet", "q-0")
    clock.now = 61
    programs.allowed("other", 10, ["a"])                       # looking expires what idled past idle_s
    assert "quiet" not in programs.programs and programs.active_tokens == {}
    programs.placed("t", "b", "t-0", prompt=400)
    programs.retain(["a"])                                     # b left the table: t is placed again
    assert programs.replica("t") == "" and "b" not in programs.capacity
    assert programs.allowed("t", 400, ["a"]) == {"a"}


def test_an_active_programs_replica_out_of_picks_places_it_again():
    programs, _ = admission()
    programs.placed("s", "a", "s-0", prompt=400)
    programs.ended("s", "s-0")
    assert programs.allowed("s", 400, ["b"]) == {"b"}          # a is not eligible (ejected): placed again
    assert programs.active_tokens == {}


def test_a_wait_ends_at_the_deadline_and_leaves_the_queue():
    async def scenario():
        programs, _ = admission()
        programs.placed("s1", "a", "s1-0", prompt=900)
        programs.placed("s2", "b", "s2-0", prompt=900)
        left = [0.5]

        def remaining():
            left[0] -= 0.5
            return left[0]

        with pytest.raises(DeadlineExceeded, match="waited for KV room"):
            await programs.admit("late", 500, lambda: ["a", "b"], remaining)
        return programs.waiting

    assert asyncio.run(scenario()) == 0


def test_no_eligible_replica_is_not_an_admission_wait():
    async def scenario():
        programs, _ = admission()
        return await programs.admit("s", 10, lambda: [], lambda: None), programs.waiting

    assert asyncio.run(scenario()) == (None, 0)


def test_whole_program_cost_counts_each_program_for_a_share_of_the_mean_final_context():
    programs, _ = admission(reserve_final=0.5)
    assert programs.allowed("new", 100, ["a"]) == {"a"}        # no program ended yet: contexts as they are
    for i, final in enumerate((800, 1200)):                    # two programs end at 800 and 1,200 tokens
        programs.placed(f"done{i}", "b", f"d{i}", prompt=final - 100, completion=100)
        programs.ended(f"done{i}", f"d{i}", last=True)
    assert programs.final_context == pytest.approx(800 + 0.05 * 400)   # 820: a running mean
    floor = 0.5 * programs.final_context                       # 410 tokens a program counts for at least
    programs.placed("young", "a", "y-0", prompt=100)
    assert programs.active_tokens == {"a": 100}                # its real context: what parking counts
    assert programs.allowed("next", 100, ["a"]) == {"a"}       # 410 + 410 of 1,000
    programs.placed("next", "a", "n-0", prompt=100)
    assert programs.allowed("third", 100, ["a"]) == frozenset()   # 3 x 410 > 1,000, with 300 tokens held
    without, _ = admission()
    for session in ("young", "next"):
        without.placed(session, "a", f"{session}-0", prompt=100)
    assert without.allowed("third", 100, ["a"]) == {"a"}       # by contexts so far, a has room for many
    programs.placed("grown", "b", "g-0", prompt=700)           # larger than the floor: counted as it is
    assert programs.allowed("small", 100, ["b"]) == frozenset() and 700 + floor > 1000
    assert programs.ended("grown", "g-0") == []                # 700 real tokens: within the budget, not parked


@pytest.mark.parametrize(("key", "value", "message"), [
    ("kv_tokens", -1, "must be >= 0"),
    ("reserve_final", -0.5, "must be in [0, 4]"),
    ("kv_fraction", 0, "must be in (0, 4]"),
    ("idle_s", 0, "must be > 0"),
    ("report_interval_s", float("inf"), "finite"),
])
def test_bad_settings_are_refused(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        load_config(LoadBalancerConfig, None, overrides={"program_admission": {key: value}})


# ----------------------------------------------------------------------------------- in the balancer, virtual time

def _balancer(replicas: list[str], kv_tokens: int, **admission):
    from tests.loadbalancer.test_balancer_virtual_time import Upstreams, balancer

    class Closing(Upstreams):
        def __init__(self, modes):
            super().__init__(modes)
            self.closed: list[tuple[float, str, str]] = []

        async def close_session(self, route, session_id):
            self.closed.append((asyncio.get_running_loop().time(), route.replica_id, session_id))
            return True

    lb = balancer({r: "ok" for r in replicas}, routing_policy="least_loaded",
                  program_admission={"enabled": True, "kv_tokens": kv_tokens, **admission})
    lb.upstreams = Closing(lb.upstreams.modes)
    lb.control.upstreams = lb.upstreams
    lb.programs.clock = lb.clock
    return lb


async def _turn(lb, request_id: str, session: str, prompt: int, max_tokens: int = 40, last: bool = False):
    from google.protobuf import duration_pb2

    from rollmesh.common.v1 import generation_pb2
    from rollmesh.loadbalancer.v1 import loadbalancer_pb2 as pb

    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=list(range(1, prompt + 1)),
                                 session_id=session,
                                 sampling_params=generation_pb2.SamplingParams(max_tokens=max_tokens))
    if last:
        request.expected_pause.CopyFrom(duration_pb2.Duration())
    last = None
    async for msg in lb.generate(request, None):
        last = msg
    return asyncio.get_running_loop().time(), last.attempts[-1].replica_id


def test_the_balancer_holds_a_new_program_until_a_replica_has_room_then_routes_it_there():
    """kv_tokens 100 and turns of 3 prompt tokens + 40 expected: two programs per replica. A fifth waits until a
    session closes, then runs on that session's replica; its wait is counted."""
    from simulator.vloop import run_virtual
    from tests.loadbalancer.test_balancer_virtual_time import PER_TOKEN_S, Idle

    async def scenario():
        lb = _balancer(["a", "b"], 100)
        first = await asyncio.gather(*(_turn(lb, f"s{i}-0", f"s{i}", 3) for i in range(4)))
        placed = {f"s{i}": replica for i, (_, replica) in enumerate(first)}
        fifth = asyncio.ensure_future(_turn(lb, "s4-0", "s4", 3))
        await asyncio.sleep(10)
        assert not fifth.done() and lb.programs.waiting == 1
        await lb.control.close_session("s1")
        ended, replica = await fifth
        return placed, ended, replica, lb

    placed, ended, replica, lb = run_virtual(Idle(), scenario())
    assert sorted(placed.values()) == ["a", "a", "b", "b"]
    assert replica == placed["s1"]
    assert ended == pytest.approx(40 * PER_TOKEN_S + 10 + 40 * PER_TOKEN_S)   # it started when s1 closed
    assert lb.stats.program_waits == 1 and lb.upstreams.closed[0][1:] == (placed["s1"], "s1")


def test_the_balancer_admits_by_whole_program_cost_once_programs_have_ended():
    """reserve_final 1.0: after a program ended at 100 tokens (60 of prompt, 40 generated), every program counts
    for 100 of a replica's 100, so turns of 43 tokens run one program per replica (by context, two would)."""
    from simulator.vloop import run_virtual
    from tests.loadbalancer.test_balancer_virtual_time import Idle

    async def scenario():
        lb = _balancer(["a", "b"], 100, reserve_final=1.0)
        await _turn(lb, "done-0", "done", 60, last=True)           # the program ends with its last turn
        final = lb.programs.final_context
        first = await asyncio.gather(*(_turn(lb, f"s{i}-0", f"s{i}", 3) for i in range(2)))
        third = asyncio.ensure_future(_turn(lb, "s2-0", "s2", 3))
        await asyncio.sleep(10)
        waited = not third.done() and lb.programs.waiting == 1
        await lb.control.close_session("s0")
        return final, [r for _, r in first], waited, (await third)[1]

    final, first, waited, third = run_virtual(Idle(), scenario())
    assert final == 100 and sorted(first) == ["a", "b"]
    assert waited and third == first[0]                        # it went where s0 ended


def test_the_balancer_releases_the_hold_of_a_program_it_parks_and_its_next_turn_waits():
    from simulator.vloop import run_virtual
    from tests.loadbalancer.test_balancer_virtual_time import PER_TOKEN_S, Idle

    async def scenario():
        lb = _balancer(["a"], 100)
        await asyncio.gather(_turn(lb, "s1-0", "s1", 3), _turn(lb, "s2-0", "s2", 3))   # 86 of 100
        grown_end, _ = await _turn(lb, "s1-1", "s1", 30)          # s1 now holds 70: 113 > 100, s2 is parked
        await asyncio.sleep(0)                                    # the hold's release runs in the background
        closed = list(lb.upstreams.closed)
        later = asyncio.ensure_future(_turn(lb, "s2-1", "s2", 10))
        await asyncio.sleep(5)
        waiting = lb.programs.waiting
        await lb.control.close_session("s1")
        return grown_end, closed, waiting, await later, lb

    grown_end, closed, waiting, (ended, replica), lb = run_virtual(Idle(), scenario())
    assert closed == [(grown_end, "a", "s2")] and lb.stats.programs_parked == 1
    assert waiting == 1 and replica == "a"
    assert ended == pytest.approx(grown_end + 5 + 40 * PER_TOKEN_S)


def test_a_program_whose_replica_fails_is_placed_again_on_another():
    from simulator.vloop import run_virtual
    from tests.loadbalancer.test_balancer_virtual_time import Idle

    async def scenario():
        lb = _balancer(["a", "b"], 100)
        _, first = await _turn(lb, "s-0", "s", 3)
        lb.upstreams.modes[first] = "down"
        _, second = await _turn(lb, "s-1", "s", 3)
        return first, second, lb.programs.replica("s"), [replica for _, replica in lb.upstreams.calls]

    first, second, active, calls = run_virtual(Idle(), scenario())
    assert second != first and active == second
    assert calls == [first, first, second]      # one failed attempt, then the program moved


def test_a_waiting_program_gets_in_when_an_idle_one_expires_with_nothing_else_happening():
    from simulator.vloop import run_virtual
    from tests.loadbalancer.test_balancer_virtual_time import Idle

    async def scenario():
        loop = asyncio.get_running_loop()
        programs = ProgramAdmission(clock=loop.time, kv_tokens=1000, idle_s=60)
        programs.placed("gone", "a", "g-0", prompt=900)
        programs.ended("gone", "g-0")                     # its client went away without CloseSession
        only = await programs.admit("new", 500, lambda: ["a"], lambda: None)
        return only, loop.time()

    only, admitted_at = run_virtual(Idle(), scenario())
    assert only == {"a"} and 60 <= admitted_at <= 120


def test_a_groups_siblings_still_wait_and_go_when_one_of_them_leaves_the_queue():
    async def scenario():
        programs, _ = admission()
        programs.placed("s1", "a", "s1-0", prompt=900)
        programs.placed("s2", "b", "s2-0", prompt=900)
        placed: list[str] = []

        async def sibling(i: int) -> None:
            only = await programs.admit("g", 300, lambda: ["a", "b"], lambda: None)
            programs.placed("g", sorted(only)[0], f"g-{i}", prompt=200, completion=100)
            placed.append(f"g-{i}")

        siblings = [asyncio.ensure_future(sibling(i)) for i in range(4)]
        await asyncio.sleep(1)
        assert placed == []
        siblings[0].cancel()           # its caller went away: the balancer's request ends with leave()
        programs.leave("g")
        await asyncio.sleep(1)
        programs.close("s1")
        await asyncio.wait_for(asyncio.gather(*siblings[1:]), 5)   # the others still wait, and go
        return placed, programs

    placed, programs = asyncio.run(scenario())
    assert sorted(placed) == ["g-1", "g-2", "g-3"]
    assert programs.replica("g") == "a" and programs.active_tokens == {"a": 500, "b": 900}


def test_a_failed_request_leaves_its_program_idle_not_running():
    from simulator.vloop import run_virtual
    from tests.loadbalancer.test_balancer_virtual_time import Idle

    async def scenario():
        lb = _balancer(["a"], 100)
        await _turn(lb, "s-0", "s", 3)
        lb.upstreams.modes["a"] = "down"
        with pytest.raises(Exception):
            await _turn(lb, "s-1", "s", 3)
        return lb.programs.programs["s"]

    program = run_virtual(Idle(), scenario())
    assert program.completions == {}        # idle: it can be parked and expire
