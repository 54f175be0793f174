"""Two balancers behind the consistent-hash client (real processes): the controller keeps both tables in line;
one is killed (SIGKILL) under 1,000 requests and each request still completes exactly once."""

from __future__ import annotations

import collections

import pytest

from mesh_runtime.channels import open_channel
from mesh_runtime.hash_ring import HashRingChannel, open_balancer_channel
from tests.controller.scaling.helpers import Procs, lb_stub, routed, until
from tests.loadbalancer.under_load import requests_through_a_kill

pytestmark = pytest.mark.timeout(240)
CONTROLLER = """load_balancer_address: {lb}
lease_ttl_s: 5
load_report_interval_s: 0.2
reconcile_interval_s: 0.5
"""
REQUESTS = 1000


async def test_killing_one_of_two_balancers_under_load_loses_and_duplicates_nothing(tmp_path):
    procs = Procs(tmp_path)
    try:
        lb1, lb2 = procs.start("lb1", "lb", ""), procs.start("lb2", "lb", "")
        ctl = procs.start("controller", "controller", CONTROLLER.format(lb=f"{lb1},{lb2}"))
        for node in ("a", "b"):
            procs.agent(node, controller=ctl, slots=1, tps=2000)
        async with open_channel(lb1) as c1, open_channel(lb2) as c2:
            for channel in (c1, c2):   # the controller fills both tables
                async def both_routed(channel=channel):
                    return await routed(lb_stub(channel)) == ["a-s0", "b-s0"]
                await until(both_routed)
        ring = open_balancer_channel(f"{lb1},{lb2}")
        assert isinstance(ring, HashRingChannel)
        stub = lb_stub(ring)
        planned = collections.Counter(ring.order(f"req-{i}")[0] for i in range(REQUESTS))
        assert min(planned.values()) > REQUESTS * 0.35   # the ring spreads ids about evenly
        completed, attempts = await requests_through_a_kill(stub, lambda: procs.kill("lb1"), requests=REQUESTS)
        assert len(completed) == REQUESTS and set(completed.values()) == {1}   # 0 lost, 0 duplicated
        assert sum(attempts.values()) > REQUESTS   # some requests were caught on the killed balancer and resent
        async with open_channel(lb2) as c2:
            assert await routed(lb_stub(c2)) == ["a-s0", "b-s0"]   # the survivor's routing is still right
        await ring.close()
    finally:
        procs.close()
